"""Concurrent calls: every call gets its own span in its own thread's trace,
numbers never repeat, and text-log blocks never interleave."""

import re
import threading

import torch

import sglang_otel_kernels as sok

THREADS = 8
CALLS = 150


def test_many_threads(record, provider, tmp_path):
    log = tmp_path / "kernels.log"
    exporter = record(level=3, log_dest=str(log))
    inner = sok.debug_kernel_api(op_name="inner")(lambda x: x + 1)
    outer = sok.debug_kernel_api(op_name="outer")(lambda x: inner(x))
    tracer = provider.get_tracer("app")
    errors = []
    barrier = threading.Barrier(THREADS)

    def worker(index):
        try:
            barrier.wait()
            with tracer.start_as_current_span(f"request-{index}"):
                for _ in range(CALLS):
                    outer(torch.full((2,), float(index)))
        except Exception as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []

    spans = exporter.get_finished_spans()
    kernels = [s for s in spans if s.name in ("outer", "inner")]
    assert len(kernels) == THREADS * CALLS * 2
    seqs = sorted(s.attributes["sglang.kernel.seq"] for s in kernels)
    assert len(set(seqs)) == len(seqs)
    by_id = {s.context.span_id: s for s in spans}
    for span in kernels:
        parent = by_id[span.parent.span_id]
        if span.name == "inner":
            assert parent.name == "outer"
            parent = by_id[parent.parent.span_id]
        # Each kernel sits in the request of the thread that ran it.
        assert parent.name.startswith("request-")
        assert span.context.trace_id == parent.context.trace_id

    # Every block of the text log is whole: a call header is followed by its
    # own input section, never by another call's lines.
    text = log.read_text()
    blocks = text.split("=" * 80 + "\n")[1:]
    assert len(blocks) == THREADS * CALLS * 2
    pattern = re.compile(
        r"\[[-\d: ]+\] SGLang Kernel API Call: (outer|inner)\n"
        r"Positional input arguments:\n  arg\[0\]=Tensor\(\n(    .*\n){5}    \)\n"
        r"(Output:\n  return=Tensor\(\n(    .*\n){5}    \)\n)*$"
    )
    for block in blocks:
        assert pattern.match(block), block
