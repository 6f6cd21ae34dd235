"""The production black box: kernel calls straight into the trace file,
inside the spans around them, without a span of their own."""

import os

import torch

import sglang_otel_kernels as sok
from conftest import run_python


def blackbox(record, tmp_path, **settings):
    exporter = record(level=1)
    sok.configure(trace_file=str(tmp_path / "t.sgltrace"), blackbox=True, **settings)
    return exporter


def test_calls_sit_inside_the_request_and_make_no_span(record, provider, tmp_path):
    exporter = blackbox(record, tmp_path)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x: x * 2)
    failing = sok.debug_kernel_api(op_name="sglang.custom_op.embedding")(lambda ids: ids[99])
    with provider.get_tracer("server").start_as_current_span("Req 1") as request:
        kernel(torch.ones(2))
        try:
            failing(torch.ones(2))
        except IndexError:
            pass
    kernel(torch.ones(1))  # outside any span
    assert [s.name for s in exporter.get_finished_spans()] == ["Req 1"]
    spans = sok.read_trace(tmp_path / "t.sgltrace")
    calls = [s for s in spans if s.attributes.get("sglang.kernel.blackbox")]
    assert [c.name for c in calls] == ["sglang.custom_op.rmsnorm", "sglang.custom_op.embedding",
                                       "sglang.custom_op.rmsnorm"]
    first, second, third = calls
    context = request.get_span_context()
    assert (first.trace_id, first.parent_span_id) == (context.trace_id, context.span_id)
    assert first.status_code == "UNSET" and first.end_time >= first.start_time
    assert first.thread_name == "MainThread"
    assert second.status_code == "ERROR"
    assert second.status_description.startswith("IndexError: index 99 is out of bounds")
    assert second.events[0][2]["exception.type"] == "IndexError"
    assert third.parent_span_id == 0
    assert [c.attributes["sglang.kernel.seq"] for c in calls] == sorted(c.attributes["sglang.kernel.seq"] for c in calls)
    assert len({c.span_id for c in calls}) == 3


def test_crash_leaves_the_running_call_with_its_name(tmp_path):
    script = (
        "import os, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file='t.sgltrace', blackbox=True)\n"
        "ok = sok.debug_kernel_api(op_name='sglang.custom_op.ok')(lambda: None)\n"
        "for _ in range(5): ok()\n"
        "sok.debug_kernel_api(op_name='sglang.custom_op.dies')(lambda: os.kill(os.getpid(), 9))()\n"
    )
    proc = run_python(script, tmp_path)
    assert proc.returncode == -9
    spans = sok.read_trace(tmp_path / "t.sgltrace")
    assert [(s.name, s.in_flight) for s in spans] == [("sglang.custom_op.ok", False)] * 5 + [
        ("sglang.custom_op.dies", True)]
    assert spans[-1].attributes["sglang.kernel.in_flight"] is True


def test_names_survive_the_ring_wrapping(record, tmp_path):
    blackbox(record, tmp_path, trace_file_size=64 * 1024)
    kernels = [sok.debug_kernel_api(op_name=f"k{i}")(lambda: None) for i in range(3)]
    for _ in range(3000):
        for kernel in kernels:
            kernel()
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    names = [s.name for s in contents.spans]
    assert 100 < len(names) < 9000
    assert set(names) == {"k0", "k1", "k2"}  # none left as an unknown site
    seqs = [s.attributes["sglang.kernel.seq"] for s in contents.spans]
    assert seqs == list(range(seqs[0], seqs[0] + len(seqs)))
    assert all(s.thread_name == "MainThread" for s in contents.spans)


def test_fork_child_records_its_own_calls(record, tmp_path):
    blackbox(record, tmp_path)
    sok.configure(trace_file=str(tmp_path / "t_%i.sgltrace"))
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    kernel()
    pid = os.fork()
    if pid == 0:
        kernel()
        kernel()
        os._exit(0)
    os.waitpid(pid, 0)
    assert [s.name for s in sok.read_trace(tmp_path / f"t_{os.getpid()}.sgltrace")] == ["k"]
    assert [s.name for s in sok.read_trace(tmp_path / f"t_{pid}.sgltrace")] == ["k", "k"]


def test_black_box_without_the_sdk(tmp_path):
    script = (
        "import sglang_otel_kernels as sok\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda: None)\n"
        "k(); k()\n"
        "print(sok.trace_file_path())\n"
    )
    env = {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off", "OTEL_SDK_DISABLED": "true",
           "SGLANG_KERNEL_API_BLACKBOX": "1"}
    proc = run_python(script, tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert [s.name for s in sok.read_trace(proc.stdout.strip())] == ["k", "k"]
