"""The calls that matter in every request trace they hit: copies of a batched
kernel span into the request traces of its batch (in-process export, the
sidecar, replay, export), NaN provenance per request, the batch's kernel
count, and the sidecar's list of delivered spans that keeps a later replay
from sending a span twice."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from opentelemetry.trace import StatusCode

import sglang_otel_kernels as sok
from otlp_receivers import GrpcReceiver
from sglang_otel_kernels.describe import statistics
from sglang_otel_kernels.record.ledger import Ledger, read_delivered
from sglang_otel_kernels.recover.otlp_json import read_otlp_json
from conftest import clean_env

K = "sglang.kernel."
COPY_OF = K + "copy_of"


def _requests(provider, count: int, sampled: bool = True) -> list:
    """`count` request contexts (as engines hand them over: a carrier and an id)."""
    tracer = provider.get_tracer("server")
    out = []
    for index in range(count):
        with tracer.start_as_current_span(f"POST /generate {index}"):
            carrier = sok.inject()
        if not sampled:
            carrier["traceparent"] = carrier["traceparent"][:-2] + "00"
        out.append((carrier, f"r{index}"))
    return out


def _by_name(exporter) -> dict:
    spans: dict = {}
    for span in exporter.get_finished_spans():
        spans.setdefault(span.name, []).append(span)
    return spans


def _fails(x):
    raise IndexError("index out of range in self")


def test_a_failed_batched_call_is_copied_under_each_request_span_with_a_link_and_copy_of(record, provider):
    exporter = record(level=3)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.embedding")(_fails)
    members = _requests(provider, 3) + [({"no": "context"}, "untraced")]
    with pytest.raises(IndexError), sok.forward_batch(members, name="decode"):
        kernel(torch.ones(4, 2))
    spans = _by_name(exporter)
    [original] = [s for s in spans["sglang.custom_op.embedding"] if COPY_OF not in s.attributes]
    copies = [s for s in spans["sglang.custom_op.embedding"] if COPY_OF in s.attributes]
    requests = {s.context.span_id: s for s in spans["decode.request"]}
    assert len(copies) == 3 and {c.parent.span_id for c in copies} == set(requests)
    for copy in copies:
        request = requests[copy.parent.span_id]
        assert copy.context.trace_id == request.context.trace_id != original.context.trace_id
        assert copy.context.span_id not in (original.context.span_id, request.context.span_id)
        assert [link.context.span_id for link in copy.links] == [original.context.span_id]
        assert copy.attributes[COPY_OF] == f"{original.context.trace_id:032x}:{original.context.span_id:016x}"
        assert copy.status.status_code is StatusCode.ERROR and copy.status.description == original.status.description
        assert (copy.start_time, copy.end_time, copy.name) == (original.start_time, original.end_time, original.name)
        assert {k: v for k, v in copy.attributes.items() if k != COPY_OF} == dict(original.attributes)
        assert [e.name for e in copy.events] == ["exception"]
    assert len({c.context.span_id for c in copies}) == 3


def test_a_clean_batch_and_a_batch_of_one_add_nothing_to_the_request_traces(record, provider):
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x * 2)
    with sok.forward_batch(_requests(provider, 4), name="decode"):
        kernel(torch.ones(4, 2))
    with pytest.raises(IndexError), sok.forward_batch(_requests(provider, 1), name="alone"):
        sok.debug_kernel_api(op_name="bad")(_fails)(torch.ones(1))
    spans = _by_name(exporter)
    assert len(spans["k"]) == 1 and len(spans["bad"]) == 1
    assert not any(COPY_OF in s.attributes for s in exporter.get_finished_spans())


def test_an_unsampled_request_gets_no_copy(record, provider):
    exporter = record(level=1)
    members = _requests(provider, 2) + _requests(provider, 1, sampled=False)
    with pytest.raises(IndexError), sok.forward_batch(members, name="decode"):
        sok.debug_kernel_api(op_name="bad")(_fails)(torch.ones(1))
    copies = [s for s in _by_name(exporter)["bad"] if COPY_OF in s.attributes]
    assert len(copies) == 2 and all(c.context.trace_flags.sampled for c in copies)


def _nan_rows(x, rows):
    y = x.clone()
    y[rows] = float("nan")
    return y


def test_nan_rows_of_a_decode_batch_name_their_requests_and_only_they_get_the_copy(record, provider):
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(_nan_rows)
    members = _requests(provider, 5)
    with sok.forward_batch(members, name="decode") as batch:
        kernel(torch.ones(5, 3, 8), [3])  # a row per request: request r3's row goes NaN
    spans = _by_name(exporter)
    [original] = [s for s in spans["sglang.custom_op.rmsnorm"] if COPY_OF not in s.attributes]
    assert original.attributes[K + "nonfinite_requests"] == ("r3",)
    assert original.attributes[K + "output.has_nan"] is True
    [copy] = [s for s in spans["sglang.custom_op.rmsnorm"] if COPY_OF in s.attributes]
    [r3] = [s for s in spans["decode.request"] if s.attributes["sglang.request.id"] == "r3"]
    assert copy.parent.span_id == r3.context.span_id and copy.attributes[K + "has_nan"] is True
    assert batch.attributes["sglang.batch.kernel_calls"] == 1


def test_declared_rows_map_a_token_flattened_tensor_to_its_requests(record, provider):
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(_nan_rows)
    with sok.forward_batch(_requests(provider, 3), name="extend", rows=[2, 1, 3]):
        kernel(torch.ones(6, 8), [2, 5])  # rows 0-1: r0, 2: r1, 3-5: r2
        kernel(torch.ones(3, 8), [0])  # one row per request (the last token's logits)
        kernel(torch.ones(7, 8), [0])  # neither: rows unknown, every request gets the copy
    calls = [s for s in _by_name(exporter)["sglang.custom_op.rmsnorm"] if COPY_OF not in s.attributes]
    calls.sort(key=lambda s: s.attributes[K + "seq"])
    assert calls[0].attributes[K + "nonfinite_requests"] == ("r1", "r2")
    assert calls[1].attributes[K + "nonfinite_requests"] == ("r0",)
    assert K + "nonfinite_requests" not in calls[2].attributes
    copies = [s for s in _by_name(exporter)["sglang.custom_op.rmsnorm"] if COPY_OF in s.attributes]
    assert [sum(copy.links[0].context.span_id == call.context.span_id for copy in copies)
            for call in calls] == [2, 1, 3]


@pytest.mark.parametrize("rows, problem", [([1, 2, 3], "3 values for 2 requests"), ([1, -1], "a negative count"),
                                           ("ab", "not a sequence of integers"), (7, "not a sequence of integers"),
                                           ([1.5, 2], "not a sequence of integers")])
def test_rows_that_do_not_fit_the_batch_are_ignored_with_a_warning(record, provider, capsys, monkeypatch, rows,
                                                                   problem):
    monkeypatch.setattr("sglang_otel_kernels.notices._told", set())  # each reason is told once a process
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="k")(_nan_rows)
    with sok.forward_batch(_requests(provider, 2), name="extend", rows=rows):
        kernel(torch.ones(2, 4), [1])  # one row per request still maps
    assert f"forward_batch(rows=...) ignored: {problem}" in capsys.readouterr().err
    [call] = [s for s in _by_name(exporter)["k"] if COPY_OF not in s.attributes]
    assert call.attributes[K + "nonfinite_requests"] == ("r1",)


def test_rows_may_be_numpy_or_torch_integers(record, provider):
    import numpy

    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="k")(_nan_rows)
    with sok.forward_batch(_requests(provider, 2), name="extend", rows=[numpy.int64(3), torch.tensor(1)]):
        kernel(torch.ones(4, 2), [3])
    [call] = [s for s in _by_name(exporter)["k"] if COPY_OF not in s.attributes]
    assert call.attributes[K + "nonfinite_requests"] == ("r1",)


def test_the_per_row_pass_runs_only_on_a_tensor_already_flagged(record, provider, monkeypatch):
    record(level=5)
    asked = []
    original = statistics.nonfinite_rows
    monkeypatch.setattr("sglang_otel_kernels.capture.decorator.nonfinite_rows",
                        lambda info: asked.append(info.shape) or original(info))
    kernel = sok.debug_kernel_api(op_name="k")(_nan_rows)
    with sok.forward_batch(_requests(provider, 4), name="decode"):
        for _ in range(20):
            kernel(torch.ones(4, 16), [])  # clean
        kernel(torch.ones(4, 16), [2])
    assert asked == [(4, 16)]


def test_the_request_spans_carry_the_batch_s_kernel_call_count(record, provider):
    exporter = record(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    outer = sok.debug_kernel_api(op_name="outer")(lambda: kernel())
    with sok.forward_batch(_requests(provider, 3), name="decode"):
        for _ in range(4):
            kernel()
        outer()  # and the one inside it
    kernel()  # after the batch: not its
    spans = _by_name(exporter)
    assert [s.attributes["sglang.batch.kernel_calls"] for s in spans["decode.request"]] == [6, 6, 6]
    assert spans["decode"][0].attributes["sglang.batch.kernel_calls"] == 6


APP = r"""
import os, signal, sys, time, torch
from opentelemetry import trace
import sglang_otel_kernels as sok
sok.configure()
tracer = trace.get_tracer("server")
members = []
for index in range(3):
    with tracer.start_as_current_span(f"POST /generate {index}"):
        members.append((sok.inject(), f"r{index}"))

@sok.debug_kernel_api(op_name="sglang.custom_op.embedding")
def embedding(x, die):
    if die:
        time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGKILL)
    raise IndexError("index out of range in self")

@sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
def rmsnorm(x):
    y = x.clone()
    y[1] = float("nan")
    return y

with sok.forward_batch(members, name="decode"):  # clean
    torch.ones(2)
with sok.forward_batch(members, name="decode"):
    rmsnorm(torch.ones(3, 4))
try:
    with sok.forward_batch(members, name="decode"):
        embedding(torch.ones(3), False)
except IndexError:
    pass
with sok.forward_batch(members, name="decode"):
    embedding(torch.ones(3), DIE)
"""


def _run_app(tmp_path, die: bool, endpoint: str | None, level: int = 5) -> tuple[subprocess.CompletedProcess, str]:
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL=str(level), SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace.sgltrace"), OTEL_SERVICE_NAME="copies")
    if endpoint:
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = endpoint
    proc = subprocess.run([sys.executable, "-c", APP.replace("DIE", str(die))], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    return proc, str(tmp_path / "trace.sgltrace")


def _check_copies(spans: list[dict], died: bool) -> None:
    """Each of the 3 request traces holds the NaN call, the failed call and
    (when the process died) the call in flight, each copied once."""
    requests = {s["span_id"]: s for s in spans if s["name"] == "decode.request"}
    originals = {s["span_id"]: s for s in spans if s["name"].startswith("sglang.custom_op") and COPY_OF not in s["attributes"]}
    copies = [s for s in spans if COPY_OF in s["attributes"]]
    expected = {"sglang.custom_op.rmsnorm": 1, "sglang.custom_op.embedding": 6 if died else 3}
    assert {name: sum(c["name"] == name for c in copies) for name in expected} == expected
    assert len({c["span_id"] for c in copies}) == len(copies)  # each copy its own span id
    for copy in copies:
        original = originals[int(copy["attributes"][COPY_OF].split(":")[1], 16)]
        request = requests[copy["parent_span_id"]]
        assert copy["trace_id"] == request["trace_id"] and copy["links"] == [(original["trace_id"], original["span_id"])]
        assert copy["status"] == original["status"] and copy["start"] == original["start"]
        if copy["name"] == "sglang.custom_op.rmsnorm":
            assert request["attributes"]["sglang.request.id"] == "r1"  # its rows alone went NaN
            assert original["attributes"][K + "nonfinite_requests"] == ("r1",)
    if died:
        in_flight = [c for c in copies if c["attributes"].get(K + "in_flight")]
        assert len(in_flight) == 3 and all(c["status"] == 2 for c in in_flight)
    # Under r1's request span of the NaN batch, and every request span of the failed (and dying) batch:
    # the clean batch added nothing.
    assert len({c["parent_span_id"] for c in copies}) == (7 if died else 4)


@pytest.fixture
def receiver():
    server = GrpcReceiver()
    yield server
    server.stop()


def test_the_sidecar_sends_the_copies_and_replay_after_it_sends_nothing_twice(tmp_path, receiver):
    proc, path = _run_app(tmp_path, die=True, endpoint=receiver.endpoint)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    receiver.wait_for(lambda got: any(K + "in_flight" in s["attributes"] and COPY_OF in s["attributes"] for s in got)
                      and sum(K + "in_flight" in s["attributes"] for s in got) >= 8, timeout=30)
    time.sleep(1)
    sent = list(receiver.spans)
    _check_copies(sent, died=True)
    found, note = read_delivered(path, sok.read_trace_file(path).metadata, receiver.endpoint)
    assert note is None and found == {span.span_id for span in sok.read_trace(path)}  # every span of the file
    again = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--endpoint",
                            receiver.endpoint], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "replayed 0 spans" in again.stdout
    assert f"left out {len(found)} spans the export sidecar had delivered already (--all sends them again)" \
        in again.stdout
    time.sleep(0.5)
    assert len(receiver.spans) == len(sent)
    everything = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--all",
                                 "--endpoint", receiver.endpoint], capture_output=True, text=True, timeout=120)
    assert everything.returncode == 0, everything.stderr
    assert f"replayed {len(sent)} spans" in everything.stdout
    assert f"including {len(found)} spans the export sidecar had delivered already (--all)" in everything.stdout
    receiver.wait_for(lambda got: len(got) == 2 * len(sent))
    _check_copies(receiver.spans[len(sent):], died=True)
    # Another back end got nothing from the sidecar: a replay there sends it all, and says why.
    other = GrpcReceiver()
    try:
        there = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--endpoint",
                                other.endpoint], capture_output=True, text=True, timeout=120)
        assert there.returncode == 0, there.stderr
        assert f"replayed {len(sent)} spans" in there.stdout and "left out" not in there.stdout
        assert f"the export sidecar delivered these spans to {receiver.endpoint}, not to {other.endpoint}: " \
            "all of them are sent" in there.stderr
        _check_copies(other.wait_for(lambda got: len(got) == len(sent)), died=True)
    finally:
        other.stop()


def test_replay_and_export_of_a_file_make_the_same_copies_once(tmp_path, receiver):
    proc, path = _run_app(tmp_path, die=True, endpoint=None)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    replayed = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--endpoint",
                               receiver.endpoint], capture_output=True, text=True, timeout=120)
    assert replayed.returncode == 0, replayed.stderr
    # In flight: the call, its batch and the three request spans; copies: 1 + 3 + 3.
    assert "(5 in flight, 7 copies into request traces)" in replayed.stdout, replayed.stdout
    spans = receiver.wait_for(lambda got: sum(COPY_OF in s["attributes"] for s in got) == 7)
    _check_copies(spans, died=True)
    out = tmp_path / "export.jsonl"
    exported = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", path, "-o", str(out)],
                              capture_output=True, text=True, timeout=120)
    assert exported.returncode == 0, exported.stderr
    ids = [span["spanId"] for line in out.read_text().splitlines() for rs in json.loads(line)["resourceSpans"]
           for ss in rs["scopeSpans"] for span in ss["spans"]]
    assert sorted(int(i, 16) for i in ids) == sorted(s["span_id"] for s in spans)  # the same spans, the same ids
    # Read back, the archive holds the copies as they are; exported again, it makes no second copy;
    # a report of it counts each call once.
    [archive] = read_otlp_json(str(out))
    assert sum(COPY_OF in span.attributes for span in archive.spans) == 7
    again = tmp_path / "again.jsonl"
    subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", str(out), "-o", str(again)], check=True,
                   timeout=120)
    assert sum(line.count("\"sglang.kernel.copy_of\"") for line in again.read_text().splitlines()) == 7
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(out), "--json"],
                            capture_output=True, text=True, timeout=120)
    summary = json.loads(report.stdout)["summary"]["sglang.custom_op.embedding"]
    assert (summary["calls"], summary["errors"], summary["in_flight"]) == (2, 1, 1)


def test_in_process_export_to_an_application_provider_copies_too(tmp_path, receiver):
    script = (
        "import sys\n"
        "from opentelemetry import trace\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import BatchSpanProcessor\n"
        "provider = TracerProvider()\n"
        f"provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint={receiver.endpoint!r}, insecure=True)))\n"
        "trace.set_tracer_provider(provider)\n"
        + APP.replace("sok.configure()\n", "sok.configure()\nimport atexit; atexit.register(provider.shutdown)\n")
        .replace("embedding(torch.ones(3), DIE)", "pass")
    )
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="5", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace.sgltrace"))
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    spans = receiver.wait_for(lambda got: sum(COPY_OF in s["attributes"] for s in got) == 4)
    time.sleep(0.5)
    _check_copies(receiver.spans, died=False)
    # The trace file holds the calls once: copies are made where spans leave it.
    assert not any(COPY_OF in s.attributes for s in sok.read_trace(tmp_path / "trace.sgltrace"))
    assert len(spans) == len(receiver.spans)


def test_the_delivered_list_is_bounded_and_keeps_the_newest(tmp_path):
    trace = str(tmp_path / "t.sgltrace")
    metadata = {"host": "h", "pid": 7, "created": 123}
    ledger = Ledger(trace, metadata, "http://collector:4317", limit=4096)
    for first in range(0, 20_000, 500):
        ledger.add(list(range(first + 1, first + 501)))
    ledger.close()
    found, note = read_delivered(trace, metadata, "http://collector:4317")
    assert note is None and 4096 <= len(found) <= 2 * 4096
    assert set(range(20_000 - 4095, 20_001)) <= found
    assert os.path.getsize(trace + ".delivered") <= 2 * 4096 * 8 + 100


@pytest.mark.parametrize("content, note", [
    (b"garbage, not a list", "not a list of delivered spans"),
    (b"SOKDELIV" + (1).to_bytes(4, "little") + (10**6).to_bytes(4, "little"), "not a list of delivered spans"),
    (None, "belongs to another trace file"),
])
def test_a_delivered_list_that_is_not_this_file_s_is_ignored_and_replay_sends_everything(tmp_path, content, note):
    trace = str(tmp_path / "t.sgltrace")
    if content is None:  # an earlier run's list, left at the path
        Ledger(trace, {"host": "h", "pid": 7, "created": 1}, "http://c:4317", limit=10).add([1, 2, 3])
    else:
        (tmp_path / "t.sgltrace.delivered").write_bytes(content)
    found, said = read_delivered(trace, {"host": "h", "pid": 7, "created": 2}, "http://c:4317")
    assert found is None and note in said


def test_a_new_trace_file_moves_an_earlier_run_s_list_aside_with_it(tmp_path):
    from sglang_otel_kernels.record import tracefile

    path = str(tmp_path / "t.sgltrace")
    first = tracefile.TraceFileWriter(path, capacity=64 * 1024)
    first.append((tracefile.THREAD, 1, "main"))
    metadata = sok.read_trace_file(path).metadata
    Ledger(path, metadata, "http://c:4317", limit=10).add([5])
    first.close()
    second = tracefile.TraceFileWriter(path, capacity=64 * 1024)
    second.append((tracefile.THREAD, 1, "main"))
    [aside] = [name for name in os.listdir(tmp_path) if ".prev-" in name and name.endswith(".sgltrace")]
    assert read_delivered(str(tmp_path / aside), metadata, "http://c:4317") == ({5}, None)
    assert read_delivered(path, sok.read_trace_file(path).metadata, "http://c:4317") == (None, None)
    second.close()


def test_a_batched_call_exported_as_hung_is_copied_into_each_request_trace(tmp_path, receiver):
    script = (
        "import time, torch, sglang_otel_kernels as sok\n"
        "from opentelemetry import trace\n"
        "sok.configure()\n"
        "members = []\n"
        "for index in range(2):\n"
        "    with trace.get_tracer('server').start_as_current_span('POST /generate'):\n"
        "        members.append((sok.inject(), f'r{index}'))\n"
        "stuck = sok.debug_kernel_api(op_name='sglang.custom_op.all_reduce')(lambda x: time.sleep(2.5))\n"
        "with sok.forward_batch(members, name='decode'):\n"
        "    stuck(torch.ones(2))\n"
    )
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="3", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_HANG_SECONDS="1",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace.sgltrace"), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    spans = receiver.wait_for(lambda got: any(s["name"] == "decode" for s in got), timeout=30)
    hung = [s for s in spans if s["attributes"].get(K + "hung") is True]
    [snapshot] = [s for s in hung if COPY_OF not in s["attributes"]]
    copies = [s for s in hung if COPY_OF in s["attributes"]]
    requests = {s["span_id"]: s for s in spans if s["name"] == "decode.request"}
    assert sorted(requests[c["parent_span_id"]]["attributes"]["sglang.request.id"] for c in copies) == ["r0", "r1"]
    assert all(c["attributes"][COPY_OF].endswith(f":{snapshot['span_id']:016x}") for c in copies)
    # The call then ended well: no copy of it (a hang that resolved is in the batch trace alone).
    [call] = [s for s in spans if s["name"] == "sglang.custom_op.all_reduce" and K + "hung" not in s["attributes"]]
    assert call["status"] == 0


def test_the_report_names_the_requests_whose_rows_went_nan_not_their_batch_mates(tmp_path, provider):
    sok.configure(level=5, log_dest="off", spans=True, tracer_provider=provider, trace_file=str(tmp_path / "t.sgltrace"))
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(_nan_rows)
    members = _requests(provider, 5)
    with sok.forward_batch(members, name="decode"):
        kernel(torch.ones(5, 2, 8), [3])
    path = sok.trace_file_path()

    def report(*options: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path, *options],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 3, proc.stderr  # NaN alone: no crash and no failure, the exit status of NaN
        return proc.stdout

    line = "batch decode: NaN/Inf in the rows of r3 (1 of its 5 requests; 1 trace linked)"
    text = report()
    assert line in text.split("First call that produced NaN/Inf from finite inputs:")[1]
    assert text.startswith("the first NaN/Inf from finite inputs came out of sglang.custom_op.rmsnorm, in the rows of "
                           "request r3 ("), text
    requests = json.loads(report("--json"))["first_nonfinite_output"]["requests"]
    trace_of_r3 = members[3][0]["traceparent"].split("-")[1]
    assert requests["request_ids"] == ["r3"] and requests["request_traces"] == [trace_of_r3]
    assert requests["batch_request_ids"] == ["r0", "r1", "r2", "r3", "r4"] and requests["nonfinite_rows"] is True
    report("--html", str(tmp_path / "report.html"))
    assert line in (tmp_path / "report.html").read_text()


def test_a_kernels_only_sidecar_lists_the_applications_spans_too_so_replay_sends_nothing_twice(tmp_path, receiver):
    """The application exports its own spans (its request spans); the sidecar the kernel spans and their
    copies. Both are in the list, so a replay to the sidecar's endpoint sends none of the file's spans."""
    application = GrpcReceiver()
    script = (
        "from opentelemetry import trace\n"
        "from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter\n"
        "from opentelemetry.sdk.trace import TracerProvider\n"
        "from opentelemetry.sdk.trace.export import BatchSpanProcessor\n"
        "provider = TracerProvider()\n"
        f"provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint={application.endpoint!r}, "
        "insecure=True)))\n"
        "trace.set_tracer_provider(provider)\n"
        + APP.replace("sok.configure()\n", "sok.configure()\nimport atexit; atexit.register(provider.shutdown)\n")
        .replace("embedding(torch.ones(3), DIE)", "pass")
    )
    env = clean_env()
    env.update(SGLANG_KERNEL_API_LOGLEVEL="5", SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_EXPORT_SIDECAR="kernels",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace.sgltrace"), OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint)
    try:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        own = application.wait_for(lambda got: sum(s["name"] == "decode.request" for s in got) == 12)
    finally:
        application.stop()
    # The kernel spans and their copies came from the sidecar, the application's spans from the application.
    by_sidecar = receiver.wait_for(lambda got: sum(COPY_OF in s["attributes"] for s in got) == 4)
    time.sleep(0.5)
    assert all(K + "name" in s["attributes"] for s in receiver.spans)
    assert not any(K + "name" in s["attributes"] for s in own)
    _check_copies(own + by_sidecar, died=False)
    path = str(tmp_path / "trace.sgltrace")
    spans = sok.read_trace(path)
    again = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", path, "--endpoint",
                            receiver.endpoint], capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert "replayed 0 spans" in again.stdout and f"left out {len(spans)} spans" in again.stdout, again.stdout
    assert any(K + "name" not in s.attributes for s in spans)  # the application's spans are in the file, and listed
