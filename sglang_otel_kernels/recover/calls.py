"""One call as a report shows it (`call_summary`): its process, thread,
times, state, inputs and outputs, exception, the batch and requests it
served, its culprit, its CUDA graph. The report, the page and the device
faults read calls through it. Torch-free."""

from __future__ import annotations

import time
from typing import Any

from ..record.reader import RecoveredSpan, TraceFileContents
from ..schema import (BATCH_REQUEST_IDS, BATCH_SIZE, DUMP_DIR, FORWARD_MODE, GRAPH_CAPTURED, GRAPH_FIRST_NONFINITE,
                      GRAPH_ID, GRAPH_REPLAY, GRAPH_SUSPECT, INPUT_PREFIX, MODULE, NAME, NONFINITE, NONFINITE_FLAG,
                      NONFINITE_INPUTS_CHECKED, NONFINITE_REQUESTS, OP_CLASS, PREFIX, REPLAY_NAME, REQUEST_ID, SEQ)
from .batch_failures import culprit_of
from .ranks import rank_of, timestamp

OUTPUT_PREFIX = PREFIX + "output"  # `sglang.kernel.output.shape`, `sglang.kernel.output.0.shape`
STATES = {"UNSET": "ok", "OK": "ok", "ERROR": "error"}  # a span's status, as the report words it
TENSOR_FIELDS = ("shape", "dtype", "device", "stride", "contiguous", "requires_grad",
                  "min", "max", "mean", "nan_count", "inf_count", "has_nan", "has_inf", "stats")


def is_kernel(span: RecoveredSpan) -> bool:
    return NAME in span.attributes


def _grouped(span: RecoveredSpan, prefix: str, strip: str) -> dict[str, Any]:
    """Attributes under `prefix` grouped by path (their key less `strip`:
    an argument's, the output's): a tensor's fields become one dict."""
    grouped: dict[str, Any] = {}
    for key, value in span.attributes.items():
        if not key.startswith(prefix):
            continue
        path = key[len(strip):]
        head, _, field = path.rpartition(".")
        if head and field in TENSOR_FIELDS:
            entry = grouped.setdefault(head, {})
            if isinstance(entry, dict):
                entry[field] = value
                continue
        grouped.setdefault(path, value)
    return grouped


def _texts(value: Any) -> list[str]:
    """Request ids as a list of text, whatever type a file gave them."""
    if isinstance(value, (tuple, list)):
        return [str(item) for item in value]
    return [str(value)]


def _requests_of(span: RecoveredSpan, by_id: dict[int, RecoveredSpan]) -> dict[str, Any] | None:
    """The batch around a call and the requests it served, walking up the
    parents (a CUDA graph's replay names its batch too, but the batch span
    above it, with the requests' traces linked, says more)."""
    current = span
    seen = 0
    while current is not None and seen < 64:
        if (BATCH_REQUEST_IDS in current.attributes or BATCH_SIZE in current.attributes) and not (
                current.name == REPLAY_NAME and by_id.get(current.parent_span_id) is not None):
            found = {
                "batch": current.name,
                "batch_span_id": f"{current.span_id:016x}",
                "request_ids": _texts(current.attributes.get(BATCH_REQUEST_IDS, ())),
                "request_traces": [f"{trace_id:032x}" for trace_id, _, _ in current.links],
            }
            named = span.attributes.get(NONFINITE_REQUESTS)
            if isinstance(named, (tuple, list)):  # the requests whose rows went non-finite, not their batch mates
                named = _texts(named)
                found.update(batch_request_ids=found["request_ids"], request_ids=named, nonfinite_rows=True,
                             request_traces=[f"{trace_id:032x}" for trace_id, _, link in current.links
                                             if str(link.get(REQUEST_ID)) in named])
            return found
        if current.kind == 1:  # SERVER: the request itself
            return {"request": current.name, "trace_id": f"{current.trace_id:032x}",
                    "request_ids": _texts(current.attributes[REQUEST_ID]) if REQUEST_ID in current.attributes else []}
        current = by_id.get(current.parent_span_id)
        seen += 1
    return None


def _text_or_none(value: Any) -> "str | None":
    return value if isinstance(value, str) else None


def process_of(contents: TraceFileContents) -> dict[str, Any]:
    """Who wrote a file: its pid, its global rank when known, the file."""
    return {"pid": contents.metadata.get("pid"), "rank": rank_of(contents), "file": contents.path}


def call_summary(span: RecoveredSpan, by_id: dict[int, RecoveredSpan], contents: TraceFileContents,
                 now: int | None = None) -> dict[str, Any]:
    """One call as the report shows it (`call_lines` renders it). A call in
    flight runs until `now` in a live process, else until the process's
    last sign of life (its heartbeat or newest record)."""
    exception = next((attrs for name, _, attrs in span.events if name == "exception"), None)
    seconds = None
    if span.in_flight:
        until = (now or time.time_ns()) if contents.live else contents.last_alive
        seconds = round(max(until - span.start_time, 0) / 1e9, 1)
    return {
        "name": span.name,
        **process_of(contents),
        "thread": span.thread_name or (str(span.thread_id) if span.thread_id else "unknown"),
        "start": timestamp(span.start_time),
        "duration_us": None if span.end_time is None else round((span.end_time - span.start_time) / 1000, 1),
        "seconds": seconds,
        "status": span.status_code,
        "state": "running" if span.in_flight else STATES.get(span.status_code, str(span.status_code).lower()),
        "description": span.status_description,
        "seq": span.attributes.get(SEQ),
        "module": _text_or_none(span.attributes.get(MODULE)),
        "op_class": _text_or_none(span.attributes.get(OP_CLASS)),
        "inputs": _grouped(span, INPUT_PREFIX, INPUT_PREFIX),  # arg0, eps
        "outputs": _grouped(span, OUTPUT_PREFIX, PREFIX),  # output, output.0
        "nonfinite_seen_by": _nonfinite_seen_by(span),
        "nonfinite": [str(path) for path in span.attributes.get(NONFINITE) or ()],
        "nonfinite_inputs": _nonfinite_inputs(span),
        "dump_dir": span.attributes.get(DUMP_DIR),
        "exception": None if exception is None else {
            "type": exception.get("exception.type"), "message": exception.get("exception.message")},
        "requests": _requests_of(span, by_id),
        "culprit": culprit_of(span),
        "graph": _graph_of(span, contents),
        "trace_id": f"{span.trace_id:032x}",
        "span_id": f"{span.span_id:016x}",
    }


def _nonfinite_seen_by(span: RecoveredSpan) -> "str | None":
    """What says the call made NaN/Inf: "statistics" (level 5: its output
    holds NaN/Inf and its inputs did not), "flags" (its NaN flags were the
    first set in its step), or None."""
    if any(event[0] == "nonfinite_output" for event in span.events):
        return "statistics"
    return "flags" if span.attributes.get(NONFINITE_FLAG) is True else None


def _nonfinite_inputs(span: RecoveredSpan) -> "list[str] | None":
    """Where what says a call made NaN/Inf checked its inputs too, those that
    held NaN/Inf (`input.arg1`; empty: it made NaN/Inf out of finite
    inputs); None where nothing checked them (the NaN flags without
    SGLANG_KERNEL_API_NAN_FLAGS_INPUTS)."""
    seen = _nonfinite_seen_by(span)
    if seen == "statistics":  # level 5 names a call only when its inputs were finite
        return []
    if seen == "flags" and span.attributes.get(NONFINITE_INPUTS_CHECKED) is True:
        return [str(path) for path in span.attributes.get(NONFINITE) or () if str(path).startswith("input.")]
    return None


def _graph_of(span: RecoveredSpan, contents: TraceFileContents) -> dict[str, Any] | None:
    """The CUDA graph a call is about, with its captured kernels: the graph a
    replay ran, or the one whose replay a device error was first seen after
    (`sglang.cuda_graph.suspect`, "graph 3, replay 17"); None for others."""
    attributes = span.attributes
    if GRAPH_REPLAY in attributes:
        graph_id, replay, role = attributes.get(GRAPH_ID), attributes[GRAPH_REPLAY], "replayed"
    else:
        suspect = attributes.get(GRAPH_SUSPECT)
        parts = suspect.replace(",", "").split() if isinstance(suspect, str) else []
        if len(parts) != 4 or not parts[1].isdigit() or not parts[3].isdigit():
            return None
        graph_id, replay, role = int(parts[1]), int(parts[3]), "suspect"
    captured = contents.graphs.get(graph_id)
    if captured is not None:
        calls, left_out = captured
        listed = [{"name": name, "shapes": list(shapes), "dtypes": list(dtypes)} for name, shapes, dtypes in calls]
    else:  # an archive: the in-flight replay carries its graph's calls as text
        listed = [{"name": text, "shapes": [], "dtypes": []} for text in attributes.get(GRAPH_CAPTURED, ())]
        left_out = 0
    return {"id": graph_id, "replay": replay, "role": role, "calls": listed, "left_out": left_out,
            "forward_mode": attributes.get(FORWARD_MODE), "batch_size": attributes.get(BATCH_SIZE),
            "first_nonfinite": attributes.get(GRAPH_FIRST_NONFINITE) if role == "replayed" else None}


def replay_at_death(contents: TraceFileContents) -> RecoveredSpan | None:
    """A dead process's newest CUDA graph replay, ended on the CPU: a graph's
    kernels run on the GPU after `replay()` returns, so a process killed in a
    hang, or by a device error, while they ran has no replay in flight."""
    if contents.live or contents.exited:
        return None
    newest = max((span for span in contents.spans if GRAPH_REPLAY in span.attributes),
                 key=lambda span: span.start_time, default=None)
    return None if newest is None or newest.in_flight else newest  # one in flight is in in_flight already
