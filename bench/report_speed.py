"""How long `report` takes over the full trace files of a job's ranks.

    python bench/report_speed.py [--ranks 8] [--size 16M] [--keep DIR]

Runs a job of `--ranks` processes on the gloo backend (each step two level-1
kernels and an all-reduce, as tests/rank_worker.py does) until rank 0's
trace file has wrapped: every file is full (`--size` each, the default ring).
Then times `sglang-otel-kernels report DIR` (text, then --json) over the
files, each in a fresh process as a user runs it, and prints the seconds
against the goal: under 5 s for 8 ranks' 16 MiB files.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

WORKER = """
import sys, torch, torch.distributed as dist
import sglang_otel_kernels as sok
from sglang_otel_kernels.record.processor import current_writer
rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
attn = sok.debug_kernel_api(op_name="layer.attn")(lambda x: x)
mlp = sok.debug_kernel_api(op_name="layer.mlp")(lambda x: x)
flag = torch.zeros(1)
while True:
    mlp(attn(flag))
    writer = current_writer()
    flag[0] = float(rank == 0 and writer is not None and writer.wraps > 0)
    dist.all_reduce(flag)  # every rank stops after the step rank 0's ring wrapped in
    if flag[0]:
        break
dist.destroy_process_group()
"""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--ranks", type=int, default=8)
    parser.add_argument("--size", default="16M", help="each rank's trace file size (default 16M)")
    parser.add_argument("--keep", metavar="DIR", help="write the files here and keep them")
    options = parser.parse_args(argv)
    directory = options.keep or tempfile.mkdtemp(prefix="sok-report-speed-")
    os.makedirs(directory, exist_ok=True)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    env.update(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=os.path.join(directory, "trace_%i.sgltrace"),
               SGLANG_KERNEL_API_TRACEFILE_SIZE=options.size)
    started = time.monotonic()
    ranks = [subprocess.Popen([sys.executable, "-c", WORKER, str(rank), str(options.ranks), str(port)], env=env)
             for rank in range(options.ranks)]
    if any(rank.wait(timeout=1800) for rank in ranks):
        print("report_speed: a rank failed", file=sys.stderr)
        return 2
    files = sorted(name for name in os.listdir(directory) if name.endswith(".sgltrace"))
    sizes = sum(os.path.getsize(os.path.join(directory, name)) for name in files)
    print(f"{len(files)} trace files, {sizes / 2**20:.0f} MiB, written in {time.monotonic() - started:.0f} s")
    for extra in ([], ["--json"]):
        started = time.monotonic()
        done = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", directory, *extra],
                              capture_output=True, text=True)
        seconds = time.monotonic() - started
        first = done.stdout.splitlines()[0] if done.stdout and not extra else ""
        print(f"report {' '.join(extra) or '(text)':8s} {seconds:6.2f} s (goal: under 5 s), exit {done.returncode}"
              + (f": {first}" if first else ""))
    if not options.keep:
        shutil.rmtree(directory, ignore_errors=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
