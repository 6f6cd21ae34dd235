"""Recovered spans as OTLP JSON lines: one `ExportTraceServiceRequest` per
line, in the protobuf JSON mapping with OTLP's hex trace and span ids, as the
Collector's file exporter and the official FileSpanExporter write them; and
such files read back (`read_otlp_json`), so a report or a timeline can be made
from what a gateway archived.

A span still in flight when the process died ends, in this form, at the
newest time the file holds, with status ERROR and `sglang.kernel.in_flight`.
"""

from __future__ import annotations

import base64
import json
import math
import os
from typing import Any, Iterable, Iterator

from ..record import identity
from ..schema import DEATH_SPAN, HUNG, IN_FLIGHT, THREAD_ID, THREAD_NAME
from ..text import utf8
from ..record.reader import RecoveredSpan, TraceFileContents, TraceFileError, open_regular, said_ending
from .request_copies import with_copies

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


def exported_attributes(span: RecoveredSpan) -> dict:
    """A span's attributes as they leave for OTLP (a file, a back end), with
    OpenTelemetry's thread attributes, so that an archive read back names the threads."""
    attributes = dict(span.attributes)
    attributes.setdefault(THREAD_ID, span.thread_id)
    if span.thread_name:
        attributes.setdefault(THREAD_NAME, span.thread_name)
    return attributes


def span_json(span: RecoveredSpan, last_time: int) -> dict:
    end_time = span.end_time if span.end_time is not None else max(last_time, span.start_time)
    attributes = exported_attributes(span)
    flags = (span.trace_flags & 0xFF) | _HAS_IS_REMOTE | (_IS_REMOTE if span.parent_is_remote else 0)
    out = {
        "traceId": f"{span.trace_id:032x}",
        "spanId": f"{span.span_id:016x}",
        "flags": flags,
        "name": span.name,
        "kind": span.kind + 1,  # the API counts from INTERNAL = 0, OTLP from INTERNAL = 1
        "startTimeUnixNano": str(span.start_time),
        "endTimeUnixNano": str(end_time),
        "attributes": key_values(attributes),
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
    """The resource of the process that wrote a file, from its header's
    metadata, with its ranks as known at the end (`sglang.rank`, ...): they
    may have been learnt after the resource was made."""
    resource = metadata.get("resource")
    attributes = dict(resource) if isinstance(resource, dict) else {"service.name": "unknown_service"}
    if "pid" in metadata:
        attributes.setdefault("process.pid", metadata["pid"])
    # As the kernel spans carry it (record/setup.py): a back end's reader tells a process by its host and pid.
    if isinstance(metadata.get("host"), str) and metadata["host"]:
        attributes.setdefault("host.name", metadata["host"])
    ranks = metadata.get("ranks")
    if isinstance(ranks, dict):
        # Older files wrote the environment's ranks as text.
        plain = {key: int(value) if isinstance(value, str) and value.isdigit() else value
                 for key, value in ranks.items()}
        attributes.update(identity.resource_attributes(plain))
    return attributes


def requests(contents: TraceFileContents, spans: Iterable[RecoveredSpan] | None = None, batch: int = 512) -> Iterator[dict]:
    """`ExportTraceServiceRequest` dicts of at most `batch` spans each."""
    spans = list(contents.spans if spans is None else spans)
    resource = {"attributes": key_values(resource_attributes(contents.metadata))}
    for first in range(0, len(spans), batch):
        scopes: dict[tuple[str, str], list[dict]] = {}
        for span in spans[first : first + batch]:
            scopes.setdefault((span.scope_name, span.scope_version), []).append(span_json(span, contents.last_alive))
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
    """The file's spans as OTLP JSON lines, each call that matters followed
    by its copies into its batch's request traces (record/batches.py)."""
    spans, _ = with_copies(contents.spans)
    for request in requests(contents, spans, batch=batch):
        yield json.dumps(request, separators=(",", ":"), allow_nan=False)


# -- reading: what the Collector's file exporter archived, or our own export --

MAX_JSON_BYTES = 1 << 30  # an archive file the Collector rotates at 100 MB by our config
_MAX_DEPTH = 16
_INT64 = 1 << 63
_KINDS = {"SPAN_KIND_UNSPECIFIED": 0, "SPAN_KIND_INTERNAL": 1, "SPAN_KIND_SERVER": 2, "SPAN_KIND_CLIENT": 3,
          "SPAN_KIND_PRODUCER": 4, "SPAN_KIND_CONSUMER": 5}
_CODES = {0: "UNSET", 1: "OK", 2: "ERROR", "STATUS_CODE_UNSET": "UNSET", "STATUS_CODE_OK": "OK",
          "STATUS_CODE_ERROR": "ERROR"}


class Malformed(ValueError):
    """A span or value that is not OTLP JSON."""


def looks_like_json(path: str) -> bool:
    """Whether the regular file at `path` starts (after blanks) with `{`:
    a trace file starts with its magic bytes."""
    fd = open_regular(path)
    try:
        head = os.pread(fd, 4096, 0)
    except OSError:
        return False
    finally:
        os.close(fd)
    return head.lstrip()[:1] == b"{"


def _id(value, size: int, what: str) -> int:
    """An id as OTLP JSON writes it (hex), or as the plain protobuf JSON
    mapping would (base64); 0 for an absent one."""
    if value in (None, ""):
        return 0
    if isinstance(value, str):
        if len(value) == 2 * size:
            try:
                return int(value, 16)
            except ValueError:
                pass
        try:
            raw = base64.b64decode(value, validate=True)
        except ValueError:
            raw = b""
        if len(raw) == size:
            return int.from_bytes(raw, "big")
    raise Malformed(f"{what} is not a {size}-byte id: {str(value)[:40]!r}")


def _time(value, what: str) -> int:
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise Malformed(f"{what} is not a time: {str(value)[:40]!r}") from None
    if not 0 <= number < _INT64 or isinstance(value, bool):
        raise Malformed(f"{what} out of range: {number}")
    return number


def _any(value, depth: int = 0):
    """An AnyValue as a plain value."""
    if not isinstance(value, dict) or depth > _MAX_DEPTH:
        raise Malformed("not an AnyValue")
    if not value:
        return None
    (kind, item), *_ = value.items()
    if kind == "stringValue" and isinstance(item, str):
        return utf8(item)
    if kind == "boolValue" and isinstance(item, bool):
        return item
    if kind == "intValue" and not isinstance(item, bool):
        number = int(item) if isinstance(item, (int, str)) and str(item).lstrip("-").isdigit() else None
        if number is not None and -_INT64 <= number < _INT64:
            return number
    if kind == "doubleValue":
        if isinstance(item, (int, float)) and not isinstance(item, bool):
            return float(item)
        if item in ("NaN", "Infinity", "-Infinity"):
            return float(item.replace("Infinity", "inf"))
    if kind == "bytesValue" and isinstance(item, str):
        try:
            return base64.b64decode(item, validate=True)
        except ValueError:
            pass
    if kind == "arrayValue" and isinstance(item, dict):
        return tuple(_any(element, depth + 1) for element in _list(item.get("values")))
    if kind == "kvlistValue" and isinstance(item, dict):
        return _key_values(item.get("values"), depth + 1)
    raise Malformed(f"not an AnyValue: {kind}")


def _list(value) -> list:
    if value is None:
        return []
    if not isinstance(value, list):
        raise Malformed("a list expected")
    return value


def _key_values(items, depth: int = 0) -> dict:
    out = {}
    for item in _list(items):
        if not isinstance(item, dict) or not isinstance(item.get("key"), str):
            raise Malformed("an attribute without a key")
        out[utf8(item["key"])] = _any(item.get("value") or {}, depth)
    return out


def _span(span: dict, scope: tuple[str, str]) -> tuple[int, RecoveredSpan]:
    """(the end it was exported with, the span): a call in flight was exported ending at its
    process's last sign of life, which is no end of the call."""
    if not isinstance(span, dict) or not isinstance(span.get("name", ""), str):
        raise Malformed("a span is not an object with a name")
    attributes = _key_values(span.get("attributes"))
    status = span.get("status") or {}
    kind = span.get("kind", 1)
    kind = _KINDS.get(kind, kind) if isinstance(kind, str) else kind
    flags = span.get("flags", 1)
    if not isinstance(kind, int) or not 0 <= kind <= 5 or not isinstance(flags, int) or not isinstance(status, dict):
        raise Malformed("a span's kind, flags or status is malformed")
    in_flight = attributes.get(IN_FLIGHT) is True
    thread = attributes.get(THREAD_ID)
    thread_name = attributes.get(THREAD_NAME)
    exported_end = _time(span.get("endTimeUnixNano"), "endTimeUnixNano")
    return exported_end, RecoveredSpan(
        name=utf8(span.get("name", "")),
        trace_id=_id(span.get("traceId"), 16, "traceId") or _raise("a span without a traceId"),
        span_id=_id(span.get("spanId"), 8, "spanId") or _raise("a span without a spanId"),
        parent_span_id=_id(span.get("parentSpanId"), 8, "parentSpanId"),
        parent_is_remote=flags & (_HAS_IS_REMOTE | _IS_REMOTE) == _HAS_IS_REMOTE | _IS_REMOTE,
        kind=max(kind - 1, 0),
        start_time=_time(span.get("startTimeUnixNano"), "startTimeUnixNano"),
        # A call our export wrote as in flight ends at the file's newest time, which is no end.
        end_time=None if in_flight else exported_end,
        status_code=_CODES.get(status.get("code", 0), "UNSET"),
        status_description=utf8(status["message"]) if isinstance(status.get("message"), str) else "",
        attributes=attributes,
        events=[(utf8(str(event.get("name", ""))), _time(event.get("timeUnixNano"), "an event's time"),
                 _key_values(event.get("attributes"))) for event in _list(span.get("events"))
                if isinstance(event, dict) or _raise("an event is not an object")],
        links=[(_id(link.get("traceId"), 16, "a link's traceId"), _id(link.get("spanId"), 8, "a link's spanId"),
                _key_values(link.get("attributes"))) for link in _list(span.get("links"))
               if isinstance(link, dict) or _raise("a link is not an object")],
        thread_id=thread if isinstance(thread, int) else 0,
        thread_name=thread_name if isinstance(thread_name, str) else None,
        scope_name=scope[0], scope_version=scope[1], trace_flags=flags & 0xFF, in_flight=in_flight,
    )


def _raise(message: str):
    raise Malformed(message)


def _documents(data: bytes, problems: list[str]) -> Iterator[dict]:
    """Each ExportTraceServiceRequest in the file: one per line (the
    Collector's file exporter, our export), or the whole file as one."""
    lines = [line for line in data.splitlines() if line.strip()]
    parsed = []
    for number, line in enumerate(lines, 1):
        try:
            parsed.append(json.loads(line))
        except ValueError:
            parsed.append(None)
            problems.append(f"line {number}: not JSON, left out")
    if parsed and all(document is None for document in parsed) and len(lines) > 1:
        try:
            parsed, problems[:] = [json.loads(data)], []
        except ValueError:
            pass
    return (document for document in parsed if document is not None)


def without_answered_snapshots(spans: list[RecoveredSpan]) -> list[RecoveredSpan]:
    """A hung call's early export (a child of the call, see live/follow.py)
    is left out once the call's own span is there: it is the same call."""
    ids = {span.span_id for span in spans}
    return [span for span in spans if not (span.attributes.get(HUNG) is True and span.parent_span_id in ids)]


def exported_ending(spans: list[RecoveredSpan]) -> dict:
    """How a process whose spans were exported (an archive, Jaeger) stands,
    as its sidecar's exports tell it (no file, no pid to ask): calls in
    flight that are all hung calls' early exports (sent while the process
    lives) make it live, hanging; a call in flight of its own (sent when the
    process died) dead, with what the sidecar said of its death; none, ended
    (or running, healthy). `spans`: without answered snapshots."""
    in_flight = [span for span in spans if span.in_flight]
    if not in_flight:  # a death that left nothing in flight is said by a span of its own
        deaths = [span for span in spans if span.name == DEATH_SPAN]
        if deaths:
            return {"live": False, "exited": False, "fatal_signal": said_ending(deaths)}
    return {"live": bool(in_flight) and all(span.attributes.get(HUNG) is True for span in in_flight),
            "exited": not in_flight, "fatal_signal": said_ending(in_flight)}


def read_otlp_json(path: str) -> "list[TraceFileContents]":
    """The spans of an OTLP JSON file, one TraceFileContents per resource
    (a process), as the report and the Chrome export take them. Malformed
    spans are left out and counted; the file is read as hostile input."""
    fd = open_regular(path)
    try:
        size = os.fstat(fd).st_size
        if size > MAX_JSON_BYTES:
            raise TraceFileError(f"{path}: {size} bytes, more than the {MAX_JSON_BYTES} read as OTLP JSON")
        data = os.pread(fd, size, 0)
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)
    problems: list[str] = []
    processes: dict[str, tuple[dict, list[RecoveredSpan]]] = {}
    skipped = 0
    for document in _documents(data, problems):
        resource_spans = document.get("resourceSpans") if isinstance(document, dict) else None
        if not isinstance(resource_spans, list):
            problems.append("a line without resourceSpans, left out")
            continue
        for entry in resource_spans:
            try:
                resource = _key_values(((entry.get("resource") or {}).get("attributes")))
                scope_spans = _list(entry.get("scopeSpans"))
            except (Malformed, AttributeError):
                skipped += 1
                continue
            # One process: its resource gains attributes (its ranks) once they are known.
            key = (json.dumps([resource.get("host.name"), resource.get("process.pid")], default=repr)
                   if "process.pid" in resource else json.dumps(resource, sort_keys=True, default=repr))
            known, spans, newest = processes.setdefault(key, ({}, [], [0]))
            known.update(resource)
            for scope_entry in scope_spans:
                scope = scope_entry.get("scope") if isinstance(scope_entry, dict) else None
                scope = scope if isinstance(scope, dict) else {}
                names = (utf8(str(scope.get("name", ""))), utf8(str(scope.get("version", ""))))
                for span in _list(scope_entry.get("spans") if isinstance(scope_entry, dict) else None):
                    try:
                        end, recovered = _span(span, names)
                    except (Malformed, AttributeError, TypeError):
                        skipped += 1
                        continue
                    spans.append(recovered)
                    newest[0] = max(newest[0], recovered.start_time, end)
    if skipped:
        problems.append(f"{skipped} malformed span(s) left out")
    if not any(spans for _, spans, _ in processes.values()):
        raise TraceFileError(f"{path}: no OTLP JSON spans in it" + (f" ({problems[0]})" if problems else ""))
    out = []
    for resource, spans, newest in processes.values():
        if not spans:
            continue
        spans = without_answered_snapshots(spans)
        spans.sort(key=lambda span: span.start_time)
        metadata = {"resource": resource, "pid": resource.get("process.pid"), "host": resource.get("host.name"),
                    "format": "OTLP JSON", "ranks": {key: resource[f"sglang.{key}"] for key in identity.RESOURCE_KEYS
                                                      if f"sglang.{key}" in resource}}
        out.append(TraceFileContents(path=path, metadata=metadata, spans=spans, records=len(spans), skipped=skipped,
                                     problems=list(problems), last_time=newest[0], **exported_ending(spans)))
    return out
