"""Kernel spans inside request traces: forward_batch, inject and extract."""

import json
import pickle
import signal
import subprocess
import sys

import pytest
from opentelemetry import trace
from opentelemetry.trace import StatusCode

import sglang_otel_kernels as sok
from conftest import clean_env


def by_name(exporter):
    spans = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def test_single_request_batch_is_the_requests_child(record, provider):
    exporter = record(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    with provider.get_tracer("server").start_as_current_span("Req 1") as request:
        carrier = sok.inject()
    with sok.forward_batch([(carrier, "r1")], name="decode") as batch:
        kernel()
    spans = by_name(exporter)
    (decode,) = spans["decode"]
    assert decode.parent.span_id == request.get_span_context().span_id
    assert decode.context.trace_id == request.get_span_context().trace_id
    assert [link.context.span_id for link in decode.links] == [request.get_span_context().span_id]
    assert decode.attributes["sglang.batch.size"] == 1
    assert decode.attributes["sglang.batch.request_ids"] == ("r1",)
    assert spans["k"][0].parent.span_id == decode.context.span_id
    assert "decode.request" not in spans
    assert batch is not None and trace.get_current_span() is trace.INVALID_SPAN


class Req:
    """A request object as an engine keeps it."""

    def __init__(self, rid, traceparent):
        self.rid = rid
        self.traceparent = traceparent


def test_several_requests_link_both_ways(record, provider):
    exporter = record(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    tracer = provider.get_tracer("server")
    contexts = []
    for index in range(5):
        with tracer.start_as_current_span(f"Req {index}") as span:
            contexts.append(span.get_span_context())
    carrier = sok.inject(trace.set_span_in_context(trace.NonRecordingSpan(contexts[2])))
    requests = [
        contexts[0],  # a SpanContext
        (sok.extract(carrier), "req-2"),  # a Context, with an explicit id
        Req("req-3", carrier["traceparent"].replace(f"{contexts[2].span_id:016x}", f"{contexts[3].span_id:016x}")
            .replace(f"{contexts[2].trace_id:032x}", f"{contexts[3].trace_id:032x}")),
        {"traceparent": f"00-{contexts[4].trace_id:032x}-{contexts[4].span_id:016x}-01"},
        {"no": "context"},  # a request without tracing
    ]
    with sok.forward_batch(requests, attributes={"sglang.forward_mode": "decode"}) as batch:
        kernel()
    spans = by_name(exporter)
    (forward,) = spans["forward_batch"]
    assert forward.parent is None  # nothing was current: the batch starts its own trace
    assert forward.attributes["sglang.batch.size"] == 5
    assert forward.attributes["sglang.batch.request_ids"] == ("req-2", "req-3")
    assert forward.attributes["sglang.batch.untraced_requests"] == 1
    assert forward.attributes["sglang.forward_mode"] == "decode"
    linked = [link.context.span_id for link in forward.links]
    assert linked == [contexts[i].span_id for i in (0, 2, 3, 4)]
    members = spans["forward_batch.request"]
    assert sorted(m.context.trace_id for m in members) == sorted(contexts[i].trace_id for i in (0, 2, 3, 4))
    for member in members:
        assert [link.context.span_id for link in member.links] == [forward.context.span_id]
    assert {m.attributes.get("sglang.request.id") for m in members} == {None, "req-2", "req-3"}
    assert spans["k"][0].parent.span_id == forward.context.span_id == batch.get_span_context().span_id


def test_batch_inside_a_scheduler_span_nests_there(record, provider):
    exporter = record(level=1)
    tracer = provider.get_tracer("scheduler")
    with tracer.start_as_current_span("event_loop") as loop:
        with sok.forward_batch(["00-" + "1" * 32 + "-" + "2" * 16 + "-01", "00-" + "3" * 32 + "-" + "4" * 16 + "-01"]):
            pass
    (forward,) = by_name(exporter)["forward_batch"]
    assert forward.parent.span_id == loop.get_span_context().span_id


def test_failed_batch_marks_the_batch_and_its_requests(record, provider):
    exporter = record(level=1)
    error = RuntimeError("CUDA error: device-side assert triggered")
    with pytest.raises(RuntimeError) as info:
        with sok.forward_batch(["00-" + "1" * 32 + "-" + "2" * 16 + "-01", "00-" + "3" * 32 + "-" + "4" * 16 + "-01"]):
            raise error
    assert info.value is error
    spans = by_name(exporter)
    assert spans["forward_batch"][0].status.status_code is StatusCode.ERROR
    assert spans["forward_batch"][0].events[0].name == "exception"
    assert all(s.status.status_code is StatusCode.ERROR for s in spans["forward_batch.request"])


def test_batch_and_requests_are_in_the_trace_file(record, tmp_path):
    record(level=1)
    sok.configure(trace_file=str(tmp_path / "t.sgltrace"))
    with sok.forward_batch([("00-" + "1" * 32 + "-" + "2" * 16 + "-01", "a"), ("00-" + "3" * 32 + "-" + "4" * 16 + "-01", "b")]):
        sok.debug_kernel_api(op_name="k")(lambda: None)()
    spans = {s.name: s for s in sok.read_trace(tmp_path / "t.sgltrace")}
    assert spans["forward_batch"].attributes["sglang.batch.request_ids"] == ("a", "b")
    assert [link[1] for link in spans["forward_batch"].links] == [0x2222222222222222, 0x4444444444444444]
    assert spans["k"].parent_span_id == spans["forward_batch"].span_id


def test_inject_extract_across_pickle_and_process(record, provider, tmp_path):
    record(level=1)
    with provider.get_tracer("tokenizer").start_as_current_span("Req 9") as request:
        carrier = pickle.loads(pickle.dumps(sok.inject()))
    assert set(carrier) == {"traceparent"}
    parent = trace.get_current_span(sok.extract(carrier)).get_span_context()
    assert parent.trace_id == request.get_span_context().trace_id and parent.is_remote
    script = (
        "import sys, pickle, sglang_otel_kernels as sok\n"
        "from opentelemetry import trace\n"
        "carrier = pickle.loads(bytes.fromhex(sys.argv[1]))\n"
        "sok.configure(level=1, log_dest='off', trace_file='sched.sgltrace')\n"
        "with trace.get_tracer('scheduler').start_as_current_span('schedule', context=sok.extract(carrier)):\n"
        "    sok.debug_kernel_api(op_name='k')(lambda: None)()\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script, pickle.dumps(carrier).hex()], cwd=tmp_path, capture_output=True, text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    spans = {s.name: s for s in sok.read_trace(tmp_path / "sched.sgltrace")}
    assert spans["schedule"].trace_id == request.get_span_context().trace_id
    assert spans["schedule"].parent_span_id == request.get_span_context().span_id
    assert spans["schedule"].parent_is_remote
    assert spans["k"].parent_span_id == spans["schedule"].span_id


def test_extract_of_garbage_gives_an_empty_context():
    for junk in ("not a traceparent", {"traceparent": "00-zz-yy-01"}, {}):
        assert not trace.get_current_span(sok.extract(junk)).get_span_context().is_valid


FIRST_REQUEST = """
import os, sys, torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
import sglang_otel_kernels as sok

trace.set_tracer_provider(TracerProvider())  # the application's own, before any kernel
tracer = trace.get_tracer("app")
embedding = sok.debug_kernel_api(op_name="sglang.custom_op.embedding")(
    lambda x: os.abort() if sys.argv[1] == "crash" else x)
with tracer.start_as_current_span("POST /generate", kind=trace.SpanKind.SERVER,
                                  attributes={"sglang.request.id": "first"}):
    with tracer.start_as_current_span("tokenize"):
        pass
    with tracer.start_as_current_span("forward"):
        embedding(torch.ones(2))  # the first kernel call of the process: the trace file is attached here
"""


@pytest.mark.parametrize("ending", ["crash", "ends"])
def test_an_applications_first_request_begun_before_the_first_kernel_is_in_the_file(tmp_path, ending):
    """The request and its child open at the first kernel call started before the trace file was
    attached to the application's provider: their starts are recorded all the same (the open span at
    attachment at once, the others at their end), so the crash report names the request."""
    (tmp_path / "app.py").write_text(FIRST_REQUEST)
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t.sgltrace"))
    proc = subprocess.run([sys.executable, "app.py", ending], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == (-signal.SIGABRT if ending == "crash" else 0), proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert contents.problems == []  # no "span end(s) whose start is not in the file"
    spans = {span.name: span for span in contents.spans}
    assert spans["forward"].parent_span_id == spans["POST /generate"].span_id
    assert spans["sglang.custom_op.embedding"].parent_span_id == spans["forward"].span_id
    if ending == "ends":
        assert not any(span.in_flight for span in contents.spans)
        assert spans["tokenize"].parent_span_id == spans["POST /generate"].span_id  # ended before: its start too
        return
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"),
                             "--json"], capture_output=True, text=True, timeout=120)
    [call] = json.loads(report.stdout)["in_flight"]
    assert call["requests"]["request"] == "POST /generate" and call["requests"]["request_ids"] == ["first"]


def test_a_provider_installed_before_the_package_is_imported_says_what_to_do(tmp_path):
    """Too late to see the spans begin: the span open at the first kernel call is recorded at once, the
    outer ones at their end, and one line at start-up says that a crash before would not name them, and
    what to do."""
    script = FIRST_REQUEST.replace("import sglang_otel_kernels as sok\n", "").replace(
        "tracer = trace.get_tracer", "import sglang_otel_kernels as sok\ntracer = trace.get_tracer")
    (tmp_path / "app.py").write_text(script)
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t.sgltrace"))
    proc = subprocess.run([sys.executable, "app.py", "ends"], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.count("they are in the trace file only once they end") == 1, proc.stderr
    assert "call sok.configure(level=...)) before starting spans" in proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    spans = {span.name: span for span in contents.spans}
    assert contents.problems == [] and "tokenize" not in spans  # ended before anything was attached
    assert spans["forward"].parent_span_id == spans["POST /generate"].span_id
