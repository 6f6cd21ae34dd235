"""Spans a second through the two-tier layout (collector-config/gateway/),
and the CPU a span costs in each tier, with 8 sidecars sending.

    python bench/gateway_throughput.py [--seconds 10] [--rates 100,400,1600] [--decision-wait 30]

Starts what tests/test_gateway.py starts (Jaeger on Badger, 2 gateways at
SAMPLE_PERCENT=100 so every span goes all the way, 2 agents; the binaries
.ci/backends builds), then for each offered rate (spans a second per
process) runs 8 processes (2 nodes of 4), each making requests of 10
level-1 kernel calls in a batch of one (11 spans a trace) paced to that
rate, exported by their sidecars to their node's agent. For each rate it
prints, side by side: the spans offered (the trace files' count), accepted
by the agents, by the gateways, and sent on to Jaeger, as spans a second;
what was refused or failed; and each tier's CPU microseconds a span (its
processes' user+system time over the spans it accepted), and the gateways'
peak resident memory, which tail sampling's decision wait (`--decision-wait`
seconds, the shipped 30 by default) sets: it holds every span of that many
seconds. Where a tier accepts less than is offered, or the senders fall
behind their pace, the layout (or this 2-core machine) is saturated.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests"))
from backends import Jaeger, Otelcol, clean_env, ensure_built  # noqa: E402

from sglang_otel_kernels.record.reader import read_trace_file  # noqa: E402

SENDER = """
import sys, time, random, torch
import sglang_otel_kernels as sok
kernel = sok.debug_kernel_api(op_name="bench.kernel")(lambda x: x)
rate, seconds = float(sys.argv[1]), float(sys.argv[2])
x, rng, sent, start = torch.ones(4), random.Random(), 0, time.monotonic()
while time.monotonic() - start < seconds:
    traceparent = f"00-{rng.getrandbits(128):032x}-{rng.getrandbits(64):016x}-01"
    with sok.forward_batch([(traceparent, "req")], name="decode_batch"):
        for _ in range(10):
            kernel(x)
    sent += 11
    ahead = sent / rate - (time.monotonic() - start)
    if ahead > 0:
        time.sleep(ahead)
print(sent / (time.monotonic() - start))
"""
RANKS_PER_NODE, NODES = 4, 2


def cpu_seconds(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as handle:
        fields = handle.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as handle:
        return next(int(line.split()[1]) for line in handle if line.startswith("VmHWM:")) / 1024


def counter(metrics: dict, prefix: str) -> float:
    return sum(value for name, value in metrics.items() if name.startswith(prefix))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--rates", default="100,400,1600", help="offered spans a second per process, comma-separated")
    parser.add_argument("--decision-wait", type=int, default=30, help="the gateways' DECISION_WAIT, seconds")
    options = parser.parse_args(argv)
    ensure_built()
    work = tempfile.mkdtemp(prefix="sok-gateway-")
    jaeger = Jaeger(work, "gateway/jaeger-badger.yaml", BADGER_DIR=os.path.join(work, "badger"))
    gateways = [Otelcol(work, f"gateway-{n}", "gateway/gateway.yaml", JAEGER_OTLP_ENDPOINT=jaeger.otlp,
                        SAMPLE_PERCENT="100", DECISION_WAIT=f"{options.decision_wait}s",
                        ARCHIVE_PATH=os.path.join(work, f"archive-{n}", "kernels.jsonl")) for n in (1, 2)]
    hosts = "[" + ", ".join(g.address for g in gateways) + "]"
    agents = [Otelcol(work, f"agent-{n}", "gateway/agent.yaml", GATEWAYS=hosts) for n in (1, 2)]
    tiers = {"agents": agents, "gateways": gateways}
    print(f"{'offered/s':>10} {'paced/s':>9} {'agents/s':>9} {'gateways/s':>11} {'to Jaeger/s':>12} "
          f"{'refused+failed':>15} {'agent us/span':>14} {'gateway us/span':>16} {'Jaeger us/span':>15} "
          f"{'gateway peak MiB':>17}")
    try:
        for rate in [float(r) for r in options.rates.split(",")]:
            run = os.path.join(work, f"rate-{int(rate)}")
            os.makedirs(run)
            before = {name: [c.metrics() for c in group] for name, group in tiers.items()}
            cpu_before = {name: sum(cpu_seconds(c.process.pid) for c in group) for name, group in tiers.items()}
            jaeger_cpu = cpu_seconds(jaeger.process.pid)
            senders = []
            for rank in range(RANKS_PER_NODE * NODES):
                env = clean_env(OTEL_SERVICE_NAME="gateway-bench", OTEL_EXPORTER_OTLP_INSECURE="true",
                                OTEL_EXPORTER_OTLP_ENDPOINT=agents[rank // RANKS_PER_NODE].endpoint,
                                SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                                SGLANG_KERNEL_API_TRACEFILE=os.path.join(run, f"rank{rank}_%i.sgltrace"))
                senders.append(subprocess.Popen([sys.executable, "-c", SENDER, str(rate), str(options.seconds)],
                                                cwd=run, env=env, stdout=subprocess.PIPE, text=True))
            paced = sum(float(s.communicate(timeout=600)[0] or 0) for s in senders)
            offered = sum(len(read_trace_file(os.path.join(run, name)).spans) for name in os.listdir(run)
                          if name.endswith(".sgltrace"))
            time.sleep(5 + options.decision_wait)  # the sidecars' last spans, then the gateways' decision wait
            after = {name: [c.metrics() for c in group] for name, group in tiers.items()}

            def delta(tier: str, prefix: str) -> float:
                return sum(counter(b, prefix) - counter(a, prefix) for a, b in zip(before[tier], after[tier]))

            accepted = {tier: delta(tier, "otelcol_receiver_accepted_spans") for tier in tiers}
            to_jaeger = delta("gateways", "otelcol_exporter_sent_spans") / 2  # two pipelines: Jaeger, the archive
            lost = sum(delta(tier, p) for tier in tiers for p in ("otelcol_receiver_refused_spans",
                                                                   "otelcol_exporter_send_failed_spans",
                                                                   "otelcol_exporter_enqueue_failed_spans"))
            cpu = {name: sum(cpu_seconds(c.process.pid) for c in group) - cpu_before[name] for name, group in tiers.items()}
            jaeger_us = (cpu_seconds(jaeger.process.pid) - jaeger_cpu) / max(to_jaeger, 1) * 1e6
            seconds = options.seconds
            print(f"{offered / seconds:10.0f} {paced:9.0f} {accepted['agents'] / seconds:9.0f} "
                  f"{accepted['gateways'] / seconds:11.0f} {to_jaeger / seconds:12.0f} {lost:15.0f} "
                  f"{cpu['agents'] / max(accepted['agents'], 1) * 1e6:14.1f} "
                  f"{cpu['gateways'] / max(accepted['gateways'], 1) * 1e6:16.1f} {jaeger_us:15.1f} "
                  f"{max(peak_mib(g.process.pid) for g in gateways):17.0f}", flush=True)
    finally:
        for collector in (*agents, *gateways):
            collector.close()
        jaeger.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
