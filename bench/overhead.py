"""Per-call cost of the decorator at each level, measured side by side in one run.

    python bench/overhead.py [--calls 2000] [--repeats 7] [--rounds 5]

Each row times the same kernel call (4x4096 and 4096 float32 CPU tensors, as in
a decode step) undecorated, inside a bare OpenTelemetry span, and decorated at
levels 0, 1, 3 and 5: the text log to a file alone; kernel spans into the
trace file with no other span processor (what runs with sidecar export, or
no export); the same with an application processor that takes every ended
kernel span (a no-op one, so the cost is ours: building the finished span
and handing it over); the text log and the trace file; the black box; the
trace file and the black box with the NaN flags (SGLANG_KERNEL_API_NAN_FLAGS),
and the trace file with the kernel's arguments flagged too
(SGLANG_KERNEL_API_NAN_FLAGS_INPUTS=*: its two tensors, before it runs).
Each row's figure is the median over its repeats, and the table is measured
`--rounds` times, row after row, each row reported as its median over the
rounds: this machine slows down now and then for a few hundred
milliseconds, which moved a single row of a single pass. Ratios are against
the bare call and the bare span of the same run. The floor row is a pure-Python wrapper that writes
two CRC'd struct records into a mapped file under a lock, with the
current-span lookup: what any pure-Python recorder of a call pays here. The target row: level 1, text off, no export, at
most 1.5 us above the bare call; with the compiled core (the default where it
is built; SGLANG_KERNEL_API_NATIVE=0 times the pure-Python one), the black box
at most 0.35x the floor row and level 1 into the trace file at most 0.5x; at
level 3, where the compiled core describes the arguments, the trace file at
most 1.0x the floor and the black box at most 0.5x.
The two batch-span rows time `forward_batch` around nothing (SGLang's span
per forward pass, a decode step's), written straight into the trace file
where the provider feeds nothing else, and through the SDK where it does.
"""

from __future__ import annotations

import argparse
import itertools
import os
import shutil
import statistics
import sys
import tempfile
import time

import torch
from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

import sglang_otel_kernels as sok
from sglang_otel_kernels.record import core


def kernel(x, weight, eps=1e-6):
    return x


def floor_wrapper(fn, directory: str):
    """`fn` wrapped by the least a crash-safe pure-Python recorder does."""
    import mmap
    import struct
    import threading
    import zlib

    from opentelemetry import trace

    header, start, end = struct.Struct("<IIQII"), struct.Struct("<QQQQqQIBBQB"), struct.Struct("<QqB")
    fd = os.open(os.path.join(directory, "floor.bin"), os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, 1 << 24)
    view = memoryview(mmap.mmap(fd, 1 << 24))
    state = {"offset": 0, "sequence": 0}
    lock = threading.Lock()

    def write(encoding, payload, _crc=zlib.crc32, _pack=header.pack):
        length = len(payload)
        crc = _crc(payload)
        with lock:
            offset = state["offset"]
            if offset + 64 > 1 << 23:
                offset = 0
            state["sequence"] += 1
            view[offset : offset + 24 + length] = _pack(0x524B4F53, length, state["sequence"], crc, encoding) + payload
            state["offset"] = offset + ((24 + length + 7) & -8)

    def wrapped(*args, _current=trace.get_current_span, **kwargs):
        _current().get_span_context()
        write(5, start.pack(1, 2, 3, 4, 5, 6, 7, 0, 1, 1, 1))
        result = fn(*args, **kwargs)
        write(1, end.pack(3, 5, 0))
        return result

    return wrapped


def per_call_us(fn, args, kwargs, calls: int, repeats: int) -> float:
    for _ in range(min(calls, 200)):
        fn(*args, **kwargs)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn(*args, **kwargs)
        samples.append((time.perf_counter() - start) / calls * 1e6)
    return statistics.median(samples)


def timing_options(description: str, argv: list[str] | None) -> argparse.Namespace:
    """--calls, --repeats and --rounds, as every per-call table here takes them."""
    parser = argparse.ArgumentParser(description=description, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="calls per timed repeat")
    parser.add_argument("--repeats", type=int, default=7, help="timed repeats; the median is reported")
    parser.add_argument("--rounds", type=int, default=5, help="passes over the table; each row's median is reported")
    return parser.parse_args(argv)


def recording_at_level_1(prefix: str) -> str:
    """One thread for torch, and recording at level 1 into a trace file in a
    new directory (no text log, no export): the set-up of a benchmark that
    times a kind of span against a level-1 kernel span; the directory."""
    torch.set_num_threads(1)
    directory = tempfile.mkdtemp(prefix=prefix)
    sok.configure(level=1, log_dest="off", trace_file=os.path.join(directory, "trace_%i.sgltrace"), export_sidecar=False)
    return directory


def stop_recording(directory: str) -> None:
    """Recording off, and the trace files a round's writers left in
    `directory` removed (16 MiB each)."""
    sok.configure(level=0, trace_file="off")
    for name in os.listdir(directory):
        if ".sgltrace" in name:
            os.unlink(os.path.join(directory, name))


def rounds_table(one_round, options: argparse.Namespace) -> dict[str, float]:
    """`one_round()` (a list of (label, us per call)) run `--rounds` times;
    each row printed as its median over the rounds, and returned by label."""
    rounds = [one_round() for _ in range(options.rounds)]
    rows = [(label, statistics.median(r[i][1] for r in rounds)) for i, (label, _) in enumerate(rounds[0])]
    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {options.calls} calls x {options.repeats} "
          f"repeats, median of {options.rounds} rounds")
    print(f"{'call':42s} {'us/call':>9s}")
    for label, value in rows:
        print(f"{label:42s} {value:9.2f}")
    return dict(rows)


def main(argv: list[str] | None = None) -> int:
    options = timing_options(__doc__, argv)

    torch.set_num_threads(1)
    args = (torch.randn(4, 4096), torch.randn(4096))
    kwargs = {"eps": 1e-5}
    provider = TracerProvider()
    tracer = provider.get_tracer("bench")
    with_processor = TracerProvider()
    with_processor.add_span_processor(SpanProcessor())  # takes every ended span, does nothing
    directory = tempfile.mkdtemp(prefix="sok-bench-")
    log_path = os.path.join(directory, "kernels.log")
    trace_path = os.path.join(directory, "trace_%i.sgltrace")

    alone = TracerProvider(sampler=ALWAYS_ON)  # as the one this package makes: the trace file its only processor
    steps = itertools.count()

    def batch_span(*_a, **_kw):
        with sok.forward_batch([(None, "r1")], name="sglang.forward_batch", batch_key=(next(steps), ("r1",))):
            pass

    def in_bare_span(*a, **kw):
        with tracer.start_as_current_span("kernel"):
            return kernel(*a, **kw)

    run = lambda fn: per_call_us(fn, args, kwargs, options.calls, options.repeats)  # noqa: E731
    floored = floor_wrapper(kernel, directory)
    modes = [
        ("text file only", dict(log_dest=log_path, spans=False, trace_file="off", blackbox=False)),
        ("trace file", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=False)),
        ("trace file + processor", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=False,
                                        tracer_provider=with_processor)),
        ("text file + trace file", dict(log_dest=log_path, spans=True, trace_file=trace_path, blackbox=False)),
        ("black box (file only)", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=True)),
        # The NaN flags: the output reduced to a flag a row on its device (here the CPU, where the
        # reduction is synchronous: an upper bound), copied into the flags file every COPY_EVERY calls.
        ("trace file + NaN flags", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=False,
                                        nan_flags=True)),
        ("black box + NaN flags", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=True,
                                       nan_flags=True)),
        ("trace file + NaN inputs", dict(log_dest="off", spans=True, trace_file=trace_path, blackbox=False,
                                         nan_flags=True, nan_flag_inputs=("*",))),
    ]

    def one_round() -> list[tuple[str, str, float]]:
        rows = [("bare call", "-", run(kernel)), ("bare OTel span", "-", run(in_bare_span)),
                ("floor: 2 records", "-", run(floored))]
        sok.configure(level=0, trace_file="off")
        rows.append(("level 0 (identity)", "0", run(sok.debug_kernel_api(kernel))))
        for label, settings in modes:
            for level in (1, 3, 5):
                sok.configure(level=level, **{"tracer_provider": provider, "nan_flags": False, "nan_flag_inputs": (),
                                              **settings})
                rows.append((label, str(level), run(sok.debug_kernel_api(kernel))))
                # Keep the log from growing across runs.
                if os.path.exists(log_path):
                    os.truncate(log_path, 0)
        # SGLang's batch span around each forward pass (one per decode step), one untraced request:
        # straight into the file (this package's own provider), and through the SDK (a processor besides).
        for label, batch_provider in (("batch span: file alone", alone), ("batch span: via the SDK", with_processor)):
            sok.configure(level=1, log_dest="off", spans=True, trace_file=trace_path, blackbox=True,
                          tracer_provider=batch_provider, nan_flags=False)
            rows.append((label, "1", run(batch_span)))
        stop_recording(directory)
        return rows

    rounds = [one_round() for _ in range(options.rounds)]
    shutil.rmtree(directory, ignore_errors=True)
    rows = [(label, level, statistics.median(r[i][2] for r in rounds)) for i, (label, level, _) in enumerate(rounds[0])]
    bare, span, floor = (rows[i][2] for i in range(3))

    print(f"python {sys.version.split()[0]}, torch {torch.__version__}, {options.calls} calls x {options.repeats} repeats, "
          f"median of {options.rounds} rounds; recording core: {core.describe()}")
    print(f"{'mode':24s} {'level':>5s} {'us/call':>9s} {'overhead us':>12s} {'x bare call':>12s} {'x bare span':>12s} "
          f"{'x floor':>8s}")
    for label, level, us in rows:
        print(f"{label:24s} {level:>5s} {us:9.2f} {us - bare:12.2f} {us / bare:12.1f} {us / span:12.2f} {us / floor:8.2f}")
    level_1 = next(us for label, level, us in rows if label == "trace file" and level == "1")
    blackbox = next(us for label, level, us in rows if label == "black box (file only)" and level == "1")
    print(f"target: level 1, text off, no export: {level_1 - bare:.2f} us above the bare call (at most 1.5 us); "
          f"the floor: {floor - bare:.2f} us above it")
    level_3 = next(us for label, level, us in rows if label == "trace file" and level == "3")
    blackbox_3 = next(us for label, level, us in rows if label == "black box (file only)" and level == "3")
    if core.NATIVE:
        print(f"targets of the compiled core: the black box {blackbox / floor:.2f}x the floor (at most 0.35x), "
              f"level 1 into the trace file {level_1 / floor:.2f}x (at most 0.5x); at level 3, arguments described: "
              f"the trace file {level_3 / floor:.2f}x (at most 1.0x), the black box {blackbox_3 / floor:.2f}x "
              "(at most 0.5x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
