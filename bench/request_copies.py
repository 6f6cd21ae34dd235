"""What copying the calls that matter into request traces costs on clean
batches: the code before it and this tree, side by side in one run.

    python bench/request_copies.py [--before REV] [--rounds 5] [--calls 2000] [--spans 100000]

Two figures, each measured for both trees in child processes that import
the package from that tree, rounds alternating so that drift in the
machine's speed hits both alike:

- level 5, a clean rmsnorm-shaped call (8x4096 and 4096 float32 CPU tensors)
  inside `forward_batch` of 8 traced requests, into the trace file (no
  export): us a call, the median of each round's repeats;
- the export sidecar's sustained rate: a trace file of `--spans` level-3
  calls in clean batches of 8 requests (written by the tree's own writer in
  one process), exported by the tree's `follow` in another, as the sidecar
  runs, to a live local gRPC receiver: spans a second, from the first record
  read to the last batch taken.

`--before` defaults to the parent of the commit that added
sglang_otel_kernels/record/batches.py (where copies came in); it is taken
with `git archive`. Prints each figure per tree, the ratio of the medians,
and the median of each round's own ratio (the machine drifts over a run).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile

from local_receiver import live_receiver

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

LEVEL5 = r"""
import os, statistics, sys, tempfile, time, torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
import sglang_otel_kernels as sok
torch.set_num_threads(1)
calls, repeats = int(sys.argv[1]), int(sys.argv[2])
provider = TracerProvider()
trace.set_tracer_provider(provider)
sok.configure(level=5, log_dest="off", trace_file=os.path.join(tempfile.mkdtemp(), "t_%i.sgltrace"),
              export_sidecar=False)
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x)
members = []
for index in range(8):
    with provider.get_tracer("server").start_as_current_span("POST /generate"):
        members.append((sok.inject(), f"req-{index}"))
x, w = torch.randn(8, 4096), torch.randn(4096)
samples = []
with sok.forward_batch(members, name="decode_batch"):
    for _ in range(200):
        kernel(x, w, eps=1e-5)
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            kernel(x, w, eps=1e-5)
        samples.append((time.perf_counter() - start) / calls * 1e6)
print(statistics.median(samples))
"""

WRITE = r"""
import sys, torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
import sglang_otel_kernels as sok
spans, path = int(sys.argv[1]), sys.argv[2]
provider = TracerProvider()
trace.set_tracer_provider(provider)
sok.configure(level=3, log_dest="off", trace_file=path, trace_file_size=256 << 20, export_sidecar=False)
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x)
x, w = torch.randn(8, 4096), torch.randn(4096)
members = []
for index in range(8):
    with provider.get_tracer("server").start_as_current_span("POST /generate"):
        members.append((sok.inject(), f"req-{index}"))
written = 8
while written < spans:
    with sok.forward_batch(members, name="decode_batch"):  # a batch span, 8 request spans, 32 kernel calls
        for _ in range(32):
            kernel(x, w, eps=1e-5)
    written += 41
print(written)
"""

# The sidecar is a process of its own, as `follow` runs beside an application.
FOLLOW = r"""
import inspect, sys, time
from sglang_otel_kernels.live.follow import follow
from sglang_otel_kernels.recover.resend import make_exporter
path, endpoint = sys.argv[1], sys.argv[2]
exporter, target = make_exporter(endpoint, "grpc", 30.0)
# The list of delivered spans, which the sidecar keeps where follow() takes its endpoint.
listing = {"delivered_to": target} if "delivered_to" in inspect.signature(follow).parameters else {}
start = time.perf_counter()
sent, _, dropped = follow(path, exporter, alive=lambda: False, **listing)
elapsed = time.perf_counter() - start
assert dropped == 0, dropped
print(sent / elapsed)
"""


def _before(rev: str | None) -> str:
    if rev is None:
        added = subprocess.run(["git", "log", "--diff-filter=A", "--format=%H", "--",
                                "sglang_otel_kernels/record/batches.py"], cwd=ROOT, capture_output=True, text=True,
                               check=True).stdout.split()
        rev = f"{added[-1]}^" if added else "HEAD"  # not committed yet: HEAD is before
    return rev


def _tree(rev: str) -> str:
    directory = tempfile.mkdtemp(prefix="sok-before-")
    archive = subprocess.run(["git", "archive", rev, "sglang_otel_kernels"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    subprocess.run(["tar", "-x", "-C", directory], input=archive, check=True)
    return directory


def _child(tree: str, script: str, *args: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    env["PYTHONPATH"] = tree
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True, text=True,
                          timeout=1800, cwd=tempfile.gettempdir())
    if proc.returncode != 0:
        raise SystemExit(f"a child failed ({tree}):\n{proc.stderr}")
    return float(proc.stdout.split()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", help="the revision to compare with (default: before request copies)")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=2000, help="level-5 calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--spans", type=int, default=100_000, help="spans in the file the sidecar exports")
    options = parser.parse_args()
    rev = _before(options.before)
    trees = {"before": _tree(rev), "after": ROOT}
    server, endpoint = live_receiver()
    results: dict = {(name, what): [] for name in trees for what in ("level5", "sidecar")}
    try:
        for round_number in range(options.rounds):
            order = list(trees.items()) if round_number % 2 == 0 else list(trees.items())[::-1]
            for name, tree in order:
                results[name, "level5"].append(_child(tree, LEVEL5, str(options.calls), str(options.repeats)))
                path = os.path.join(tempfile.mkdtemp(prefix="sok-copies-"), "t.sgltrace")
                _child(tree, WRITE, str(options.spans), path)
                results[name, "sidecar"].append(_child(tree, FOLLOW, path, endpoint))
                shutil.rmtree(os.path.dirname(path))
    finally:
        server.stop(grace=None)
    median = {key: statistics.median(values) for key, values in results.items()}
    print(f"python {sys.version.split()[0]}; before = {rev}, after = this tree; median of {options.rounds} rounds")
    print(f"{'':52s} {'before':>10s} {'after':>10s} {'after/before':>13s} {'paired':>8s}")
    for what, label in (("level5", "level 5, clean call in a batch of 8 (us/call)"),
                        ("sidecar", "sidecar export, clean level-3 batches (spans/s)")):
        before, after = median["before", what], median["after", what]
        # The machine drifts over a run: each round's own ratio, the two measured back to back, and their median.
        paired = statistics.median(a / b for a, b in zip(results["after", what], results["before", what]))
        print(f"{label:52s} {before:10.2f} {after:10.2f} {after / before:13.3f} {paired:8.3f}")
        print(f"{'  rounds':52s} {' '.join(f'{v:.2f}' for v in results['before', what]):>10s}  |  "
              f"{' '.join(f'{v:.2f}' for v in results['after', what])}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
