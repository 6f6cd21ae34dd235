"""What the crash-safe trace file adds per span, measured side by side in one run.

    python bench/tracefile_cost.py [--spans 20000] [--repeats 7]

Times SDK spans (start + end, with the attributes a kernel span carries at
level 1 and at level 3) on one provider without the trace-file processor and
on one with it, and reports the difference per span and the ratio. Also: the
same after the ring has wrapped many times (the cost must not grow with the
file) and with fsync=True (msync per record, for power-loss durability).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

from opentelemetry.sdk.trace import TracerProvider

from sglang_otel_kernels.record import processor, tracefile

LEVEL1 = {"sglang.kernel.name": "sglang.custom_op.rmsnorm", "sglang.kernel.level": 1, "sglang.kernel.seq": 1}
LEVEL3 = dict(LEVEL1, **{"sglang.kernel.level": 3})
for _index, _shape in enumerate([(4, 4096), (4096,)]):
    _path = f"sglang.kernel.input.arg{_index}"
    LEVEL3.update(
        {
            _path + ".shape": _shape,
            _path + ".dtype": "torch.float32",
            _path + ".device": "cpu",
            _path + ".stride": (4096, 1)[-len(_shape):],
            _path + ".contiguous": True,
            _path + ".requires_grad": False,
        }
    )
LEVEL3["sglang.kernel.input.eps"] = 1e-5


def burst_us(tracer, attributes: dict, spans: int) -> float:
    start = time.perf_counter()
    for _ in range(spans):
        tracer.start_span("sglang.custom_op.rmsnorm", attributes=attributes).end()
    return (time.perf_counter() - start) / spans * 1e6


def side_by_side(bare, recorded, attributes: dict, spans: int, repeats: int) -> tuple[float, float, float]:
    """Alternates bursts without and with the file, so that drift in the
    machine's speed hits both alike; returns the medians and the median of
    the per-pair differences."""
    burst_us(bare, attributes, min(spans, 1000))
    burst_us(recorded, attributes, min(spans, 1000))
    without, with_file, added = [], [], []
    for _ in range(repeats):
        a = burst_us(bare, attributes, spans)
        b = burst_us(recorded, attributes, spans)
        without.append(a)
        with_file.append(b)
        added.append(b - a)
    return statistics.median(without), statistics.median(with_file), statistics.median(added)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--spans", type=int, default=20000, help="spans per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    options = parser.parse_args(argv)
    directory = tempfile.mkdtemp(prefix="sok-tracefile-bench-")

    bare = TracerProvider().get_tracer("bench")
    recorded_provider = TracerProvider()
    recorded_provider.add_span_processor(processor.TraceFileProcessor())
    recorded = recorded_provider.get_tracer("bench")

    def writer(name: str, **kwargs) -> tracefile.TraceFileWriter:
        return tracefile.TraceFileWriter(os.path.join(directory, name), capacity=4 << 20, **kwargs)

    rows = []
    for label, attributes in (("level-1 span (3 attributes)", LEVEL1), ("level-3 span (16 attributes)", LEVEL3)):
        processor.set_writer(writer(f"{len(attributes)}.sgltrace"))
        rows.append((label, *side_by_side(bare, recorded, attributes, options.spans, options.repeats)))
    # The ring above wrapped already: 4 MiB holds far fewer spans than were timed.
    wrapped = processor.current_writer()
    assert wrapped is not None and wrapped._sequence * 200 > wrapped.capacity
    processor.set_writer(writer("fsync.sgltrace", fsync=True))
    fsync_spans = max(options.spans // 20, 200)
    rows.append(("level-1 span, fsync=True", *side_by_side(bare, recorded, LEVEL1, fsync_spans, options.repeats)))
    processor.set_writer(None)

    print(f"python {sys.version.split()[0]}, {options.spans} spans x {options.repeats} repeats, medians")
    print(f"{'span':30s} {'no file us':>11s} {'with file us':>13s} {'added us':>9s} {'ratio':>6s}")
    for label, without, with_file, added in rows:
        print(f"{label:30s} {without:11.2f} {with_file:13.2f} {added:9.2f} {with_file / without:6.2f}")
    print(f"records written to the level-3 file: {wrapped._sequence} into a 4 MiB ring (wrapped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
