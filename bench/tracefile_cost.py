"""What the crash-safe trace file adds per span, measured side by side in one run.

    python bench/tracefile_cost.py [--spans 20000] [--repeats 7]

Times SDK spans (start + end, with the attributes a kernel span carries at
level 1 and at level 3) on one provider without the trace-file processor and
on one with it, in short bursts that alternate, and reports the median of the
per-pair differences and the ratio. Also: the recorder alone (its on_start and
on_end called on spans already made, as the SDK calls them), the same after
the ring has wrapped many times (the cost must not grow with the file), and
fsync=True (msync per record, for power-loss durability). A calibration line
times what REFERENCE.md timed on its machine (json.dumps of a small dict,
2 us there), to scale the figures to that machine.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

from opentelemetry.sdk.trace import SpanProcessor, TracerProvider

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


def recorder_us(tracer, recorder, attributes: dict, spans: int) -> float:
    """The processor's own work: on_start and on_end on spans the SDK made."""
    made = []
    for _ in range(spans):
        span = tracer.start_span("sglang.custom_op.rmsnorm", attributes=attributes)
        span.end()
        made.append((span, span._readable_span()))
    start = time.perf_counter()
    for span, ended in made:
        recorder.on_start(span)
        recorder.on_end(ended)
    return (time.perf_counter() - start) / spans * 1e6


class FloorProcessor(SpanProcessor):
    """The least any crash-safe record can do, twice per span: take the lock,
    checksum and copy a fixed 120-byte record into the ring. Nothing is read
    from the span: what this adds is the floor under the real recorder."""

    def __init__(self, writer: tracefile.TraceFileWriter) -> None:
        self.writer = writer
        self.payload = bytes(120)

    def on_start(self, span, parent_context=None) -> None:
        self.writer.write_record(tracefile.ENCODING_SPAN_START, self.payload)

    def on_end(self, span) -> None:
        self.writer.write_record(tracefile.ENCODING_SPAN_START, self.payload)


def calibration_us(repeats: int = 20000) -> float:
    value = {"a": 1, "b": "x", "c": 2.5}
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats):
            json.dumps(value)
        best = min(best, (time.perf_counter() - start) / repeats * 1e6)
    return best


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
    parser.add_argument("--spans", type=int, default=1000, help="spans per timed burst")
    parser.add_argument("--repeats", type=int, default=31, help="burst pairs; medians are reported")
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
    floor_provider = TracerProvider()
    floor_provider.add_span_processor(FloorProcessor(writer("floor.sgltrace")))
    rows.append(("floor: 2 fixed records a span", *side_by_side(
        bare, floor_provider.get_tracer("bench"), LEVEL1, options.spans, options.repeats)))
    processor.set_writer(writer("alone.sgltrace"))
    alone = {}
    for private in (True, False):  # the SDK's private span fields, or its public properties
        recorder = processor.TraceFileProcessor(private=private)
        alone[private] = statistics.median(recorder_us(bare, recorder, LEVEL1, options.spans)
                                           for _ in range(options.repeats))
    processor.set_writer(None)
    calibration = calibration_us()

    print(f"python {sys.version.split()[0]}, {options.spans} spans a burst x {options.repeats} pairs, medians")
    print(f"calibration: json.dumps of a small dict {calibration:.2f} us here, 2 us in REFERENCE.md "
          f"(this machine {calibration / 2:.2f}x slower)")
    print(f"recorder alone (on_start + on_end, level-1 span): {alone[True]:.2f} us reading the SDK's private "
          f"fields, {alone[False]:.2f} us through its public API (ratio {alone[False] / alone[True]:.2f}; "
          f"this SDK: {'private' if processor.private_fields_present() else 'public'})")
    print(f"{'span':30s} {'no file us':>11s} {'with file us':>13s} {'added us':>9s} {'ratio':>6s}")
    for label, without, with_file, added in rows:
        print(f"{label:30s} {without:11.2f} {with_file:13.2f} {added:9.2f} {with_file / without:6.2f}")
    print(f"records written to the level-3 file: {wrapped._sequence} into a 4 MiB ring (wrapped)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
