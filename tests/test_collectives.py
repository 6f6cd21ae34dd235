"""torch.distributed's collectives recorded as kernel spans, in real
processes with a real (gloo) process group: their attributes, their
per-group numbers, when they are and are not recorded; the process's ranks
in its trace file and resource; the heartbeat and the exit record; the
sidecar's early export of a hung call to a real receiver; batch traces keyed
across ranks."""

import json
import os
import subprocess
import sys
import time

import pytest

import sglang_otel_kernels as sok
from backends import port
from conftest import clean_env, run_python
from otlp_receivers import GrpcReceiver

ONE_RANK = """
import os, torch, torch.distributed as dist
import sglang_otel_kernels as sok
sok.configure(level={level}, log_dest="off", trace_file="t.sgltrace")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
"""

OPS = ONE_RANK + """
x = torch.ones(2, 3)
dist.all_reduce(x)
dist.all_reduce(x, op=dist.ReduceOp.MAX)
work = dist.all_reduce(x, async_op=True); work.wait()
dist.all_gather([torch.empty(2, 3)], x)
dist.all_gather_into_tensor(torch.empty(2, 3), x)
dist.broadcast(x, src=0)
dist.reduce(x, dst=0)
tp = dist.new_group([0], group_desc="tp")
dist.all_reduce(torch.ones(5, dtype=torch.bfloat16), group=tp)
dist.barrier()
try:
    dist.broadcast(x, src=5)  # no such rank: the call raises
except RuntimeError:
    pass
dist.destroy_process_group()  # else gloo may abort as the interpreter exits (about 1 run in 60 here)
"""


def _collectives(path) -> list[dict]:
    return [dict(s.attributes, name=s.name, status=s.status_code) for s in sok.read_trace(path)
            if "sglang.collective.op" in s.attributes]


@pytest.mark.parametrize("level", [1, 3])
def test_each_collective_is_a_span_with_its_group_number_shapes_and_dtypes(tmp_path, level):
    proc = run_python(OPS.format(level=level, port=port()), tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = _collectives(tmp_path / "t.sgltrace")
    got = [(s["name"], s["sglang.collective.group"], s["sglang.collective.seq"]) for s in spans]
    assert got == [("torch.distributed.all_reduce", "default_pg", 1), ("torch.distributed.all_reduce", "default_pg", 2),
                   ("torch.distributed.all_reduce", "default_pg", 3), ("torch.distributed.all_gather", "default_pg", 4),
                   ("torch.distributed.all_gather_into_tensor", "default_pg", 5),
                   ("torch.distributed.broadcast", "default_pg", 6), ("torch.distributed.reduce", "default_pg", 7),
                   ("torch.distributed.all_reduce", "tp", 1),  # a group of its own, counted on its own
                   ("torch.distributed.barrier", "default_pg", 8), ("torch.distributed.broadcast", "default_pg", 9)]
    first, maximum, asynchronous, gather, into, broadcast, reduce, tp, barrier, failed = spans
    assert first["sglang.collective.op"] == "all_reduce" and first["sglang.collective.group_ranks"] == (0,)
    assert first["sglang.collective.input_shapes"] == ("(2, 3)",)
    assert first["sglang.collective.input_dtypes"] == ("torch.float32",)
    assert first["sglang.collective.reduce_op"] == "SUM" and maximum["sglang.collective.reduce_op"] == "MAX"
    assert first["sglang.collective.async_op"] is False and asynchronous["sglang.collective.async_op"] is True
    assert gather["sglang.collective.output_shapes"] == ("(2, 3)",)
    assert into["sglang.collective.output_shapes"] == ("(2, 3)",)
    assert broadcast["sglang.collective.root"] == 0 and reduce["sglang.collective.root"] == 0
    assert tp["sglang.collective.input_dtypes"] == ("torch.bfloat16",)
    assert "sglang.collective.input_shapes" not in barrier
    assert failed["status"] == "ERROR" and failed["sglang.collective.root"] == 5  # it raised: the span says so
    # At level 3 the arguments are described as for any kernel, the collective's attributes beside them.
    assert ("sglang.kernel.input.arg0.shape" in first) is (level >= 3)


def test_nothing_is_wrapped_at_level_0_or_with_collectives_off(tmp_path):
    check = ("import torch, torch.distributed as dist, sglang_otel_kernels as sok\n"
             "{setup}\n"
             "print(dist.all_reduce is dist.distributed_c10d.all_reduce, hasattr(dist.all_reduce, '_debug_kernel_wrapped'))\n")
    for env, setup, wrapped in [({}, "", False),
                                ({"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_COLLECTIVES": "0"}, "", False),
                                ({"SGLANG_KERNEL_API_LOGLEVEL": "1"}, "", True),
                                ({}, "sok.configure(level=1, trace_file='off')", True),
                                ({"SGLANG_KERNEL_API_LOGLEVEL": "1"}, "sok.configure(level=0)", False)]:
        proc = run_python(check.format(setup=setup), tmp_path, env=env)
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True", str(wrapped)], (env, setup, proc.stdout)


EARLY_NAME = """
from torch.distributed import all_reduce as early
import os, torch, torch.distributed as dist
import sglang_otel_kernels as sok
sok.configure(log_dest="off", trace_file="t.sgltrace")
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
early(torch.ones(1))
dist.all_reduce(torch.ones(2))
dist.destroy_process_group()
"""


def test_a_name_bound_before_recording_counts_only_under_the_run_launcher(tmp_path):
    script = tmp_path / "app.py"
    script.write_text(EARLY_NAME.format(port=port()))
    plain = subprocess.run([sys.executable, str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, SGLANG_KERNEL_API_LOGLEVEL="1"))
    assert plain.returncode == 0, plain.stderr
    assert [s["sglang.collective.input_shapes"] for s in _collectives(tmp_path / "t.sgltrace")] == [("(2,)",)]
    script.write_text(EARLY_NAME.format(port=port()))
    launched = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "run", "--level", "1", "--", sys.executable,
                               str(script)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert launched.returncode == 0, launched.stderr
    assert [s["sglang.collective.input_shapes"] for s in _collectives(tmp_path / "t.sgltrace")] == [("(1,)",), ("(2,)",)]


RANKS_LATE = ONE_RANK.replace('dist.init_process_group', 'k = sok.debug_kernel_api(op_name="k")(lambda x: x)\n'
                              'k(1)  # the file is made before the ranks are known\n'
                              'dist.init_process_group') + """
for _ in range({calls}):
    k(1)
dist.all_reduce(torch.ones(1))
dist.destroy_process_group()
"""


@pytest.mark.parametrize("calls", [0, 20000], ids=["one lap", "after many wraps"])
def test_ranks_learnt_after_the_file_was_made_are_in_it_and_on_the_resource(tmp_path, calls):
    rendezvous = port()
    script = RANKS_LATE.format(level=1, port=rendezvous, calls=calls).replace(
        'trace_file="t.sgltrace"', 'trace_file="t.sgltrace", trace_file_size=64 * 1024')
    proc = run_python(script, tmp_path, env={"RANK": "", "WORLD_SIZE": ""})
    assert proc.returncode == 0, proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert contents.metadata["ranks"] == {"rank": 0, "world_size": 1, "job": f"tcp://127.0.0.1:{rendezvous}"}
    if not calls:
        assert contents.problems == []
    exported = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", str(tmp_path / "t.sgltrace")],
                              capture_output=True, text=True, timeout=120)
    resource = {kv["key"]: kv["value"] for kv in json.loads(exported.stdout.splitlines()[0])["resourceSpans"][0][
        "resource"]["attributes"]}
    assert resource["sglang.rank"] == {"intValue": "0"} and resource["sglang.world_size"] == {"intValue": "1"}


@pytest.mark.parametrize("ending, exited", [("pass", True), ("os._exit(0)", False), ("os.abort()", False)])
def test_the_heartbeat_and_exit_record_tell_an_exit_from_a_death(tmp_path, ending, exited):
    proc = run_python("import os, time, torch, sglang_otel_kernels as sok\n"
                      "sok.configure(level=1, log_dest='off', trace_file='t.sgltrace')\n"
                      "sok.debug_kernel_api(op_name='k')(lambda: None)()\n"
                      "time.sleep(2.5)\n" + ending + "\n", tmp_path)
    assert proc.returncode in (0, -6), proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert contents.exited is exited
    [call] = contents.spans
    # The last sign of life is the heartbeat, seconds after the last record,
    # or the traceback of a fatal signal (SIGABRT) after it; os._exit leaves none.
    assert contents.heartbeat - call.end_time >= 1.0e9
    assert (contents.died > contents.heartbeat) is (ending == "os.abort()")
    assert contents.last_alive == max(contents.heartbeat, contents.last_time, contents.died)


HUNG = """
import time, torch, sglang_otel_kernels as sok
sok.configure(level=3, log_dest="off", trace_file="t.sgltrace")
@sok.debug_kernel_api(op_name="layer.slow")
def slow(x):
    time.sleep(4)
    return x
slow(torch.ones(3))
"""


def test_the_sidecar_exports_a_hung_call_early_and_its_final_span_holds_it():
    receiver = GrpcReceiver()
    try:
        directory = __import__("tempfile").mkdtemp()
        child = subprocess.Popen([sys.executable, "-c", HUNG], cwd=directory, stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True,
                                 env={**clean_env("SGLANG_"),
                                      "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint,
                                      "SGLANG_KERNEL_API_HANG_SECONDS": "1"})
        [early] = receiver.wait_for(lambda got: any(s["attributes"].get("sglang.kernel.hung") for s in got), timeout=30)
        assert child.poll() is None  # exported while the call still runs
        assert early["name"] == "layer.slow" and early["attributes"]["sglang.kernel.in_flight"] is True
        assert early["attributes"]["sglang.kernel.in_flight_seconds"] >= 1
        assert early["attributes"]["sglang.kernel.input.arg0.shape"] == (3,)
        assert child.wait(timeout=60) == 0, child.stderr.read()
        spans = receiver.wait_for(lambda got: any(s["name"] == "layer.slow" and not s["attributes"].get(
            "sglang.kernel.hung") for s in got), timeout=30)
        [final] = [s for s in spans if s["name"] == "layer.slow" and not s["attributes"].get("sglang.kernel.hung")]
        assert early["parent_span_id"] == final["span_id"] and early["trace_id"] == final["trace_id"]
        assert "sglang.kernel.in_flight" not in final["attributes"] and final["end"] - final["start"] >= 4e9
        time.sleep(1)
        assert sum(bool(s["attributes"].get("sglang.kernel.hung")) for s in receiver.spans) == 1  # once
    finally:
        receiver.stop()


BATCHES = """
import torch, sglang_otel_kernels as sok
sok.configure(level=1, log_dest="off", trace_file="off")
from opentelemetry import trace
carriers = [("00-" + "a1" * 16 + "-" + "b1" * 8 + "-01", "r1"), ("00-" + "a2" * 16 + "-" + "b2" * 8 + "-01", "r2")]
for key in (7, 7, 8, None):
    with sok.forward_batch(carriers, batch_key=key) as batch:
        print(format(batch.get_span_context().trace_id, "032x"))
with sok.forward_batch(carriers[:1], batch_key=7) as single:
    print(format(single.get_span_context().trace_id, "032x"))
"""


def test_a_batch_key_gives_every_rank_the_same_batch_trace(tmp_path):
    runs = [run_python(BATCHES, tmp_path) for _ in range(2)]
    assert all(run.returncode == 0 for run in runs), runs[0].stderr
    (a, a_again, b, unkeyed, single), (other_a, _, other_b, other_unkeyed, _) = [r.stdout.split() for r in runs]
    assert a == a_again == other_a and b == other_b and a != b  # same key, same trace: in any process
    assert unkeyed != other_unkeyed  # no key: a random trace id, as before
    assert single == "a1" * 16  # a batch of one request sits in the request's trace


def test_collectives_are_recorded_when_one_of_our_modules_imports_torch(tmp_path):
    """torch imported first by one of this package's own modules (an application importing one before torch):
    the hook that records the collectives waits for that import to end, where it found its modules half made
    and said "recording torch.distributed's collectives failed (ImportError ... circular import)"."""
    check = ("import importlib, sglang_otel_kernels\n"
             "importlib.import_module('sglang_otel_kernels.{module}')\n"
             "import torch.distributed as dist\n"
             "print(hasattr(dist.all_reduce, '_debug_kernel_wrapped'))\n")
    for module in ("record.spans", "record.file_spans", "record.tensor_dumps", "record.textlog", "describe.statistics",
                   "capture.collectives", "capture.requests"):
        proc = run_python(check.format(module=module), tmp_path, env={"SGLANG_KERNEL_API_LOGLEVEL": "1"})
        assert proc.returncode == 0, proc.stderr
        assert proc.stdout.split() == ["True"], (module, proc.stdout, proc.stderr)
        assert "failed" not in proc.stderr, (module, proc.stderr)
