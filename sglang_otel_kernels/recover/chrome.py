"""Recovered spans as a Chrome / Perfetto trace-event timeline: one complete
("X") event per span, threads as tracks; calls that failed or were still
running when the process died are coloured and say so in their arguments."""

from __future__ import annotations

import json
import math
from typing import Any

from ..schema import COPY_OF
from ..record.reader import TraceFileContents


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


# A call still running when the process died ends at the file's newest time;
# when it is itself the newest record it is drawn this wide, so it shows.
IN_FLIGHT_MIN_NS = 1_000_000


def timeline(files: "list[TraceFileContents]") -> dict[str, Any]:
    """One track per thread, numbered 1, 2, ... in each process (Perfetto's
    JSON importer takes 32-bit tids: Python's thread identities do not fit)."""
    events: list[dict[str, Any]] = []
    for contents in files:
        pid = contents.metadata.get("pid", 0)
        ranks = contents.metadata.get("ranks") or {}
        label = f"pid {pid}" + (f" rank {ranks['rank']}" if "rank" in ranks else "")
        events.append({"ph": "M", "name": "process_name", "pid": pid, "args": {"name": label}})
        tracks: dict[int, int] = {}
        for span in contents.spans:
            if COPY_OF in span.attributes:  # a call's copy in a request trace: drawn once, as the call
                continue
            tid = tracks.get(span.thread_id)
            if tid is None:
                tid = tracks[span.thread_id] = len(tracks) + 1
                name = span.thread_name or f"thread {span.thread_id}"
                events.append({"ph": "M", "name": "thread_name", "pid": pid, "tid": tid,
                               "args": {"name": name, "thread_ident": span.thread_id}})
                events.append({"ph": "M", "name": "thread_sort_index", "pid": pid, "tid": tid,
                               "args": {"sort_index": tid}})
            events.append(_event(span, contents.last_alive, pid, tid))
    return {"traceEvents": events, "displayTimeUnit": "ms"}


def _event(span, last_time: int, pid: int, tid: int) -> dict[str, Any]:
    args = {key: _arg(value) for key, value in span.attributes.items()}
    args["status"] = span.status_code
    if span.status_description:
        args["status_description"] = span.status_description
    args["trace_id"] = f"{span.trace_id:032x}"
    args["span_id"] = f"{span.span_id:016x}"
    if span.end_time is not None:
        end = span.end_time
    else:
        end = max(last_time, span.start_time + IN_FLIGHT_MIN_NS)
        args["end"] = "unknown: drawn up to the process's last sign of life (at least 1 ms)"
    event = {"name": span.name, "cat": span.scope_name or "span", "ph": "X", "ts": span.start_time / 1000,
             "dur": max(end - span.start_time, 0) / 1000, "pid": pid, "tid": tid, "args": args}
    if span.in_flight:
        event["name"] += " [IN FLIGHT]"
        event["cname"] = "terrible"
    elif span.status_code == "ERROR":
        event["cname"] = "bad"
    return event


def chrome_json(files: "list[TraceFileContents]") -> str:
    return json.dumps(timeline(files), allow_nan=False)
