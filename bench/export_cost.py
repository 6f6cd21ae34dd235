"""Does a dead collector slow kernel calls? Per-call cost with no OTLP
endpoint, with an endpoint nobody listens on, and with a live local receiver,
measured in one run.

    python bench/export_cost.py [--calls 3000] [--rounds 3]

Each configuration runs in its own process (tracing is set up once per
process), at level 1 with the trace file on, as a server would, in two ways:
a short script's first 20 000 calls, timed from the first call, and then
the steady state (after 3 s of calls). Export is by the sidecar, the
default, or in the process (SGLANG_KERNEL_API_EXPORT_SIDECAR=0). Rounds
alternate the configurations so that drift in the machine's speed hits all
alike. The target: an unreachable endpoint at most 1.05x no endpoint, from
the first second.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading

from local_receiver import live_receiver

CHILD = """
import statistics, sys, time, torch, sglang_otel_kernels as sok
sok.configure(level=1, log_dest="off", trace_file=sys.argv[2])
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w: x)
x, w = torch.randn(4, 4096), torch.randn(4096)
calls = int(sys.argv[1])
start = time.perf_counter()
for _ in range(20000):
    kernel(x, w)
first = (time.perf_counter() - start) / 20000 * 1e6
# Steady state, as a server runs for hours: past the start-up, and past the
# first export attempt (with a dead collector, the one batch that is encoded
# before the first failure pauses the export).
warm_until = time.perf_counter() + 3.0
while time.perf_counter() < warm_until:
    kernel(x, w)
samples = []
for _ in range(5):
    start = time.perf_counter()
    for _ in range(calls):
        kernel(x, w)
    samples.append((time.perf_counter() - start) / calls * 1e6)
print(first, statistics.median(samples))
"""


def unused_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=3000, help="calls per timed repeat (5 repeats per process)")
    parser.add_argument("--rounds", type=int, default=3, help="processes per configuration, alternating")
    options = parser.parse_args(argv)
    server, live = live_receiver()
    base = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    # A short export timeout only makes the process end sooner.
    dead = {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{unused_port()}",
            "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"}
    alive = {"OTEL_EXPORTER_OTLP_ENDPOINT": live, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
    in_process = {"SGLANG_KERNEL_API_EXPORT_SIDECAR": "0"}
    configurations = {
        "no endpoint": {},
        "unreachable, sidecar": dead,
        "live receiver, sidecar": alive,
        "unreachable, in-process": {**dead, **in_process},
        "live receiver, in-process": {**alive, **in_process},
    }
    results: dict[str, list[tuple[float, float]]] = {name: [] for name in configurations}
    directory = tempfile.mkdtemp(prefix="sok-export-bench-")
    try:
        for _ in range(options.rounds):
            for name, extra in configurations.items():
                proc = subprocess.run(
                    [sys.executable, "-c", CHILD, str(options.calls), os.path.join(directory, "t_%i.sgltrace")],
                    env={**base, **extra}, capture_output=True, text=True, timeout=600,
                )
                if proc.returncode != 0:
                    print(proc.stderr, file=sys.stderr)
                    return 1
                first, steady = proc.stdout.split()
                results[name].append((float(first), float(steady)))
    finally:
        server.stop(grace=None)
    first_base = statistics.median(first for first, _ in results["no endpoint"])
    steady_base = statistics.median(steady for _, steady in results["no endpoint"])
    print(f"level 1, trace file on, {options.rounds} processes each, medians: the first 20000 calls of a script, "
          f"then {options.calls} calls x 5 repeats after 3 s")
    print(f"{'configuration':26s} {'first us/call':>14s} {'vs none':>8s} {'steady us/call':>15s} {'vs none':>8s}")
    for name, values in results.items():
        first = statistics.median(value for value, _ in values)
        steady = statistics.median(value for _, value in values)
        print(f"{name:26s} {first:14.2f} {first / first_base:7.2f}x {steady:15.2f} {steady / steady_base:7.2f}x")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    raise SystemExit(main())
