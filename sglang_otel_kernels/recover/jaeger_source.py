"""A report's spans from Jaeger (`report --jaeger URL --service NAME`): the
spans of every node already sit there, so the cross-rank verdict of a fleet
needs no trace file on any disk.

Jaeger's HTTP query API (`/api/traces?service=...&start=...&end=...&limit=...`,
what its UI reads) gives whole traces: spans with their tags, references
(CHILD_OF the parent, FOLLOWS_FROM a link) and logs, and the processes that
sent them with their resource tags (`process.pid`, `host.name`,
`sglang.rank`, `sglang.job`, ...). Each process becomes one contents, as a
trace file's would. Jaeger does not say whether a process still runs; its
spans tell it, as an archive's do (otlp_json.exported_ending): calls in
flight that are all hung calls' early exports make a live process, hanging;
a call in flight of its own a dead one; none, an ended one (or one that
runs, healthy). Jaeger writes an array attribute as
JSON text: text that reads as a JSON array is taken as one (shapes, request
ids, a group's ranks). Fetches are bounded (traces, bytes, time); Jaeger's
answer is read as hostile input: what is not a trace or a span is left out
and counted.
"""

from __future__ import annotations

import datetime
import json
import re
import urllib.error
import urllib.parse
import urllib.request
from typing import Any

from ..record import identity
from ..schema import IN_FLIGHT, THREAD_ID, THREAD_NAME
from ..text import utf8
from .otlp_json import exported_ending, without_answered_snapshots
from ..record.reader import RecoveredSpan, TraceFileContents, TraceFileError

MAX_BYTES = 256 << 20
_DURATION = re.compile(r"^(\d+(?:\.\d+)?)\s*(s|m|h|d)$")
_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}
_KINDS = {"internal": 0, "server": 1, "client": 2, "producer": 3, "consumer": 4}
# Tags Jaeger makes of OpenTelemetry's fields, not attributes of the span.
_FIELDS = ("span.kind", "otel.status_code", "otel.status_description", "error", "otel.scope.name",
           "otel.scope.version", "internal.span.format")


def parse_duration(text: str) -> float:
    """Seconds of `90s`, `30m`, `1h`, `2d`; ValueError otherwise."""
    found = _DURATION.match(text.strip())
    if not found or float(found.group(1)) <= 0:
        raise ValueError(f"not a duration (such as 30m, 1h, 2d): {text!r}")
    return float(found.group(1)) * _UNITS[found.group(2)]


def parse_time(text: str, now: float) -> float:
    """Seconds since the epoch of `text`: a duration before `now` (`30m`,
    `2h`) or a time (`2026-12-03 06:30`, ISO 8601: this machine's local time
    unless it names its zone, as in `2026-12-03T06:30Z`, an alert's time)."""
    try:
        return now - parse_duration(text)
    except ValueError:
        pass
    try:
        return datetime.datetime.fromisoformat(text.strip()).timestamp()
    except (ValueError, OverflowError, OSError):
        raise ValueError(f"not a duration (such as 30m, 2h, 1d) or a time (such as 2026-12-03 06:30): {text!r}") \
            from None


def jaeger_base(url: str) -> tuple[str, "str | None"]:
    """(the base of Jaeger's query API, the service the URL names or None)
    of any address of Jaeger's UI: its root, a search page
    (`.../search?service=...`) or a trace page (`.../trace/<id>`), under a
    path prefix or not. ValueError for what is no http(s) URL."""
    parsed = urllib.parse.urlparse(url if "://" in url else "http://" + url)
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ValueError(f"not a Jaeger URL: {url!r}")
    path = re.split(r"/(?:search|trace/[^/]*|api)(?:/|$)", parsed.path, maxsplit=1)[0].rstrip("/")
    service = urllib.parse.parse_qs(parsed.query).get("service", [None])[0] if parsed.path.endswith("/search") else None
    return f"{parsed.scheme}://{parsed.netloc}{path}", service or None


def _value(tag: dict) -> Any:
    value = tag.get("value")
    if tag.get("type") == "string" and isinstance(value, str):
        if value.startswith("[") and value.endswith("]"):
            try:
                items = json.loads(value)
            except ValueError:
                return utf8(value)
            if isinstance(items, list) and all(type(item) in (str, int, float, bool) for item in items):
                return tuple(utf8(item) if isinstance(item, str) else item for item in items)
        return utf8(value)
    if tag.get("type") == "int64" and type(value) is int and -(1 << 63) <= value < 1 << 63:
        return value
    if tag.get("type") == "float64" and type(value) in (int, float):
        return float(value)
    if tag.get("type") == "bool" and type(value) is bool:
        return value
    raise ValueError("a tag Jaeger would not write")


def _tags(tags: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for tag in tags if isinstance(tags, list) else ():
        if isinstance(tag, dict) and isinstance(tag.get("key"), str):
            try:
                out[utf8(tag["key"])] = _value(tag)
            except ValueError:
                continue
    return out


def _hex(value: Any, digits: int) -> int:
    if not isinstance(value, str) or not 0 < len(value) <= digits:
        raise ValueError("not an id")
    number = int(value, 16)
    if not number:
        raise ValueError("a zero id")
    return number


def _micros(value: Any) -> int:
    if type(value) is not int or not 0 <= value < 1 << 53:
        raise ValueError("not a time")
    return value * 1000


def _span(span: dict) -> RecoveredSpan:
    tags = _tags(span.get("tags"))
    start = _micros(span.get("startTime"))
    duration = _micros(span.get("duration"))
    parent, links = 0, []
    for reference in span.get("references") or ():
        if not isinstance(reference, dict):
            continue
        target = (_hex(reference.get("traceID"), 32), _hex(reference.get("spanID"), 16))
        if reference.get("refType") == "CHILD_OF" and not parent:
            parent = target[1]
        else:
            links.append((*target, {}))
    events = []
    for log in span.get("logs") or ():
        if isinstance(log, dict):
            fields = _tags(log.get("fields"))
            events.append((str(fields.pop("event", "event")), _micros(log.get("timestamp")), fields))
    in_flight = tags.get(IN_FLIGHT) is True
    name = span.get("operationName")
    thread = tags.get(THREAD_ID)
    return RecoveredSpan(
        name=utf8(name) if isinstance(name, str) else "", trace_id=_hex(span.get("traceID"), 32),
        span_id=_hex(span.get("spanID"), 16), parent_span_id=parent, parent_is_remote=False,
        kind=_KINDS.get(str(tags.get("span.kind")), 0), start_time=start,
        end_time=None if in_flight else start + duration,
        status_code="ERROR" if tags.get("otel.status_code") == "ERROR" or tags.get("error") is True else
        "OK" if tags.get("otel.status_code") == "OK" else "UNSET",
        status_description=str(tags.get("otel.status_description") or ""),
        attributes={key: value for key, value in tags.items() if key not in _FIELDS},
        events=events, links=links, thread_id=thread if type(thread) is int else 0,
        thread_name=tags.get(THREAD_NAME) if isinstance(tags.get(THREAD_NAME), str) else None,
        scope_name=str(tags.get("otel.scope.name") or ""), scope_version=str(tags.get("otel.scope.version") or ""),
        trace_flags=1, in_flight=in_flight)


def _fetch(url: str, timeout: float) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as response:
            body = response.read(MAX_BYTES + 1)
    except urllib.error.HTTPError as exc:
        raise TraceFileError(f"Jaeger answered {exc.code} {exc.reason} to {url}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise TraceFileError(f"cannot reach Jaeger at {url} ({getattr(exc, 'reason', None) or exc})") from None
    if len(body) > MAX_BYTES:
        raise TraceFileError(f"Jaeger's answer is over {MAX_BYTES >> 20} MiB: ask for fewer traces (--limit, --since)")
    try:
        return json.loads(body)
    except (ValueError, RecursionError):
        raise TraceFileError(f"Jaeger's answer to {url} is not JSON") from None


def _services(base: str, timeout: float) -> list[str]:
    """The services Jaeger holds spans of (its /api/services), bounded; [] where it does not say."""
    try:
        answer = _fetch(f"{base}/api/services", timeout)
    except TraceFileError:
        return []
    names = answer.get("data") if isinstance(answer, dict) else None
    return sorted(str(name)[:200] for name in names[:100]) if isinstance(names, list) else []


def read_jaeger(url: str, service: str, start_s: float, end_s: float, limit: int = 1000,
                timeout: float = 30.0) -> list[TraceFileContents]:
    """One contents per process whose spans the newest `limit` traces of
    `service` between `start_s` and `end_s` (seconds since the epoch) hold;
    `url`: any address of Jaeger's UI (`jaeger_base`). No trace there is an
    error that lists the services Jaeger holds."""
    try:
        base, _ = jaeger_base(url)
    except ValueError as exc:
        raise TraceFileError(str(exc)) from None
    query = urllib.parse.urlencode({"service": service, "start": int(start_s * 1e6), "end": int(end_s * 1e6),
                                    "limit": limit})
    answer = _fetch(f"{base}/api/traces?{query}", timeout)
    traces = answer.get("data") if isinstance(answer, dict) else None
    if not isinstance(traces, list):
        raise TraceFileError("Jaeger's answer holds no traces (no `data` list)")
    if not traces:
        services = _services(base, timeout)
        window = f"from {_local(start_s)} to {_local(end_s)}"
        if service not in services:
            raise TraceFileError(f"Jaeger at {base} holds no spans of the service {service!r}; its services: "
                                 + (", ".join(services) if services else "none") + " (--service)")
        raise TraceFileError(f"Jaeger at {base} holds no trace of {service!r} {window} (--since, --until)")
    # key -> (resource, spans by id, the newest time exported: a call in flight ends at its process's last sign of life)
    processes: dict[tuple, tuple[dict, dict[int, RecoveredSpan], list[int]]] = {}
    skipped = 0
    for trace in traces:
        if not isinstance(trace, dict) or not isinstance(trace.get("spans"), list):
            skipped += 1
            continue
        senders = trace.get("processes") if isinstance(trace.get("processes"), dict) else {}
        for span in trace["spans"]:
            sender = senders.get(span.get("processID")) if isinstance(span, dict) else None
            if not isinstance(sender, dict):
                skipped += 1
                continue
            resource = _tags(sender.get("tags"))
            resource["service.name"] = str(sender.get("serviceName") or "")
            key = (resource.get("host.name"), resource.get("process.pid"), resource["service.name"])
            try:
                recovered = _span(span)
            except (ValueError, TypeError, KeyError):
                skipped += 1
                continue
            known, spans, newest = processes.setdefault(key, ({}, {}, [0]))
            known.update(resource)
            spans[recovered.span_id] = recovered
            newest[0] = max(newest[0], recovered.start_time + _micros(span.get("duration")))
    out = []
    for resource, by_id, newest in processes.values():
        spans = sorted(without_answered_snapshots(list(by_id.values())), key=lambda span: span.start_time)
        metadata = {"resource": resource, "pid": resource.get("process.pid"), "host": resource.get("host.name"),
                    "format": "Jaeger", "ranks": {key: resource[f"sglang.{key}"] for key in identity.RESOURCE_KEYS
                                                  if f"sglang.{key}" in resource}}
        out.append(TraceFileContents(
            path=f"jaeger:{service}/{resource.get('host.name')}/{resource.get('process.pid')}", metadata=metadata,
            spans=spans, records=len(spans), skipped=skipped,
            problems=[f"{skipped} malformed trace(s) or span(s) left out"] if skipped else [],
            last_time=newest[0], **exported_ending(spans)))
    return out


def _local(seconds: float) -> str:
    return datetime.datetime.fromtimestamp(seconds).astimezone().strftime("%Y-%m-%d %H:%M:%S %Z")
