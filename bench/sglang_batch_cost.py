"""What the SGLang integration adds to one scheduler step, in-process: the
batch span `Scheduler.run_batch` opens and `process_batch_result` ends
(sglang.forward_batch, its request ids, its trace id from the step), in the
black box, with SGLang's own request and trace classes (an untraced request:
its TraceNullContext) and a scheduler whose step makes one recorded kernel
call: each step's batch attaches a new context, in which the call finds its
parent, where the plain scheduler's calls all run in the same one.

    python bench/sglang_batch_cost.py [--steps 2000] [--rounds 5]

Two rows: warm, steps back to back; and cooled, where between steps an 8 MB
tensor is written and 3000 small dicts read, as a model's step leaves the
caches (the real server's step measured 2 to 3 times the warm figure). Each
row is the wrapped scheduler's median time a step minus the plain one's,
measured side by side. Needs SGLang's environment (bash .ci/sglang-env): run
from the project's venv, it runs itself there.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def in_sglang_environment() -> None:
    """Runs this script again with SGLang's interpreter, unless this is it."""
    if importlib.util.find_spec("sglang") is None:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from sglang_server_cost import environment_python

        env = dict(os.environ, PYTHONPATH=ROOT, SGLANG_USE_CPU_ENGINE="1")
        raise SystemExit(subprocess.call([environment_python(), *sys.argv], env=env))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    in_sglang_environment()
    directory = tempfile.mkdtemp(prefix="sok-batch-")
    os.environ.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_BLACKBOX="1", SGLANG_KERNEL_API_LOGDEST="off",
                      SGLANG_KERNEL_API_TRACEFILE=os.path.join(directory, "trace_%i.sgltrace"))
    import torch

    from sglang_otel_kernels.integrations import sglang as integration

    integration.install()  # as `run` does, before SGLang is imported (its logger writes no file)
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.observability.trace import TraceNullContext

    import sglang_otel_kernels as sok
    from sglang_otel_kernels.capture.patches import Instrumentation

    kernel = sok.debug_kernel_api(op_name="bench.kernel")(lambda: None)

    def scheduler_class():
        class Scheduler:
            forward_ct = 0

            def run_batch(self, batch):
                self.forward_ct += 1
                kernel()
                return batch

            def process_batch_result(self, batch, result):
                return None

        return Scheduler

    request = types.SimpleNamespace(rid="0f3c9a1e5b7d4c2a8e6f1b3d5a7c9e0f",
                                    time_stats=types.SimpleNamespace(trace_ctx=TraceNullContext()))
    batch = types.SimpleNamespace(reqs=[request], forward_mode=ForwardMode.DECODE)
    plain, wrapped = scheduler_class(), scheduler_class()
    integration._patch_scheduler(Instrumentation("bench"), types.SimpleNamespace(Scheduler=wrapped))
    big = torch.ones(1 << 21)
    small = [{"a": i, "b": str(i)} for i in range(21000)]

    def cool() -> None:
        big.add_(1.0)
        for item in small[::7]:
            item.get("a")

    def per_step(cls, cooled: bool) -> float:
        scheduler, clock, total = cls(), time.perf_counter_ns, 0
        for _ in range(options.steps):
            if cooled:
                cool()
            began = clock()
            scheduler.process_batch_result(batch, scheduler.run_batch(batch))
            total += clock() - began
        return total / options.steps / 1000

    print(f"python {sys.version.split()[0]}, {options.steps} steps x {options.rounds} rounds, medians; "
          "the black box, one untraced request")
    for cooled in (False, True):
        per_step(plain, cooled), per_step(wrapped, cooled)  # warm-up
        bare, ours = [], []
        for _ in range(options.rounds):
            bare.append(per_step(plain, cooled))
            ours.append(per_step(wrapped, cooled))
        print(f"{'cooled' if cooled else 'warm':7s} the batch span adds {statistics.median(ours) - statistics.median(bare):6.2f} "
              f"us a step (plain scheduler {statistics.median(bare):.2f} us)", flush=True)


if __name__ == "__main__":
    main()
