"""What the ring's first lap costs the calls: a fresh trace file's pages
are faulted in by the first write to each (one page a 4 KiB of records),
unless the populating thread (record/tracefile.py `_populate`,
MADV_POPULATE_WRITE) made them present first. Side by side in one run.

    python bench/first_lap.py [--calls 20000] [--rounds 5] [--dir DIR]

Each row runs fresh processes in turn, with the populating thread and
without it (its kernel support switched off in the child), each making one
call to open its file, then `--calls` level-1 or level-3 calls (4x4096 and
4096 float32 CPU tensors, as bench/overhead.py's): the calling thread's
minor page faults a call (getrusage, RUSAGE_THREAD) and its time a call,
medians over `--rounds`, and the ratio. `--dir` puts the trace files there
(a tmpfs such as /dev/shm, a network mount) instead of a new temporary
directory on the disk.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile

CHILD = r"""
import json, os, resource, sys, time, torch
import sglang_otel_kernels as sok
from sglang_otel_kernels.record import tracefile
level, calls, populate, directory = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "on", sys.argv[4]
if not populate:
    tracefile._POPULATE_WRITE = None
sok.configure(level=level, log_dest="off", trace_file=os.path.join(directory, f"t_{os.getpid()}.sgltrace"))
kernel = sok.debug_kernel_api(op_name="bench.kernel")(lambda x, y: x)
x, y = torch.ones(4, 4096), torch.ones(4096)
kernel(x, y)  # the file opens: its populating thread starts
faults = lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
before, began = faults(), time.perf_counter()
for _ in range(calls):
    kernel(x, y)
spent, faulted = time.perf_counter() - began, faults() - before
print(json.dumps({"faults": faulted / calls, "us": spent / calls * 1e6}))
"""


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", default=None)
    options = parser.parse_args()
    print(f"the first {options.calls} calls of a fresh trace file, {options.rounds} rounds of fresh processes "
          f"in turn; medians (the calling thread's faults and time a call)")
    print(f"{'level':>5}  {'faults, none':>13}  {'faults, populated':>17}  {'us, none':>9}  {'us, populated':>13}  "
          f"{'time ratio':>10}")
    for level in (1, 3):
        found: dict = {"off": [], "on": []}
        for _ in range(options.rounds):
            for mode in ("off", "on"):
                with tempfile.TemporaryDirectory(dir=options.dir) as directory:
                    out = subprocess.run([sys.executable, "-c", CHILD, str(level), str(options.calls), mode, directory],
                                         capture_output=True, text=True, timeout=600, check=True).stdout
                found[mode].append(json.loads(out.splitlines()[-1]))
        median = {mode: {key: statistics.median(row[key] for row in rows) for key in ("faults", "us")}
                  for mode, rows in found.items()}
        print(f"{level:>5}  {median['off']['faults']:>13.4f}  {median['on']['faults']:>17.4f}  "
              f"{median['off']['us']:>9.2f}  {median['on']['us']:>13.2f}  {median['on']['us'] / median['off']['us']:>9.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
