"""Span names that never repeat (a request id in every root span's name, as
SGLang's "Req <rid>" spans have) against names that do, side by side in one
run: the recorder's worst single call and the process's memory growth.

    python bench/distinct_names.py [--spans 300000] [--size 16M]

Each configuration runs in its own process (so the memory figure is its own):
SDK spans with the trace-file processor on a ring of --size, named "Req <n>"
(distinct) or "Req" (constant). Prints, per configuration, the median and
the worst per-span time, how many times the ring wrapped, and the growth of
the resident set; then the ratios distinct / constant. Before the name table
was bounded, 600k distinct names grew the process by 100 MB and a wrap
rewrote every name, stalling one call up to 427 ms.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time


def _rss_kib() -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def child(distinct: bool, spans: int, size: int) -> dict:
    from opentelemetry.sdk.trace import TracerProvider

    from sglang_otel_kernels.record import processor, tracefile

    directory = tempfile.mkdtemp()
    writer = tracefile.TraceFileWriter(os.path.join(directory, "t.sgltrace"), capacity=size)
    processor.set_writer(writer)
    provider = TracerProvider()
    provider.add_span_processor(processor.TraceFileProcessor())
    tracer = provider.get_tracer("bench")
    attributes = {"sglang.request.id": "r"}
    for n in range(2000):  # warm up: the file exists, the first names are in
        tracer.start_span(f"warm {n}" if distinct else "Req", attributes=attributes).end()
    before = _rss_kib()
    times = []
    clock = time.perf_counter_ns
    for n in range(spans):
        name = f"Req {n:012x}" if distinct else "Req"
        started = clock()
        tracer.start_span(name, attributes=attributes).end()
        times.append(clock() - started)
    grown = _rss_kib() - before
    writer.close()
    return {"median_us": statistics.median(times) / 1000, "worst_us": max(times) / 1000,
            "wraps": writer.wraps, "rss_growth_mib": grown / 1024, "symbols": len(writer.symbols)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--spans", type=int, default=300_000)
    parser.add_argument("--size", default="16M")
    parser.add_argument("--child", choices=("distinct", "constant"), help=argparse.SUPPRESS)
    options = parser.parse_args()
    from sglang_otel_kernels.config import parse_size

    size = parse_size(options.size)
    if options.child:
        print(json.dumps(child(options.child == "distinct", options.spans, size)))
        return 0
    results = {}
    for kind in ("constant", "distinct"):
        out = subprocess.run([sys.executable, __file__, "--child", kind, "--spans", str(options.spans),
                              "--size", options.size], capture_output=True, text=True, check=True)
        results[kind] = json.loads(out.stdout)
        row = results[kind]
        print(f"{kind:9s} names: median {row['median_us']:6.1f} us  worst {row['worst_us']:8.1f} us  "
              f"wraps {row['wraps']:4d}  symbols {row['symbols']:5d}  RSS +{row['rss_growth_mib']:.1f} MiB")
    constant, distinct = results["constant"], results["distinct"]
    print(f"distinct / constant: median {distinct['median_us'] / constant['median_us']:.2f}x, "
          f"worst {distinct['worst_us'] / constant['worst_us']:.2f}x, "
          f"RSS growth {distinct['rss_growth_mib']:.1f} vs {constant['rss_growth_mib']:.1f} MiB "
          f"({options.spans} spans, {options.size} ring)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
