"""Sends recovered spans to an OTLP back end after the fact, keeping their
trace and span ids, parents, links and timestamps, so the calls of a dead
process appear inside the original request traces; each call that matters
goes with its copies into the request traces of its batch. Spans still in
flight when the process died are marked (status ERROR,
`sglang.kernel.in_flight`) and end at the newest time their file holds.
What the export sidecar already delivered is left out (its list beside the
file). Uses the official OTLP exporters."""

from __future__ import annotations

import dataclasses
import sys
from typing import Callable, Iterable
from urllib.parse import urlparse

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from ..record import export
from ..record.export_errors import export_batch, quiet_exporter_logs
from ..schema import COPY_OF
from .device_faults import mark_in_flight
from ..record.ledger import read_delivered
from .otlp_json import exported_attributes, resource_attributes
from ..record.reader import RecoveredSpan, TraceFileContents
from .request_copies import with_copies

BATCH = 512


class FileResource(Resource):
    """A trace file's resource. The OTLP encoder groups spans by resource, so
    it hashes the resource of every span, and Resource hashes by writing its
    attributes as JSON; they never change, so the hash is taken once."""

    def __init__(self, attributes, schema_url: str | None = None) -> None:
        super().__init__(attributes, schema_url)
        self._hash = super().__hash__()

    def __hash__(self) -> int:
        return self._hash


_scopes: dict = {}
_SCOPES_LIMIT = 1024


def instrumentation_scope(name: str | None, version: str | None) -> InstrumentationScope:
    """One InstrumentationScope per (name, version), for the same reason: the
    encoder groups by scope too, and a scope hashes in Python."""
    key = (name or "unknown", version or None)
    scope = _scopes.get(key)
    if scope is None:
        scope = InstrumentationScope(*key)
        if len(_scopes) < _SCOPES_LIMIT:
            _scopes[key] = scope
    return scope


def readable(span: RecoveredSpan, resource: Resource, last_time: int) -> ReadableSpan:
    parent = None
    if span.parent_span_id:
        parent = SpanContext(span.trace_id, span.parent_span_id, is_remote=span.parent_is_remote,
                             trace_flags=TraceFlags(1 if span.parent_sampled else 0))
    return ReadableSpan(
        name=span.name,
        context=SpanContext(span.trace_id, span.span_id, is_remote=False, trace_flags=TraceFlags(span.trace_flags)),
        parent=parent,
        resource=resource,
        attributes=exported_attributes(span),
        events=[Event(name, attributes, timestamp) for name, timestamp, attributes in span.events],
        links=[Link(SpanContext(trace_id, span_id, is_remote=True), attributes)
               for trace_id, span_id, attributes in span.links],
        kind=SpanKind(span.kind),
        status=Status(StatusCode[span.status_code], span.status_description or None),
        start_time=span.start_time,
        end_time=span.end_time if span.end_time is not None else max(last_time, span.start_time),
        instrumentation_scope=instrumentation_scope(span.scope_name, span.scope_version),
    )


def make_exporter(endpoint: str | None, protocol: str | None, timeout_s: float) -> tuple[SpanExporter, str]:
    """The exporter and where it sends: `endpoint` (else the standard
    variables) with `protocol` (else OTEL_EXPORTER_OTLP_PROTOCOL, else grpc)."""
    protocol = protocol or export.otlp_protocol()
    target = endpoint or export.otlp_endpoint()
    if target is None:
        raise ValueError("no OTLP endpoint: pass --endpoint or set OTEL_EXPORTER_OTLP_ENDPOINT")
    if "://" not in target:
        target = "http://" + target
    parsed = urlparse(target)
    if not parsed.hostname or parsed.scheme not in ("http", "https"):
        raise ValueError(f"not an OTLP endpoint URL: {target!r}")
    quiet_exporter_logs()  # its callers say each failure's cause once, themselves
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as HttpExporter

        url = target if parsed.path not in ("", "/") else target.rstrip("/") + "/v1/traces"
        return HttpExporter(endpoint=url, timeout=timeout_s), url
    from ..record.otlp_encode import DirectGrpcExporter

    return DirectGrpcExporter(endpoint=target, insecure=parsed.scheme == "http", timeout=timeout_s), target


@dataclasses.dataclass
class Replayed:
    sent: int  # spans sent, copies included
    in_flight: int  # of which calls in flight when their process died (copies not counted)
    copies: int  # of which copies into request traces (record/batches.py)
    delivered_before: int  # spans the export sidecar had delivered: left out, or sent again with `everything`
    notes: list[str]  # lists of delivered spans that were not taken, and why


def replay(
    contents: Iterable[TraceFileContents],
    exporter: SpanExporter,
    progress: Callable[[int, int], None] | None = None,
    everything: bool = False,
    endpoint: str | None = None,
) -> Replayed:
    """Exports the spans of every file, each call that matters with its
    copies into its batch's request traces, except (unless `everything`)
    those the export sidecar already delivered to `endpoint`, the
    exporter's (record/ledger.py).
    Raises ConnectionError when the back end does not take a batch."""
    work = []
    in_flight = copies = delivered_before = 0
    notes: list[str] = []
    for content in contents:
        before: "set[int]" = set()
        if endpoint is not None and content.metadata.get("format") != "OTLP JSON":
            found, note = read_delivered(content.path, content.metadata, endpoint)
            if note:
                notes.append(note)
            before = found or before
        spans = content.spans
        if not content.live and not content.exited:
            mark_in_flight(spans, content.path, content.metadata)  # a CUDA core dump's fault, where one was written
        delivered_before += sum(span.span_id in before for span in spans) if before else 0
        spans, added = with_copies(spans, frozenset() if everything else before)
        copies += added
        resource = FileResource(resource_attributes(content.metadata))
        work.extend(readable(span, resource, content.last_alive) for span in spans)
        in_flight += sum(span.in_flight and COPY_OF not in span.attributes for span in spans)
    sent = 0
    for first in range(0, len(work), BATCH):
        batch = work[first : first + BATCH]
        why = export_batch(exporter, batch)
        if why is not None:
            raise ConnectionError(f"the back end did not take the spans ({sent} of {len(work)} sent): {why}")
        sent += len(batch)
        if progress is not None:
            progress(sent, len(work))
    return Replayed(sent, in_flight, copies, delivered_before, notes)


def terminal_progress(stream=sys.stderr) -> Callable[[int, int], None] | None:
    """A one-line progress bar when stderr is a terminal, else nothing."""
    if not stream.isatty():
        return None

    def show(done: int, total: int) -> None:
        filled = int(30 * done / max(total, 1))
        stream.write(f"\r[{'#' * filled}{'.' * (30 - filled)}] {done}/{total} spans")
        if done >= total:
            stream.write("\n")
        stream.flush()

    return show
