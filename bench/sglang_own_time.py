"""Where a recording setting's time goes on SGLang's real server (CPU),
timed from inside: the compiled core's own time a recorded call (outside
its kernel) and the batch span's, a decode step, against the step.

    python bench/sglang_own_time.py [--setting "black box"] [--requests 3] [--tokens 256]

`sglang_server_cost.py` measures what a setting adds to a step, to within
2 or 3% of it; this says how much of that is this package's own code
running. The core is built once more from this checkout with SOK_TIMING
defined, into a copy of the package: it sums the time its recorded calls
spend outside their kernels (four clock reads a call, about 40 ns each on
an AMD EPYC VM, are in the figure). A sitecustomize in the server times
the batch span: `open_batch` the same way, and its close and end in the
core (the integration's loop over the batch's requests is not in it; a
batch Python opens, with request spans, is closed uncounted). One server, warmed up by one request, then a row per request: its
time a decode step, the calls the core recorded a step (and how many went
through the Python path instead: their own time is not in the figures),
and each part's time a step and share of it. Needs SGLang's environment
(bash .ci/sglang-env), as sglang_server_cost.py does.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import sglang_otel_kernels as sok
from sglang_otel_kernels.schema import SEQ
from sglang_server_cost import (CONTROL, ROOT, SETTINGS, environment_python, generate, hook_directory, hook_output,
                                scheduler_pid, setting_directory, start, stop, tiny_model)

# In every process of the server: the batch span's parts timed; SIGUSR2
# writes the totals so far to <dir>/<pid>.own.
HOOK = """
import json, os, signal, time
if os.environ.get("SGLANG_BENCH_DIR"):
    from sglang_otel_kernels.capture.import_hooks import when_imported
    _batch = [0, 0]  # ns, batch spans entered

    def _timed(owner, name, count=False):
        original = getattr(owner, name)
        def timed(*args, _clock=time.perf_counter_ns, **kwargs):
            began = _clock()
            try:
                return original(*args, **kwargs)
            finally:
                _batch[0] += _clock() - began
                _batch[1] += count
        setattr(owner, name, timed)

    def _requests(module):
        _timed(module, "open_batch", count=True)

    def _write(signum, frame):
        from sglang_otel_kernels.record import core
        calls, own, closed = core.native.timing()  # closed: the core's batch spans' close and end
        path = os.path.join(os.environ["SGLANG_BENCH_DIR"], f"{os.getpid()}.own")
        with open(path + ".part", "w") as out:
            json.dump({"calls": calls, "own": own, "all": core.native.recorded(), "batch": _batch[0] + closed,
                       "batches": _batch[1]}, out)
        os.replace(path + ".part", path)

    when_imported("sglang_otel_kernels.capture.requests", _requests)
    signal.signal(signal.SIGUSR2, _write)
"""


def timing_build(scratch: str) -> str:
    """A copy of this checkout's package with the core built with SOK_TIMING; its root."""
    root = os.path.join(scratch, "timing")
    shutil.copytree(os.path.join(ROOT, "sglang_otel_kernels"), os.path.join(root, "sglang_otel_kernels"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.so"))
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), root)
    subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=root, check=True,
                   env=dict(os.environ, CFLAGS="-DSOK_TIMING"), capture_output=True)
    return root


def totals(directory: str, pid: int) -> dict:
    """The scheduler's totals so far (HOOK's file)."""
    return json.loads(hook_output(directory, pid, ".own", signal.SIGUSR2))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--setting", default="black box", choices=sorted(set(SETTINGS) - {"level 0", CONTROL}))
    parser.add_argument("--requests", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=256, help="decode steps per request")
    options = parser.parse_args()
    python = environment_python()
    level, extra = SETTINGS[options.setting]
    with tempfile.TemporaryDirectory() as scratch:
        model = tiny_model(python, scratch)
        root = timing_build(scratch)
        directory = setting_directory(scratch, "own", options.setting)
        process, port = start(python, model, level, extra, directory, hook_directory(scratch, "own", HOOK), root)
        try:
            generate(port, options.tokens)
            pid = scheduler_pid(process)
            print(f"{options.setting}: a row a request of {options.tokens} decode steps")
            print(f"{'ms/step':>8s} {'calls/step':>10s} {'us/call':>8s} "
                  f"{'calls us/step':>13s} {'share':>6s} {'batch us/step':>13s} {'share':>6s}")
            before = totals(directory, pid)
            for _ in range(options.requests):
                seconds = generate(port, options.tokens)
                after = totals(directory, pid)
                calls, own = after["calls"] - before["calls"], after["own"] - before["own"]
                batch, steps = after["batch"] - before["batch"], max(1, after["batches"] - before["batches"])
                step_us = seconds * 1e6 / options.tokens
                print(f"{step_us / 1000:8.3f} {calls / steps:10.1f} {own / max(1, calls) / 1000:8.2f} "
                      f"{own / steps / 1000:13.1f} {own / steps / 1000 / step_us:6.1%} "
                      f"{batch / steps / 1000:13.1f} {batch / steps / 1000 / step_us:6.1%}", flush=True)
                before = after
        finally:
            stop(process)
        kernel_calls = sum(1 for name in os.listdir(directory) if name.endswith(".sgltrace")
                           for span in sok.read_trace_file(os.path.join(directory, name)).spans
                           if SEQ in span.attributes)
        print(f"kernel calls in the scheduler's trace file: {kernel_calls}, of which the compiled core recorded "
              f"{before['all']} (the others' own time, the Python path's, is not in the figures)")


if __name__ == "__main__":
    main()
