"""A SpanProcessor that copies every span of its provider into the trace file:
a start record before the span's work runs, an end record when it ends.

Exporters only ever see ended spans, and a batch processor's queue dies with
the process; this processor writes synchronously, on the thread that starts or
ends the span, so the call that was running when the process died is on disk.
"""

from __future__ import annotations

from threading import get_ident

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.trace import SpanKind, StatusCode

from ..notices import warn_once
from . import tracefile

_current: "tracefile.TraceFileWriter | None" = None


def set_writer(writer: "tracefile.TraceFileWriter | None") -> None:
    """The file every attached processor writes to from now on (None: none)."""
    global _current
    previous, _current = _current, writer
    if previous is not None and previous is not writer:
        previous.close()


def current_writer() -> "tracefile.TraceFileWriter | None":
    return _current


def trace_file_path() -> str | None:
    """The trace file this process writes: None when it is off, could not be
    created, or before the first span."""
    writer = _current
    return writer.path if writer is not None and not writer.failed else None


def _warn_once(exc: BaseException) -> None:
    warn_once("trace-file record", f"trace-file record failed ({type(exc).__name__}: {exc})")


def _bounded(span, private: str, public: str):
    """The span's links or events. The SDK keeps them in a deque inside a
    BoundedList whose iteration copies under a lock; reading the deque skips
    that copy on the hot path, the public property is the fallback."""
    inner = getattr(getattr(span, private, None), "_dq", None)
    return inner if inner is not None else getattr(span, public)


def _links(span) -> tuple:
    links = _bounded(span, "_links", "links")
    if not links:
        return ()
    return tuple((link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in links)


def _attributes(span) -> dict:
    """The span's attributes as a plain dict, for marshal. The SDK keeps them
    in a dict inside BoundedAttributes: reading that one directly saves a
    Python-level copy through the read-only mapping (2 us a span)."""
    inner = getattr(getattr(span, "_attributes", None), "_dict", None)
    if type(inner) is dict:
        return inner
    return dict(span.attributes or {})


_KINDS = {kind: kind.value for kind in SpanKind}


_STATUS = {code: code.value for code in StatusCode}
_SMALL = 8
_MAX_OPEN = 4096  # spans that never end must not grow this without bound


class TraceFileProcessor(SpanProcessor):
    """Attached once per TracerProvider; writes to the current trace file.

    A start record holds all that is known when the span starts (ids, parent,
    name, start time, thread, scope, attributes, links); the end record adds
    what the end brings (end time, status, events, the final attributes). Both
    are built inline: this runs twice per kernel call.
    """

    def __init__(self) -> None:
        self._scopes: dict = {}
        # Attributes of small spans at their start, to end them with a compact
        # record when nothing changed (a level-1 kernel span, most request spans).
        self._unchanged: dict = {}

    def _scope(self, scope) -> tuple:
        # Keyed by id (InstrumentationScope hashes in Python); the entry keeps
        # the scope alive, so its id cannot be reused by another.
        entry = self._scopes.get(id(scope))
        if entry is None:
            names = ("", "") if scope is None else (scope.name or "", scope.version or "")
            entry = self._scopes[id(scope)] = (scope, names)
        return entry[1]

    def on_start(self, span, parent_context=None) -> None:
        writer = _current
        if writer is None:
            return
        try:
            context = span.context
            parent = span.parent
            thread = get_ident()
            writer.note_thread(thread)
            attributes = _attributes(span)
            if len(attributes) <= _SMALL and len(self._unchanged) < _MAX_OPEN:
                self._unchanged[context.span_id] = attributes.copy()
            writer.append(
                (
                    tracefile.START,
                    context.trace_id,
                    context.span_id,
                    parent.span_id if parent is not None else 0,
                    span.name,
                    _KINDS[span.kind],
                    span.start_time,
                    thread,
                    self._scope(span.instrumentation_scope),
                    attributes,
                    _links(span),
                    1 if context.trace_flags & 1 else 0,
                    parent is not None and parent.is_remote,
                )
            )
        except Exception as exc:
            _warn_once(exc)

    def on_end(self, span) -> None:
        writer = _current
        if writer is None:
            return
        try:
            context = span.context
            status = span.status
            events = _bounded(span, "_events", "events")
            attributes = _attributes(span)
            if self._unchanged.pop(context.span_id, None) == attributes and not events and not status.description:
                writer.append_end(context.span_id, span.end_time, _STATUS[status.status_code])
                return
            events = tuple((event.name, event.timestamp, dict(event.attributes or {})) for event in events)
            writer.append(
                (
                    tracefile.END,
                    context.trace_id,
                    context.span_id,
                    span.end_time,
                    _STATUS[status.status_code],
                    status.description or "",
                    events,
                    attributes,
                )
            )
        except Exception as exc:
            _warn_once(exc)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
