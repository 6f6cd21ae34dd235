"""A SpanProcessor that copies every span of its provider into the trace file:
a start record before the span's work runs, an end record when it ends.

Exporters only ever see ended spans, and a batch processor's queue dies with
the process; this processor writes synchronously, on the thread that starts or
ends the span, so the call that was running when the process died is on disk.
"""

from __future__ import annotations

import sys
import threading

from opentelemetry.sdk.trace import SpanProcessor

from . import tracefile

_current: "tracefile.TraceFileWriter | None" = None
_warned = False


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
    global _warned
    if not _warned:
        _warned = True
        print(f"sglang_otel_kernels: trace-file record failed ({type(exc).__name__}: {exc})", file=sys.stderr)


def _links(links) -> tuple:
    return tuple((link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in links)


class TraceFileProcessor(SpanProcessor):
    """Attached once per TracerProvider; writes to the current trace file."""

    def __init__(self) -> None:
        self._threads: set = set()

    def _thread(self, writer) -> int:
        ident = threading.get_ident()
        if ident not in self._threads:
            self._threads.add(ident)
            writer.append((tracefile.THREAD, ident, threading.current_thread().name))
        return ident

    def _fields(self, span, writer) -> tuple:
        """What start and end records share: enough to show the span alone."""
        context = span.context
        parent = span.parent
        scope = span.instrumentation_scope
        return (
            context.trace_id,
            context.span_id,
            parent.span_id if parent is not None else 0,
            span.name,
            span.kind.value,
            span.start_time,
            self._thread(writer),
            scope.name if scope is not None else "",
            (scope.version or "") if scope is not None else "",
            dict(span.attributes),
            _links(span.links),
            int(context.trace_flags),
            bool(parent is not None and parent.is_remote),
        )

    def on_start(self, span, parent_context=None) -> None:
        writer = _current
        if writer is None:
            return
        try:
            writer.append((tracefile.START,) + self._fields(span, writer))
        except Exception as exc:
            _warn_once(exc)

    def on_end(self, span) -> None:
        writer = _current
        if writer is None:
            return
        try:
            status = span.status
            events = tuple((event.name, event.timestamp, dict(event.attributes or {})) for event in span.events)
            writer.append(
                (tracefile.END,)
                + self._fields(span, writer)
                + (span.end_time, status.status_code.value, status.description or "", events)
            )
        except Exception as exc:
            _warn_once(exc)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
