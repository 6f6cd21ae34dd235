"""Does a dead collector slow kernel calls? Per-call cost with no OTLP
endpoint, with an endpoint nobody listens on, and with a live local receiver,
measured in one run.

    python bench/export_cost.py [--calls 3000] [--rounds 3]

Each configuration runs in its own process (tracing is set up once per
process), at level 1 with the trace file on, as a server would, timed after
3 s of calls (the steady state); rounds alternate the configurations so that
drift in the machine's speed hits all alike. The goal: an unreachable
endpoint within 10% of no endpoint.
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
print(statistics.median(samples))
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
    configurations = {
        "no endpoint": {},
        # A short export timeout only makes the process end sooner.
        "unreachable endpoint": {"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://127.0.0.1:{unused_port()}",
                                 "OTEL_EXPORTER_OTLP_INSECURE": "true", "OTEL_EXPORTER_OTLP_TIMEOUT": "2"},
        "live local receiver": {"OTEL_EXPORTER_OTLP_ENDPOINT": live, "OTEL_EXPORTER_OTLP_INSECURE": "true"},
    }
    results: dict[str, list[float]] = {name: [] for name in configurations}
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
                results[name].append(float(proc.stdout))
    finally:
        server.stop(grace=None)
    baseline = statistics.median(results["no endpoint"])
    print(f"level 1, trace file on, {options.calls} calls x 5 repeats x {options.rounds} processes, medians")
    print(f"{'configuration':24s} {'us/call':>9s} {'vs no endpoint':>15s}")
    for name, values in results.items():
        value = statistics.median(values)
        print(f"{name:24s} {value:9.2f} {value / baseline:14.2f}x")
    return 0


if __name__ == "__main__":
    threading.current_thread().name = "bench"
    raise SystemExit(main())
