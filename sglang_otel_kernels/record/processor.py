"""A SpanProcessor that copies every span of its provider into the trace file:
a start record before the span's work runs, an end record when it ends.

Exporters only ever see ended spans, and a batch processor's queue dies with
the process; this processor writes synchronously, on the thread that starts or
ends the span, so the call that was running when the process died is on disk.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from operator import attrgetter
from time import time_ns

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import Link, Status, StatusCode

from ..notices import warn, warn_failed_once
from . import core, tracefile
from .tracefile import IDENT, NOTED

# The trace file being written now; read as it is by the span writers (a call less per span).
current: "tracefile.TraceFileWriter | None" = None


class _Unrecorded(threading.local):
    """Spans a thread starts and ends inside `with` are not recorded: kernel
    calls made again as spans of a provider's tracer, to reach its other
    processors (record/spans.py), which the decorator wrote into the file already."""

    active = False

    def __enter__(self) -> None:
        self.active = True

    def __exit__(self, *_) -> None:
        self.active = False


# Made by `unrecorded` where spans are made again, so that elsewhere (the
# usual case) the check costs one global load per span.
_unrecorded: "_Unrecorded | None" = None


def unrecorded() -> _Unrecorded:
    """The context in which a thread's spans are not recorded."""
    global _unrecorded
    if _unrecorded is None:
        _unrecorded = _Unrecorded()
    return _unrecorded


class KernelSpan(ReadableSpan):
    """An ended kernel call handed to span processors (record/spans.py). The
    trace-file processor skips it: the decorator wrote it into the file already."""


def set_writer(writer: "tracefile.TraceFileWriter | None") -> None:
    """The file every attached processor writes to from now on (None: none)."""
    global current
    previous, current = current, writer
    if core.native is not None:  # the compiled core writes its calls there too
        core.native.set_writer(writer, writer._core if writer is not None else None)
    if previous is not None and previous is not writer:
        previous.close()


def current_writer() -> "tracefile.TraceFileWriter | None":
    return current


def trace_file_path() -> str | None:
    """The trace file this process writes: None when it is off, could not be
    created, or before the first span."""
    writer = current
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


# What on_start and on_end read of a span: the SDK's private fields (plain
# attribute loads) where the running SDK has them, else the public
# properties (a Python call each; docs/performance.md has the difference).
_START = ("context", "parent", "attributes", "links", "name", "instrumentation_scope", "start_time", "kind")
_END = ("context", "status.status_code", "status.description", "events", "attributes", "end_time")


def _getters(private: bool) -> tuple[attrgetter, attrgetter]:
    def field(name: str) -> str:
        return ".".join("_" + part for part in name.split(".")) if private else name
    return attrgetter(*map(field, _START)), attrgetter(*map(field, _END))


def _same(private, public) -> bool:
    if isinstance(public, Mapping):
        return _plain(private) == dict(public)
    if isinstance(public, (tuple, list)):
        return _items(private) == tuple(public)
    return private == public


_private: "bool | None" = None


def private_fields_present() -> bool:
    """Whether this SDK's spans keep, under the private names read here,
    what their public properties give: checked once, on a real span."""
    global _private
    if _private is None:
        try:
            provider = TracerProvider(sampler=ALWAYS_ON, resource=Resource.get_empty(), shutdown_on_exit=False)
            tracer = provider.get_tracer("probe", "1")
            with tracer.start_as_current_span("parent") as parent:
                span = tracer.start_span("probe", attributes={"a": 1}, links=[Link(parent.get_span_context())])
                span.add_event("e")
                span.set_status(Status(StatusCode.ERROR, "why"))
                span.end()
            _private = all(_same(a, b) for private, public in zip(_getters(True), _getters(False))
                           for a, b in zip(private(span), public(span)))
        except Exception:  # noqa: BLE001  (any surprise means: not the fields we know)
            _private = False
    return _private


_LOW64 = (1 << 64) - 1
# A span's attributes at its start, kept (a copy) to end it with a compact
# record when nothing changed: copying and comparing costs less than encoding
# them again. Spans that never end must not grow this without bound.
_REMEMBERED = 64
_MAX_OPEN = 4096


def start_fields(writer: "tracefile.TraceFileWriter", attributes: dict, links: tuple, name: str) -> tuple:
    """What a start record holds beside its ids and times: (its flags for
    links and an inline name, the name's symbol in `writer`, the attributes
    and links as marshal data). The same for every span of a name that has
    the same attributes and links (a batch span, step after step)."""
    flags, data = 0, attributes
    if links:
        flags = tracefile.FLAG_LINKS
        data = (attributes, tuple(
            (link.context.trace_id, link.context.span_id, dict(link.attributes or {})) for link in links))
    symbol = writer.symbols.get(name) or writer.symbol(name)
    if not symbol:  # no room in the name table (a name per request): written inline
        flags |= tracefile.FLAG_INLINE_NAME
        data = (name, data)
    return flags, symbol, tracefile.encode(data)


def write_start(writer: "tracefile.TraceFileWriter", context, parent, attributes: dict, links: tuple, name: str,
                scope: int, start: int, kind: int, fields: "tuple | None" = None, _pack=tracefile.SPAN_START.pack,
                _encoding=tracefile.ENCODING_SPAN_START, _per_thread=tracefile.per_thread) -> None:
    """A span's start record: its ids, parent, name, start time, thread,
    scope (a symbol of `writer`), kind, attributes and links (`fields`:
    their `start_fields`, when the caller has them already); contexts are
    SpanContexts (tuples: unpacked at once, their properties cost 45 ns each)."""
    trace_id, span_id, _, trace_flags, _, _ = context
    state = _per_thread.state
    if state[NOTED] is not writer:
        writer.note_thread(state)
    added, symbol, data = fields or start_fields(writer, attributes, links, name)
    flags = trace_flags & 1 | added
    parent_id = 0
    if parent is not None:
        _, parent_id, remote, parent_flags, _, _ = parent
        if remote:
            flags |= tracefile.FLAG_REMOTE_PARENT
        if parent_flags & 1:
            flags |= tracefile.FLAG_PARENT_SAMPLED
    writer.write_record(_encoding, _pack(trace_id >> 64, trace_id & _LOW64, span_id, parent_id, start,
                                         state[IDENT], symbol, scope, kind, flags) + data)


def write_end(writer: "tracefile.TraceFileWriter", trace_id: int, span_id: int, end: int, code: int,
              description: "str | None", events: tuple, attributes: dict) -> None:
    """A span's end record: end time, status, `(name, time, attributes)` events, the final attributes."""
    writer.append((tracefile.END, trace_id, span_id, end, code, description or "", events, attributes))


def write_added_end(writer: "tracefile.TraceFileWriter", span_id: int, end: int, status: int, description: str,
                    events: tuple, added: "dict | None", _compact=tracefile.COMPACT_END.pack,
                    _encoding=tracefile.ENCODING_COMPACT_END, _attributed=tracefile.ENCODING_ATTRIBUTED_END,
                    _encode=tracefile.encode) -> None:
    """The end of a span whose start record holds its attributes, as what the
    end adds to them, in the smallest record that holds it: COMPACT_END
    (nothing added), ATTRIBUTED_END (attributes only) or CALL_END."""
    if events or description:
        writer.append((tracefile.CALL_END, span_id, end, status, description, events, added or {}))
    elif added:
        writer.write_record(_attributed, _compact(span_id, end, status) + _encode(added))
    else:
        writer.write_record(_encoding, _compact(span_id, end, status))


class TraceFileProcessor(SpanProcessor):
    """Attached once per TracerProvider; writes to the current trace file.

    A start record holds all that is known when the span starts (ids, parent,
    name, start time, thread, scope, attributes, links); the end record adds
    what the end brings (end time, status, events, the final attributes).
    This runs twice per application span (requests, batches, threads), so
    it reads the SDK span's fields directly where the SDK has them (every
    SDK span is a ReadableSpan, which sets them; enum values through
    `_value_`, as Enum hashes in Python), encodes the fixed ones with one
    struct and names as numbers.
    """

    def __init__(self, private: bool | None = None) -> None:
        """`private`: read the SDK's private span fields (None: where it has them)."""
        self._start, self._end = _getters(private_fields_present() if private is None else private)
        self._scopes: dict = {}
        self._unchanged: dict = {}  # span id: its attributes at its start
        # Spans of the provider that started before this processor was attached
        # (an application's request span, begun before its first kernel call)
        # have no start record: `adopt` writes the open one it is given, the end
        # writes the others' (`on_end`).
        self._attached_at = time_ns()
        self._adopted: set = set()

    def adopt(self, span) -> None:
        """Records the start of `span`, an open span of the provider that began
        before this processor was attached (the current one when it is)."""
        if isinstance(span, ReadableSpan) and span.end_time is None and span.start_time < self._attached_at:
            self.on_start(span)
            self._adopted.add(span.get_span_context().span_id)
            if span.parent is not None and not span.parent.is_remote:
                warn("the TracerProvider was installed before this package set tracing up, and spans around "
                     "the first kernel call began before: they are in the trace file only once they end, so a "
                     "crash before that would not name them. Import sglang_otel_kernels with "
                     "SGLANG_KERNEL_API_LOGLEVEL set (or call sok.configure(level=...)) before starting spans")

    def _scope(self, writer, scope) -> tuple:
        """(the scope, the writer's symbol table, the scope's symbol in it).
        Keyed by id (InstrumentationScope hashes in Python); the entry keeps
        the scope alive, so its id cannot be reused by another. Valid while
        the file's symbol table is (a fork starts a new one)."""
        names = ("", "") if scope is None else (scope.name or "", scope.version or "")
        entry = self._scopes[id(scope)] = (scope, writer.symbols, writer.symbol(names))
        return entry

    def on_start(self, span, parent_context=None) -> None:
        writer = current
        if writer is None or writer.failed or _unrecorded is not None and _unrecorded.active:
            return
        try:
            context, parent, attributes, links, name, scope, start, kind = self._start(span)
            attributes = _plain(attributes)
            unchanged = self._unchanged
            if len(attributes) <= _REMEMBERED and len(unchanged) < _MAX_OPEN:
                unchanged[context[1]] = attributes.copy()
            entry = self._scopes.get(id(scope))
            if entry is None or entry[1] is not writer.symbols:
                entry = self._scope(writer, scope)
            write_start(writer, context, parent, attributes, _items(links), name, entry[2], start, kind._value_)
        except Exception as exc:
            warn_failed_once("trace-file record", exc)

    def on_end(self, span, _compact=tracefile.COMPACT_END.pack, _encoding=tracefile.ENCODING_COMPACT_END) -> None:
        writer = current
        if writer is None or writer.failed or type(span) is KernelSpan or \
                _unrecorded is not None and _unrecorded.active:
            return  # a kernel span: the decorator wrote it into the file already
        try:
            context, code, description, events, attributes, end = self._end(span)
            trace_id, span_id, _, _, _, _ = context
            if span.start_time < self._attached_at:  # begun before the file was attached
                if span_id in self._adopted:
                    self._adopted.discard(span_id)
                else:
                    self.on_start(span)  # its start, late, so that the span is whole
            events = _items(events)  # not `not events`: BoundedList's len is Python code
            attributes = _plain(attributes)
            code = code._value_
            if self._unchanged.pop(span_id, None) == attributes and not events and not description:
                writer.write_record(_encoding, _compact(span_id, end, code))
                return
            events = tuple((event.name, event.timestamp, dict(event.attributes or {})) for event in events)
            write_end(writer, trace_id, span_id, end, code, description, events, attributes)
        except Exception as exc:
            warn_failed_once("trace-file record", exc)

    def shutdown(self) -> None:
        pass

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True
