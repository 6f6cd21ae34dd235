"""What recording CUDA graphs costs, against a level-1 kernel span, in one run.

    python bench/graph_cost.py [--calls 2000] [--repeats 7] [--rounds 5]

A real CUDA graph needs a GPU (bench/gpu_check.py times one there); here the
recording goes around a stand-in with CUDAGraph's `capture_begin` /
`capture_end` / `replay` methods, all no-ops, through the same seam
(`record_graph_class`) that records torch.cuda.CUDAGraph. Rows, each the
median of its repeats, the table measured `--rounds` times and each row
reported as its median over them:

  - a no-op kernel, bare and recorded at level 1 (the trace file, no text,
    no export): the kernel span's cost; the same with rmsnorm's arguments
    (a 4x4096 and a 4096 tensor, eps), the call bench/overhead.py times;
  - a stand-in replay, bare and recorded (`cuda_graph.replay`, its graph id
    and replay number): the replay span's cost;
  - the same inside `replay_attributes(...)` as the SGLang integration sets
    them (batch size, forward mode, 8 request ids).

Then the graphs' share of the trace file: SGLang captures one decode graph
per batch size (36 by default), each holding a few hundred kernel calls; the
call lists of 36 graphs of 320 calls (2 inputs each) are recorded, and the
bytes they take in the table every lap starts with, the time one GRAPH
record takes, and a wrap's time with and without them are printed.
"""

from __future__ import annotations

import os
import shutil
import time

import torch
from overhead import per_call_us, recording_at_level_1, rounds_table, timing_options

import sglang_otel_kernels as sok
from sglang_otel_kernels.capture.graphs import record_graph_class, replay_attributes
from sglang_otel_kernels.schema import BATCH_REQUEST_IDS, BATCH_SIZE, FORWARD_MODE

GRAPHS, CALLS_PER_GRAPH = 36, 320


class StandInGraph:
    """torch.cuda.CUDAGraph's surface, doing nothing."""

    def capture_begin(self, *args, **kwargs):
        return None

    def capture_end(self):
        return None

    def replay(self):
        return None


def noop(*args, **kwargs):
    return None


def graph_table(directory: str) -> list[tuple[str, float]]:
    """The call lists of GRAPHS graphs in a 64 MiB ring: bytes, time per GRAPH
    record, and a wrap's time with and without them."""
    from sglang_otel_kernels.record.tracefile import ENCODING_MARSHAL, TraceFileWriter, encode

    names = [f"sglang.kernel_{i % 40}" for i in range(CALLS_PER_GRAPH)]  # a layer's kernels, repeated
    rows = []
    for with_graphs in (False, True):
        writer = TraceFileWriter(os.path.join(directory, f"table_{with_graphs}.sgltrace"), capacity=64 << 20)
        for name in set(names):
            writer.symbol(name)
        if with_graphs:
            start = time.perf_counter()
            for graph_id in range(1, GRAPHS + 1):
                calls = tuple((writer.symbol(name), ((graph_id, 4096), (4096,)), ("torch.bfloat16",) * 2)
                              for name in names)
                writer.add_graph(graph_id, calls, 0)
            rows.append(("GRAPH record, one graph of 320 calls (ms)", (time.perf_counter() - start) / GRAPHS * 1e3))
            rows.append(("graph lists in the table (KiB)", len(encode(dict(writer.graphs))) / 1024))
            rows.append(("graphs kept in the table", float(len(writer.graphs))))
            start = time.perf_counter()
            for _ in range(10):
                encode(dict(writer.graphs))
            rows.append(("encoding them for a lap's table (ms)", (time.perf_counter() - start) / 10 * 1e3))
        # A wrap: the lap's table, then the record that did not fit.
        record = b"x" * 4096
        writer.write_record(ENCODING_MARSHAL, record)  # the file is created on the first record
        laps, start = 20, time.perf_counter()
        while writer.wraps < laps:
            writer.write_record(ENCODING_MARSHAL, record)
        label = "with" if with_graphs else "without"
        rows.append((f"ring of 64 MiB: a lap {label} the graph lists (ms)", (time.perf_counter() - start) / laps * 1e3))
        writer.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    options = timing_options(__doc__, argv)

    directory = recording_at_level_1("sok-graph-")
    bare_replay = StandInGraph.replay
    record_graph_class(StandInGraph)
    graph = StandInGraph()
    graph.capture_begin()
    kernel = sok.debug_kernel_api(op_name="bench.kernel")(noop)
    kernel()
    graph.capture_end()
    rmsnorm = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(noop)
    tensors, eps = (torch.randn(4, 4096), torch.randn(4096)), {"eps": 1e-5}
    batch = {BATCH_SIZE: 8, FORWARD_MODE: "DECODE", BATCH_REQUEST_IDS: tuple(f"req-{i:04d}" for i in range(8))}
    run = lambda fn, *args, **kwargs: per_call_us(fn, args, kwargs, options.calls, options.repeats)  # noqa: E731

    def in_batch() -> None:
        with replay_attributes(**batch):
            graph.replay()

    def bare_in_batch() -> None:
        with replay_attributes(**batch):
            bare_replay(graph)

    def one_round() -> list[tuple[str, float]]:
        return [("no-op, bare", run(noop)), ("no-op, level-1 kernel span", run(kernel)),
                ("rmsnorm-shaped no-op, bare", run(noop, *tensors, **eps)),
                ("rmsnorm-shaped no-op, level-1 kernel span", run(rmsnorm, *tensors, **eps)),
                ("stand-in replay, bare", run(bare_replay, graph)),
                ("stand-in replay, recorded", run(graph.replay)),
                ("replay in a batch context, bare", run(bare_in_batch)),
                ("replay in a batch context, recorded", run(in_batch))]

    us = rounds_table(one_round, options)
    sok.configure(level=0, trace_file="off")
    table = graph_table(directory)
    shutil.rmtree(directory, ignore_errors=True)
    span = us["no-op, level-1 kernel span"] - us["no-op, bare"]
    call = us["rmsnorm-shaped no-op, level-1 kernel span"] - us["rmsnorm-shaped no-op, bare"]
    replay = us["stand-in replay, recorded"] - us["stand-in replay, bare"]
    batch_cost = us["replay in a batch context, recorded"] - us["replay in a batch context, bare"]
    print(f"level-1 kernel span: {span:.2f} us without arguments, {call:.2f} us with rmsnorm's (bench/overhead.py's "
          f"call); a replay span: {replay:.2f} us ({replay / span:.2f}x and {replay / call:.2f}x); in a batch "
          f"context: {batch_cost:.2f} us ({batch_cost / span:.2f}x and {batch_cost / call:.2f}x)")
    print(f"{GRAPHS} graphs x {CALLS_PER_GRAPH} calls:")
    for label, value in table:
        print(f"  {label:52s} {value:9.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
