"""A SpanProcessor that copies every span of its provider into the trace file:
a start record before the span's work runs, an end record when it ends.

Exporters only ever see ended spans, and a batch processor's queue dies with
the process; this processor writes synchronously, on the thread that starts or
ends the span, so the call that was running when the process died is on disk.
"""

from __future__ import annotations

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from ..notices import warn_failed_once
from . import tracefile
from .tracefile import IDENT, NOTED

_current: "tracefile.TraceFileWriter | None" = None


class KernelSpan(ReadableSpan):
    """An ended kernel call handed to span processors (record/spans.py). The
    trace-file processor skips it: the decorator wrote it into the file already."""


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


def _items(value) -> tuple:
    """A span's links or events as a tuple. The SDK keeps them in a BoundedList
    whose iteration copies under a lock; its deque is read directly."""
    inner = getattr(value, "_dq", value)
    return tuple(inner) if inner else ()


def _plain(attributes) -> dict:
    """Attributes as a plain dict, for marshal. The SDK keeps them in a dict
    inside BoundedAttributes: that one is read directly, which saves a copy
    through the read-only mapping."""
    return attributes._dict if type(attributes) is BoundedAttributes else dict(attributes or {})


_LOW64 = (1 << 64) - 1
# A span's attributes at its start, kept (a copy) to end it with a compact
# record when nothing changed: copying and comparing costs less than encoding
# them again. Spans that never end must not grow this without bound.
_REMEMBERED = 64
_MAX_OPEN = 4096


class TraceFileProcessor(SpanProcessor):
    """Attached once per TracerProvider; writes to the current trace file.

    A start record holds all that is known when the span starts (ids, parent,
    name, start time, thread, scope, attributes, links); the end record adds
    what the end brings (end time, status, events, the final attributes).
    This runs twice per application span (requests, batches, threads), so
    it reads the SDK span's fields directly (every SDK span is a ReadableSpan,
    which sets them; enum values through `_value_`, as Enum hashes in
    Python), encodes the fixed ones with one struct and names as numbers.
    """

    def __init__(self) -> None:
        self._scopes: dict = {}
        self._unchanged: dict = {}  # span id: its attributes at its start

    def _scope(self, writer, scope) -> tuple:
        """(the scope, the writer's symbol table, the scope's symbol in it).
        Keyed by id (InstrumentationScope hashes in Python); the entry keeps
        the scope alive, so its id cannot be reused by another. Valid while
        the file's symbol table is (a fork starts a new one)."""
        names = ("", "") if scope is None else (scope.name or "", scope.version or "")
        entry = self._scopes[id(scope)] = (scope, writer.symbols, writer.symbol(names))
        return entry

    def on_start(self, span, parent_context=None, _pack=tracefile.SPAN_START.pack, _encode=tracefile.encode,
                 _encoding=tracefile.ENCODING_SPAN_START, _per_thread=tracefile.per_thread) -> None:
        writer = _current
        if writer is None or writer.failed:
            return
        try:
            # SpanContext is a tuple: unpacked at once, its properties cost 45 ns each.
            trace_id, span_id, _, trace_flags, _, _ = span._context
            parent = span._parent
            state = _per_thread.state
            if state[NOTED] is not writer:
                writer.note_thread(state)
            thread = state[IDENT]
            attributes = _plain(span._attributes)
            unchanged = self._unchanged
            if len(attributes) <= _REMEMBERED and len(unchanged) < _MAX_OPEN:
                unchanged[span_id] = attributes.copy()
            flags = trace_flags & 1
            parent_id = 0
            if parent is not None:
                _, parent_id, remote, parent_flags, _, _ = parent
                if remote:
                    flags |= tracefile.FLAG_REMOTE_PARENT
                if parent_flags & 1:
                    flags |= tracefile.FLAG_PARENT_SAMPLED
            links = _items(span._links)
            data = attributes
            if links:
                flags |= tracefile.FLAG_LINKS
                data = (attributes, tuple(
                    (link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in links))
            name = span._name
            symbol = writer.symbols.get(name) or writer.symbol(name)
            if not symbol:  # no room in the name table (a name per request): written inline
                flags |= tracefile.FLAG_INLINE_NAME
                data = (name, data)
            scope = self._scopes.get(id(span._instrumentation_scope))
            if scope is None or scope[1] is not writer.symbols:
                scope = self._scope(writer, span._instrumentation_scope)
            writer.write_record(_encoding, _pack(
                trace_id >> 64, trace_id & _LOW64, span_id, parent_id, span._start_time, thread, symbol, scope[2],
                span._kind._value_, flags) + _encode(data))
        except Exception as exc:
            warn_failed_once("trace-file record", exc)

    def on_end(self, span, _compact=tracefile.COMPACT_END.pack, _encoding=tracefile.ENCODING_COMPACT_END) -> None:
        writer = _current
        if writer is None or writer.failed or type(span) is KernelSpan:
            return  # a kernel span: the decorator wrote it into the file already
        try:
            trace_id, span_id, _, _, _, _ = span._context
            status = span._status
            events = _items(span._events)  # not `not span._events`: BoundedList's len is Python code
            attributes = _plain(span._attributes)
            code = status._status_code._value_
            if self._unchanged.pop(span_id, None) == attributes and not events and not status._description:
                writer.write_record(_encoding, _compact(span_id, span._end_time, code))
                return
            events = tuple((event.name, event.timestamp, dict(event.attributes or {})) for event in events)
            writer.append((tracefile.END, trace_id, span_id, span._end_time, code, status._description or "",
                           events, attributes))
        except Exception as exc:
            warn_failed_once("trace-file record", exc)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
