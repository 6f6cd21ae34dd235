"""What the two clock reads of a recorded call cost, by the clock that
serves them, measured side by side in one run (issue 62).

A recorded call reads CLOCK_REALTIME twice (its start and its end:
native/state.c now_ns, record/spans.py). Where the kernel's clocksource
lets the vDSO serve it (tsc, and kvm-clock or Hyper-V's page where
stable), a read is a few tens of nanoseconds in user space; where it does
not (hpet, acpi_pm, xen on some kernels) each read is a system call. The
rows, each through ctypes so that they carry the same calling cost:

  vdso      clock_gettime(CLOCK_REALTIME) through libc (what the compiled core calls)
  syscall   the same clock through syscall(2): what every read costs on a clocksource without vDSO
  coarse    CLOCK_REALTIME_COARSE: cheap everywhere, but its resolution (printed) is a
            scheduler tick, too coarse for a kernel call's start and end
  ctypes    a ctypes call to libc's abs(): the calling cost the other rows share, their floor

    python bench/clock_cost.py [--reads 200000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import platform
import statistics
import time

CLOCK_REALTIME, CLOCK_REALTIME_COARSE = 0, 5
SYS_CLOCK_GETTIME = {"x86_64": 228, "aarch64": 113}.get(platform.machine())


class Timespec(ctypes.Structure):
    _fields_ = [("tv_sec", ctypes.c_long), ("tv_nsec", ctypes.c_long)]


def rows(libc) -> dict:
    """label -> a function making one read."""
    spec = Timespec()
    pointer = ctypes.byref(spec)
    gettime, syscall, floor = libc.clock_gettime, libc.syscall, libc.abs
    found = {"ctypes": lambda: floor(0),
             "vdso": lambda: gettime(CLOCK_REALTIME, pointer),
             "coarse": lambda: gettime(CLOCK_REALTIME_COARSE, pointer)}
    if SYS_CLOCK_GETTIME is not None:
        found["syscall"] = lambda: syscall(SYS_CLOCK_GETTIME, CLOCK_REALTIME, pointer)
    return found


def ns_a_read(read, reads: int) -> float:
    began = time.perf_counter_ns()
    for _ in range(reads):
        read()
    return (time.perf_counter_ns() - began) / reads


def main(argv: "list[str] | None" = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reads", type=int, default=200_000)
    parser.add_argument("--rounds", type=int, default=7)
    options = parser.parse_args(argv)
    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    try:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as source:
            clocksource = source.read().strip()
    except OSError:
        clocksource = "unknown"
    resolution = Timespec()
    libc.clock_getres(CLOCK_REALTIME_COARSE, ctypes.byref(resolution))
    readers = rows(libc)
    samples: dict = {label: [] for label in readers}
    for _ in range(options.rounds):  # the rows interleaved, round by round
        for label, read in readers.items():
            samples[label].append(ns_a_read(read, options.reads))
    median = {label: statistics.median(values) for label, values in samples.items()}
    floor = median["ctypes"]
    print(f"clocksource {clocksource}; coarse clock's resolution {resolution.tv_nsec / 1e6:g} ms; "
          f"median of {options.rounds} rounds of {options.reads} reads")
    print(f"{'row':8} {'ns a read':>10} {'over ctypes':>12} {'a call (2 reads)':>17}")
    for label, value in median.items():
        over = value - floor
        print(f"{label:8} {value:10.1f} {over:12.1f} {2 * over / 1e3:14.3f} us")
    if "syscall" in median:
        print(f"a system call clock costs {(median['syscall'] - median['vdso']) * 2 / 1e3:.3f} us a call more than "
              f"this host's vDSO one")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
