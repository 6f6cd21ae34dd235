"""Decorated `async def` kernels: recorded over their whole await, in real
processes (an asyncio event loop with tasks interleaving on one thread, and
a child killed while it awaits)."""

import inspect
import json
import signal
import subprocess
import sys

import sglang_otel_kernels as sok
from conftest import run_python

TASKS = """
import asyncio, torch, sglang_otel_kernels as sok
sok.configure(level=3, log_dest="log.txt", trace_file="t.sgltrace")
inner = sok.debug_kernel_api(op_name="inner")(lambda x: x + 1)

@sok.debug_kernel_api(op_name="slow")
async def slow(x, delay):
    await asyncio.sleep(delay)
    y = inner(x)
    if delay > 0.25:
        raise ValueError("late")  # after the first await: SGLang's decorator never sees it
    return y * 2

async def main():
    return await asyncio.gather(slow(torch.ones(2), 0.3), slow(torch.ones(3), 0.15), return_exceptions=True)

print(asyncio.run(main()))
"""


def test_a_coroutine_is_recorded_over_its_await_and_tasks_do_not_nest_in_each_other(tmp_path):
    proc = run_python(TASKS, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert "[ValueError('late'), tensor([4., 4., 4.])]" in proc.stdout
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    slow = {span.attributes["sglang.kernel.input.arg0.shape"]: span for span in contents.spans if span.name == "slow"}
    inner = {span.attributes["sglang.kernel.input.arg0.shape"]: span for span in contents.spans if span.name == "inner"}
    failed, done = slow[(2,)], slow[(3,)]
    # Each spans its await (0.3 s, 0.15 s), not the making of its coroutine object.
    assert failed.end_time - failed.start_time >= 0.3e9 and done.end_time - done.start_time >= 0.15e9
    # Both started before either ended, on one thread: neither is the other's parent.
    assert failed.parent_span_id == done.parent_span_id == 0 and failed.trace_id != done.trace_id
    # The calls each made nest inside it, in its trace.
    for shape in ((2,), (3,)):
        assert (inner[shape].parent_span_id, inner[shape].trace_id) == (slow[shape].span_id, slow[shape].trace_id)
    assert failed.status_code == "ERROR" and "ValueError: late" in failed.status_description
    assert done.status_code != "ERROR" and done.attributes["sglang.kernel.output.shape"] == (3,)
    log = (tmp_path / "log.txt").read_text()
    assert "SGLang Kernel API Exception: slow (ValueError: late)" in log
    assert "coroutine" not in log  # the output logged is the awaited result


DIES_AWAITING = """
import asyncio, os, torch, sglang_otel_kernels as sok
sok.configure(level=3, log_dest="off", trace_file="t.sgltrace")

@sok.debug_kernel_api(op_name="sglang.custom_op.allgather_async")
async def gather(x):
    print("awaiting", flush=True)
    await asyncio.sleep(60)  # as a transfer that never completes

asyncio.run(gather(torch.ones(4, 8)))
"""


def test_a_process_killed_while_a_coroutine_awaits_leaves_its_call_in_flight(tmp_path):
    (tmp_path / "job.py").write_text(DIES_AWAITING)
    child = subprocess.Popen([sys.executable, "job.py"], cwd=tmp_path, stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "awaiting\n"
    child.send_signal(signal.SIGKILL)
    child.communicate(timeout=60)
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"),
                           "--json"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1, proc.stderr
    [call] = json.loads(proc.stdout)["in_flight"]
    assert call["name"] == "sglang.custom_op.allgather_async" and call["inputs"]["arg0"]["shape"] == [4, 8]


def test_generators_are_recorded_as_sglang_records_them_the_call_that_makes_them(tmp_path):
    script = """
import asyncio, sglang_otel_kernels as sok
sok.configure(level=1, log_dest="off", trace_file="t.sgltrace")

@sok.debug_kernel_api(op_name="agen")
async def agen(n):
    for i in range(n):
        await asyncio.sleep(0)
        yield i

@sok.debug_kernel_api(op_name="gen")
def gen(n):
    yield from range(n)

async def main():
    return [i async for i in agen(3)]

print(asyncio.run(main()), list(gen(2)))
"""
    proc = run_python(script, tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[0, 1, 2] [0, 1]"
    spans = sok.read_trace_file(tmp_path / "t.sgltrace").spans
    assert sorted(span.name for span in spans) == ["agen", "gen"] and not any(span.in_flight for span in spans)


def test_a_decorated_coroutine_function_stays_one_for_frameworks_that_ask(record):
    record(level=1)

    async def kernel():
        return 1

    wrapped = sok.debug_kernel_api(op_name="k")(kernel)
    assert wrapped is not kernel and inspect.iscoroutinefunction(wrapped) and wrapped.__name__ == "kernel"
