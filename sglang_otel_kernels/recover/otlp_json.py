"""Recovered spans as OTLP JSON lines: one `ExportTraceServiceRequest` per
line, in the protobuf JSON mapping with OTLP's hex trace and span ids, as the
Collector's file exporter and the official FileSpanExporter write them.

A span still in flight when the process died ends, in this form, at the
newest time the file holds, with status ERROR and `sglang.kernel.in_flight`.
"""

from __future__ import annotations

import base64
import json
import math
from typing import Any, Iterable, Iterator

from .reader import RecoveredSpan, TraceFileContents

_STATUS_CODES = {"UNSET": 0, "OK": 1, "ERROR": 2}
# Span flags: the W3C trace flags, plus whether the parent is known to be remote.
_HAS_IS_REMOTE = 0x100
_IS_REMOTE = 0x200


def any_value(value: Any) -> dict:
    if isinstance(value, bool):
        return {"boolValue": value}
    if isinstance(value, int):
        return {"intValue": str(value)}
    if isinstance(value, float):
        if math.isfinite(value):
            return {"doubleValue": value}
        return {"doubleValue": "NaN" if math.isnan(value) else ("Infinity" if value > 0 else "-Infinity")}
    if isinstance(value, str):
        return {"stringValue": value}
    if isinstance(value, bytes):
        return {"bytesValue": base64.b64encode(value).decode("ascii")}
    if isinstance(value, (tuple, list)):
        return {"arrayValue": {"values": [any_value(item) for item in value]}}
    if isinstance(value, dict):
        return {"kvlistValue": {"values": key_values(value)}}
    return {"stringValue": repr(value)}


def key_values(attributes: dict) -> list[dict]:
    return [{"key": str(key), "value": any_value(value)} for key, value in attributes.items()]


def span_json(span: RecoveredSpan, last_time: int) -> dict:
    end_time = span.end_time if span.end_time is not None else max(last_time, span.start_time)
    flags = (span.trace_flags & 0xFF) | _HAS_IS_REMOTE | (_IS_REMOTE if span.parent_is_remote else 0)
    out = {
        "traceId": f"{span.trace_id:032x}",
        "spanId": f"{span.span_id:016x}",
        "flags": flags,
        "name": span.name,
        "kind": span.kind + 1,  # the API counts from INTERNAL = 0, OTLP from INTERNAL = 1
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(end_time),
        "attributes": key_values(span.attributes),
        "events": [
            {"timeUnixNano": str(time), "name": name, "attributes": key_values(attributes)}
            for name, time, attributes in span.events
        ],
        "links": [
            {"traceId": f"{trace_id:032x}", "spanId": f"{span_id:016x}", "attributes": key_values(attributes)}
            for trace_id, span_id, attributes in span.links
        ],
        "status": {"code": _STATUS_CODES[span.status_code]},
    }
    if span.parent_span_id:
        out["parentSpanId"] = f"{span.parent_span_id:016x}"
    if span.status_description:
        out["status"]["message"] = span.status_description
    return out


def resource_attributes(metadata: dict) -> dict:
    """The resource of the process that wrote a file, from its header's metadata."""
    resource = metadata.get("resource")
    attributes = dict(resource) if isinstance(resource, dict) else {"service.name": "unknown_service"}
    if "pid" in metadata:
        attributes.setdefault("process.pid", metadata["pid"])
    return attributes


def requests(contents: TraceFileContents, spans: Iterable[RecoveredSpan] | None = None, batch: int = 512) -> Iterator[dict]:
    """`ExportTraceServiceRequest` dicts of at most `batch` spans each."""
    spans = list(contents.spans if spans is None else spans)
    resource = {"attributes": key_values(resource_attributes(contents.metadata))}
    for first in range(0, len(spans), batch):
        scopes: dict[tuple[str, str], list[dict]] = {}
        for span in spans[first : first + batch]:
            scopes.setdefault((span.scope_name, span.scope_version), []).append(span_json(span, contents.last_time))
        yield {
            "resourceSpans": [
                {
                    "resource": resource,
                    "scopeSpans": [
                        {"scope": {"name": name, "version": version}, "spans": items}
                        for (name, version), items in scopes.items()
                    ],
                }
            ]
        }


def json_lines(contents: TraceFileContents, batch: int = 512) -> Iterator[str]:
    for request in requests(contents, batch=batch):
        yield json.dumps(request, separators=(",", ":"), allow_nan=False)
