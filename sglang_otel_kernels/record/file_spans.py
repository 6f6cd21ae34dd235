"""Spans written straight into the trace file, for a provider that would hand
them to the trace file's processor and nothing else (this package's own
provider, whose export, if any, is the sidecar's that follows the file).

A serving engine opens a batch span per forward pass: on SGLang's real server
that is one per decode step, on its hot path. Through the SDK a span costs its
sampler, id generator, attribute checks and processor chain, about 50 us here,
to produce the two records `FileSpan` writes itself (the processor's own
`write_start`, and an end holding what the end adds, as a kernel call's).
Where the provider has anything else to feed (an exporter, an application's
processors, another sampler, limits), spans go through the SDK as before
(`file_only`). The compiled core starts and ends a batch's span of this
kind itself (`FileSpan`'s fields and end are its `SpanRecord`'s there).
"""

from __future__ import annotations

import random
import sys
from time import time_ns
from typing import Any, Mapping, Sequence

from opentelemetry import trace
from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import Tracer
from opentelemetry.sdk.trace.id_generator import RandomIdGenerator
from opentelemetry.sdk.trace.sampling import ALWAYS_ON
from opentelemetry.trace import DEFAULT_TRACE_STATE, Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .._version import __version__
from ..notices import warn_failed_once
from ..schema import TRACER_NAME
from . import core
from . import processor as _processor
from .spans import exception_event

_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_SCOPE = (TRACER_NAME, __version__)
_UNSET, _OK = StatusCode.UNSET.value, StatusCode.OK.value


# The last start's (name table, attributes, links, name, start_of's answer).
_last_start: tuple = (None, None, None, None, None)
_verdict: tuple = (None, None, -1)  # (a tracer, its processors, the links its spans take straight; -1: none)


def file_only(tracer: Any, links: int = 0) -> bool:
    """Whether every span `tracer` starts (with up to `links` links) would be
    recorded whole and reach the trace file's processor alone: an SDK tracer
    whose provider has that processor only, samples everything, makes random
    ids, and has no attribute length limit and room for the links and a batch
    span's attributes (the SDK keeps these privately: anything else, the SDK path)."""
    global _verdict
    if not getattr(getattr(tracer, "_tracer_config", None), "is_enabled", True):
        return False
    # What a tracer can change after it is made is its provider's processors (a new tuple each
    # time one is added): the verdict is kept for the last tracer and processors asked about,
    # since a batch asks every step.
    processors = getattr(getattr(tracer, "span_processor", None), "_span_processors", None)
    verdict = _verdict
    if verdict[0] is not tracer or verdict[1] is not processors:
        verdict = _verdict = (tracer, processors, _links_taken(tracer, processors))
    return links <= verdict[2]


def _links_taken(tracer: Any, processors: Any) -> int:
    """How many links a span of `tracer` may have and be written straight; -1 where none is."""
    if type(tracer) is not Tracer or tracer.sampler is not ALWAYS_ON:
        return -1
    ids = tracer.id_generator
    if type(getattr(ids, "inner", ids)) is not RandomIdGenerator:  # (`inner`: forward_batch's keyed wrapper)
        return -1
    limits = getattr(tracer, "_span_limits", None)
    if not (isinstance(processors, tuple) and processors
            and all(type(p) is _processor.TraceFileProcessor for p in processors)
            and limits is not None and limits.max_attribute_length is None
            and (limits.max_span_attributes is None or limits.max_span_attributes >= 16)):
        return -1
    return sys.maxsize if limits.max_links is None else limits.max_links


def _checked(attributes: "Mapping[str, Any] | None") -> dict:
    """Attributes given by the caller, as the SDK keeps them (invalid values dropped, with its warning)."""
    return dict(BoundedAttributes(attributes=attributes, immutable=False)) if attributes else {}


def start_of(name: str, attributes: dict, links: tuple) -> "tuple | None":
    """What a start record in the current trace file holds beside its ids and
    times: (the scope's symbol, flags, the name's symbol, attributes and links
    as marshal data); None where no file is written."""
    global _last_start
    writer = _processor.current  # current_writer(), without a call: a batch span starts every step
    if writer is None or writer.failed:
        return None
    # A batch span starts with the same name, attributes and links step after step: what they
    # encode to is kept for the next (for this file's names: `symbols`, new in a new file).
    last = _last_start
    if last[0] is not writer.symbols or last[1] is not attributes or last[2] is not links or last[3] != name:
        scope = writer.symbols.get(_SCOPE) or writer.symbol(_SCOPE)
        last = _last_start = (writer.symbols, attributes, links, name,
                              (scope, *_processor.start_fields(writer, attributes, links, name)))
    return last[4]


def write_end(span: "FileSpan", end: int) -> None:
    """A FileSpan's end record (the compiled core writes the usual one itself)."""
    writer = _processor.current
    if writer is None or writer.failed:
        return
    try:
        _processor.write_added_end(writer, span._context[1], end, span._status, span._description or "",
                                   tuple(span._events), span._added)
    except Exception as exc:
        warn_failed_once("trace-file record", exc)


class _SpanRecord:
    """A FileSpan's fields and its end: the pure-Python core's `SpanRecord`."""

    __slots__ = ("_context", "_added", "_events", "_description", "_status", "_ended")

    def get_span_context(self) -> SpanContext:
        return self._context

    def is_recording(self) -> bool:
        return not self._ended

    def end(self, end_time: int | None = None) -> None:
        if not self._ended:
            self._ended = True
            write_end(self, end_time or time_ns())


class FileSpan(core.native.SpanRecord if core.native is not None else _SpanRecord, trace.Span):
    """A recording span whose start and end are trace-file records. Its
    attributes at the start are the caller's own, trusted and never changed
    (`forward_batch` builds them, and gives one batch's dict to the spans of
    many steps); those set later are checked as the SDK checks them, and its
    end record holds just those. The compiled core makes a batch's itself
    (requests.py)."""

    def __init__(self, name: str, parent: "SpanContext | None", attributes: dict,
                 links: Sequence[Link] = (), kind: SpanKind = SpanKind.INTERNAL,
                 trace_id: "int | None" = None, _bits=random.getrandbits, _new=tuple.__new__) -> None:
        """`parent`: None or an invalid context for a root span, whose trace id
        is `trace_id` where it is given (a batch's, the same on every rank)."""
        state = DEFAULT_TRACE_STATE
        # A SpanContext is a tuple (trace id, span id, remote, flags, state, valid): read and
        # made as one (its properties and its checks are Python calls).
        if parent is not None and parent[5]:
            trace_id, state = parent[0], parent[4]
        else:
            parent = None
            if trace_id is None:
                trace_id = _bits(128) or 1
        self._context = _new(SpanContext, (trace_id, _bits(64) or 1, False, _SAMPLED, state, True))
        self._added = {}
        self._events = []
        self._status, self._description = _UNSET, None
        self._ended = False
        try:
            links = tuple(links)
            start = start_of(name, attributes, links)
            if start is not None:
                _processor.write_start(_processor.current, self._context, parent, attributes, links, name, start[0],
                                       time_ns(), kind._value_, start[1:])
        except Exception as exc:
            warn_failed_once("trace-file record", exc)

    def set_attribute(self, key: str, value: Any) -> None:
        if self._ended:
            return
        if type(key) is str and key and type(value) in (int, str, bool, float):  # what the SDK's check lets through
            self._added[key] = value
        else:
            self._added.update(_checked({key: value}))

    def set_attributes(self, attributes: Mapping[str, Any]) -> None:
        if not self._ended:
            self._added.update(_checked(attributes))

    def add_event(self, name: str, attributes: "Mapping[str, Any] | None" = None,
                  timestamp: int | None = None) -> None:
        if not self._ended:
            self._events.append((name, timestamp or time_ns(), _checked(attributes)))

    def add_link(self, context: SpanContext, attributes: "Mapping[str, Any] | None" = None) -> None:
        """Links are written with the start record: one added later is not kept (as in the file through the SDK)."""

    def update_name(self, name: str) -> None:
        """The name is written with the start record (as in the file through the SDK)."""

    def set_status(self, status: "Status | StatusCode", description: str | None = None) -> None:
        if self._ended or self._status == _OK:  # OK is final, as in the SDK
            return
        if isinstance(status, Status):
            status, description = status.status_code, status.description
        if status is not StatusCode.UNSET:
            self._status = status.value
            self._description = description if status is StatusCode.ERROR else None

    def record_exception(self, exception: BaseException, attributes: "Mapping[str, Any] | None" = None,
                         timestamp: int | None = None, escaped: bool = False) -> None:
        self.add_event("exception", {**exception_event(exception), **(attributes or {})}, timestamp)
