"""What watching for silent threads costs (record/silence.py), in one run.

    python bench/heartbeat_cost.py [--beats 2000] [--calls 2000] [--rounds 5]

The heartbeat thread, once a second, reads each thread's call counter and
writes the Python stack of a thread silent for SGLANG_KERNEL_API_HANG_SECONDS.
Printed:
- a beat's look, in microseconds, with 8, 64 and 256 threads that have
  recorded calls: when none is silent (every beat of a healthy process),
  and when each one's stack is taken and written (once per silent period);
- a level-1 kernel call into the trace file with the watcher on and off,
  side by side (the watcher adds nothing to the kernel path: the counter it
  reads is kept for the batch's call count anyway; it runs on the heartbeat
  thread, once a second).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import threading
import time

import sglang_otel_kernels as sok
from sglang_otel_kernels.record import processor, silence

from overhead import per_call_us


def _threads(count: int) -> list:
    """`count` threads that each made one call and now wait: (threads, their release)."""
    release = threading.Event()
    ready = threading.Barrier(count + 1)
    kernel = sok.debug_kernel_api(op_name="bench.heartbeat")(lambda: None)

    def worker() -> None:
        kernel()
        ready.wait()
        release.wait()

    threads = [threading.Thread(target=worker, daemon=True) for _ in range(count)]
    for thread in threads:
        thread.start()
    ready.wait()
    return threads, release


def beat_us(writer, count: int, silent: bool, beats: int) -> float:
    """The median microseconds of one watcher's look at `count` waiting threads."""
    threads, release = _threads(count)
    try:
        samples = []
        for _ in range(beats if not silent else max(beats // 20, 5)):
            watcher = silence.SilentThreads(0.0 if silent else 3600.0)
            now = time.time_ns()
            watcher.check(writer, now)  # the first look notes each thread's count
            start = time.perf_counter()
            watcher.check(writer, now + 1)  # silent: every thread's stack written; else counters read alone
            samples.append((time.perf_counter() - start) * 1e6)
        return statistics.median(samples)
    finally:
        release.set()
        for thread in threads:
            thread.join()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--beats", type=int, default=2000)
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--rounds", type=int, default=5)
    options = parser.parse_args()
    directory = tempfile.mkdtemp(prefix="sok-heartbeat-")
    sok.configure(level=1, log_dest="off", trace_file=os.path.join(directory, "t_%i.sgltrace"), export_sidecar=False)
    sok.debug_kernel_api(op_name="bench.first")(lambda: None)()  # the file, and its writer
    writer = processor.current_writer()
    print(f"python {sys.version.split()[0]}")
    print(f"{'threads':>8s} {'quiet beat (us)':>16s} {'silent: stacks written (us)':>28s}")
    for count in (8, 64, 256):
        print(f"{count:8d} {beat_us(writer, count, False, options.beats):16.1f} "
              f"{beat_us(writer, count, True, options.beats):28.1f}")
    wrapped = sok.debug_kernel_api(op_name="bench.kernel")(lambda x: x)
    watching = writer.on_beat
    rounds: dict = {"watcher on": [], "watcher off": []}
    for _ in range(options.rounds):
        for label, on_beat in (("watcher on", watching), ("watcher off", None)):
            writer.on_beat = on_beat
            rounds[label].append(per_call_us(wrapped, (1,), {}, options.calls, options.repeats))
    on, off = (statistics.median(rounds[label]) for label in ("watcher on", "watcher off"))
    print(f"level-1 call, trace file: watcher on {on:.2f} us, off {off:.2f} us ({on / off:.3f}x), "
          f"median of {options.rounds} rounds")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
