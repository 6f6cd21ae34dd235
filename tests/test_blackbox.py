"""The production black box: kernel calls straight into the trace file,
inside the spans around them, without a span of their own."""

import json
import os
import subprocess
import sys

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


def test_at_level_3_a_killed_call_keeps_its_arguments_metadata_and_level_1_keeps_names(tmp_path):
    """What reproducing a production crash needs first: shapes, dtypes,
    strides, devices of the call SIGKILL cut short. Level 5 in the black
    box records the same metadata and no statistics (it never synchronises)."""
    for level in (1, 3, 5):
        folder = tmp_path / f"level{level}"
        folder.mkdir()
        script = (
            "import os, torch, sglang_otel_kernels as sok\n"
            f"sok.configure(level={level}, log_dest='off', trace_file='t.sgltrace', blackbox=True)\n"
            "ok = sok.debug_kernel_api(op_name='sglang.custom_op.ok')(lambda x, eps: x + 1)\n"
            "ok(torch.ones(2, 3, dtype=torch.float16), eps=1e-6)\n"
            "dies = sok.debug_kernel_api(op_name='sglang.custom_op.dies')(lambda x, w, n: os.kill(os.getpid(), 9))\n"
            "dies(torch.ones(4, 8).t(), torch.empty(5, device='meta', dtype=torch.bfloat16), 7)\n"
        )
        assert run_python(script, folder).returncode == -9
        ok, dies = sok.read_trace(folder / "t.sgltrace")
        assert dies.in_flight and dies.attributes["sglang.kernel.blackbox"] is True
        inputs = {key[len("sglang.kernel.input."):]: value for key, value in dies.attributes.items()
                  if key.startswith("sglang.kernel.input.")}
        if level == 1:
            assert inputs == {} and not any(".output." in key for key in ok.attributes)
            continue
        assert inputs == {
            "arg0.shape": (8, 4), "arg0.dtype": "torch.float32", "arg0.device": "cpu", "arg0.stride": (1, 8),
            "arg0.contiguous": False, "arg0.requires_grad": False,
            "arg1.shape": (5,), "arg1.dtype": "torch.bfloat16", "arg1.device": "meta", "arg1.stride": (1,),
            "arg1.contiguous": True, "arg1.requires_grad": False, "arg2": 7}
        assert ok.attributes["sglang.kernel.input.eps"] == 1e-6
        assert ok.attributes["sglang.kernel.output.shape"] == (2, 3)
        assert ok.attributes["sglang.kernel.output.dtype"] == "torch.float16"
        assert not any(key.endswith((".min", ".nan_count", ".has_nan")) for key in {**ok.attributes, **dies.attributes})
        report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--json",
                                 str(folder / "t.sgltrace")], capture_output=True, text=True, timeout=120)
        (call,) = json.loads(report.stdout)["in_flight"]
        assert call["inputs"]["arg0"]["shape"] == [8, 4] and call["inputs"]["arg1"]["device"] == "meta"


def test_hostile_arguments_at_level_3_are_described_and_never_break_the_call(record, tmp_path):
    """In the black box at level 3 (the compiled core's path, where built):
    a tensor subclass with a __torch_function__, a sparse tensor, an object
    whose attributes and repr raise, a huge list, a str with a lone surrogate:
    each described as the Python path describes it, bounded, the kernel's
    result untouched."""

    class Traced(torch.Tensor):
        seen = 0

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            cls.seen += 1
            return super().__torch_function__(func, types, args, kwargs or {})

    class Hostile:
        def __init__(self):
            self.layer_id = 3

        def __getattr__(self, name):
            raise RuntimeError(f"no {name}")

        def __repr__(self):
            raise RuntimeError("no repr")

    blackbox(record, tmp_path)
    sok.configure(level=3)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.k")(lambda *args: args[-1])
    traced = torch.ones(2, 3).as_subclass(Traced)
    huge = list(range(10**6))
    for _ in range(2):  # the first call of a kernel goes through Python, the second through the compiled core
        assert kernel(traced, torch.ones(3).to_sparse(), Hostile(), huge, "bad\udcff", 7) == 7
    assert Traced.seen > 0  # described through its own torch functions, as the Python path does
    *_, last = [s for s in sok.read_trace(tmp_path / "t.sgltrace") if s.name == "sglang.custom_op.k"]
    a = {key[len("sglang.kernel.input."):]: value for key, value in last.attributes.items()
         if key.startswith("sglang.kernel.input.")}
    assert a["arg0.shape"] == (2, 3) and a["arg0.dtype"] == "torch.float32"
    assert a["arg1.shape"] == (3,) and "arg1.stride" not in a  # sparse: no strides
    assert a["arg2"] == "Hostile(layer_id=3)"
    assert a["arg3"] == "list[1000000]" and [a[f"arg3.{i}"] for i in range(4)] == [0, 1, 2, 3] and "arg3.4" not in a
    assert a["arg4"] == "bad\\udcff" and a["arg5"] == 7  # escaped, as every text we emit
    assert last.attributes["sglang.kernel.output"] == 7
