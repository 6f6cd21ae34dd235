"""Recovered spans as a Chrome / Perfetto trace-event timeline: one complete
("X") event per span, threads as tracks; calls that failed or were still
running when the process died are coloured and say so in their arguments."""

from __future__ import annotations

import json
import math
from typing import Any

from .reader import TraceFileContents


def _arg(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return repr(value)  # JSON has no NaN or Infinity
    if isinstance(value, (tuple, list)):
        return [_arg(item) for item in value]
    if isinstance(value, dict):
        return {str(k): _arg(v) for k, v in value.items()}
    if isinstance(value, bytes):
        return value.hex()
    return value


def timeline(contents: TraceFileContents) -> dict[str, Any]:
    pid = contents.metadata.get("pid", 0)
    ranks = contents.metadata.get("ranks") or {}
    label = f"pid {pid}" + (f" rank {ranks['rank']}" if "rank" in ranks else "")
    events: list[dict[str, Any]] = [{"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}}]
    threads: dict[int, str] = {}
    for span in contents.spans:
        threads.setdefault(span.thread_id, span.thread_name or str(span.thread_id))
        end = span.end_time if span.end_time is not None else max(contents.last_time, span.start_time)
        args = {key: _arg(value) for key, value in span.attributes.items()}
        args["status"] = span.status_code
        if span.status_description:
            args["status_description"] = span.status_description
        args["trace_id"] = f"{span.trace_id:032x}"
        args["span_id"] = f"{span.span_id:016x}"
        event = {
            "name": span.name,
            "cat": span.scope_name or "span",
            "ph": "X",
            "ts": span.start_time / 1000,
            "dur": max(end - span.start_time, 0) / 1000,
            "pid": pid,
            "tid": span.thread_id,
            "args": args,
        }
        if span.in_flight:
            event["name"] += " [IN FLIGHT]"
            event["cname"] = "terrible"
        elif span.status_code == "ERROR":
            event["cname"] = "bad"
        events.append(event)
    events.extend(
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": tid, "args": {"name": name}}
        for tid, name in threads.items()
    )
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def chrome_json(contents: TraceFileContents) -> str:
    return json.dumps(timeline(contents), allow_nan=False)
