"""A tiny decode step with decorated kernels, one request of which carries an
out-of-range token id (the SGLang tutorial's reproducer; on the CPU the
embedding raises instead of a device-side assert). Prints SGLang's text log,
then reads the crash-safe trace file back and shows its spans as a tree."""

from __future__ import annotations

import torch
from opentelemetry import trace
from opentelemetry.trace import StatusCode

from . import configure, read_trace_file, trace_file_path
from .example.model import VOCAB, build_model

K = "sglang.kernel."


def _print_tree(spans) -> None:
    children: dict = {}
    for span in spans:
        children.setdefault(span.parent_span_id, []).append(span)

    def show(span, depth: int) -> None:
        status = f"ERROR {span.status_description}" if span.status_code == "ERROR" else "ok"
        shape = span.attributes.get(K + "input.arg0.shape")
        detail = f" arg0.shape={list(shape)}" if shape is not None else ""
        print(f"  {'  ' * depth}{span.name}{detail}  [{status}]")
        for child in children.get(span.span_id, []):
            show(child, depth + 1)

    for root in children.get(0, []):
        show(root, 0)


def run(level: int = 3) -> int:
    configure(level=level, log_dest="stdout")
    decode_step = build_model()
    tracer = trace.get_tracer("demo.server")
    requests = {"req-0001": [1, 2, 3], "req-0002": [4, 5], "req-0003": [6, VOCAB + 7]}
    failed = []
    for rid, tokens in requests.items():
        with tracer.start_as_current_span(f"Req {rid}", attributes={"request.id": rid}) as request:
            try:
                decode_step(torch.tensor([tokens]))
            except IndexError as exc:
                request.set_status(StatusCode.ERROR, str(exc))
                failed.append(rid)
    path = trace_file_path()
    if path is None:
        print("\nNo trace file (SGLANG_KERNEL_API_TRACEFILE=off, or it could not be created).")
        return 0
    contents = read_trace_file(path)
    print(f"\nTrace file {path}: {len(contents.spans)} spans")
    _print_tree(contents.spans)
    print(f"\nFailed requests: {', '.join(failed) or 'none'}")
    return 0
