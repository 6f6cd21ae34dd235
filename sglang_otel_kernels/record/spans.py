"""Kernel calls as spans, with no SDK `Span` on the kernel thread.

The decorator writes each call straight into the trace file: a start record
before the kernel runs (ids this module makes, the parent, name, time,
thread, input attributes) and an end record after it. The parent is the
enclosing kernel call on this thread, else the current OpenTelemetry span
(the request or batch), so kernel spans nest inside the request traces.

When the provider kernel spans go to has span processors besides the trace
file's (an application's exporters, an in-memory exporter, in-process OTLP
export), the ended call is also handed to them, once, as a finished
`ReadableSpan` built without re-validating its attributes: they see `on_end`
only, never `on_start`. With sidecar export (the default when this package
sets tracing up) there is no such processor and the call costs only its two
records.
"""

from __future__ import annotations

import random
import traceback
from time import time_ns

from opentelemetry import context as _context
from opentelemetry import trace
from opentelemetry.sdk.trace import Event
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .._version import __version__
from ..descriptions import safe_str
from ..notices import warn_failed_once
from ..schema import ATTRIBUTES_DROPPED, GRAPH_CALLS, GRAPH_ID, HAS_INF, HAS_NAN, LEVEL, NAME, SEQ, TRACER_NAME
from ..text import utf8
from . import batches
from . import processor as _processor
from . import tracefile
from .attributes import fit
from .tracefile import CALL, CALLS, IDENT, NOTED
from .setup import carry_process, resolve_provider, resource_of, sidecar_takes_kernel_spans, track

_LOW64 = (1 << 64) - 1
_STATUS_UNSET, _STATUS_ERROR = 0, 2
_SAMPLED = TraceFlags(TraceFlags.SAMPLED)
_NOT_SAMPLED = TraceFlags(TraceFlags.DEFAULT)
# How many calls each CUDA graph captured here (graph id -> count; filled by
# capture/graphs.py): what a replay's span exported from this process says.
captured_calls: dict = {}


def _attribute_limit() -> int | None:
    """The per-span attribute limit the SDK applies to its own spans
    (OTEL_SPAN_ATTRIBUTE_COUNT_LIMIT / OTEL_ATTRIBUTE_COUNT_LIMIT), or None."""
    try:
        from opentelemetry.sdk.trace import SpanLimits
    except ImportError:
        return None
    limit = getattr(SpanLimits(), "max_span_attributes", None)
    return limit if isinstance(limit, int) and limit >= 0 else None


def describe_exception(exc: BaseException) -> str:
    message = safe_str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def exception_event(exc: BaseException) -> dict:
    """The attributes of an `exception` event, as the SDK's record_exception
    writes them but with every text valid UTF-8: one message holding a file
    name decoded with surrogateescape would make OTLP fail the whole batch."""
    try:
        stacktrace = utf8("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except Exception:
        stacktrace = ""
    return {"exception.type": type(exc).__name__, "exception.message": safe_str(exc),
            "exception.stacktrace": stacktrace, "exception.escaped": "True"}


def record_failure(span, exc: BaseException) -> None:
    """Status ERROR and the `exception` event on an SDK span (a batch span)."""
    span.set_status(Status(StatusCode.ERROR, describe_exception(exc)))
    span.add_event("exception", exception_event(exc))


# A call in progress is a tuple (the cheapest object to make, twice per call;
# the compiled core's calls are its InFlight, read the same way: by index or
# unpacked): (trace id, span id, flags, start time, the call it runs inside
# on this thread, the trace-file writer or None, name, parent span id, its
# attributes when it will be handed to processors, else None, its thread's
# `tracefile.per_thread.state`, where the running call is kept, its call number).
TRACE_ID, SPAN_ID, FLAGS, START, OUTER, WRITER, NAME_, PARENT_ID, ATTRIBUTES, THREAD_STATE, CALL_SEQ = range(11)


def add_attributes(call: tuple, added: dict) -> None:
    """Attributes of a recorded call, written into the trace file for its
    span at once, running or ended (what is learnt of it later: its NaN flags)."""
    writer = call[WRITER]
    if writer is not None:
        writer.append((tracefile.ATTRIBUTES, call[SPAN_ID], added))
    if call[ATTRIBUTES] is not None:
        call[ATTRIBUTES].update(added)


def call_context(call: tuple) -> SpanContext:
    """The SpanContext of a call in progress."""
    return SpanContext(call[TRACE_ID], call[SPAN_ID], False,
                       _SAMPLED if call[FLAGS] & tracefile.FLAG_SAMPLED else _NOT_SAMPLED)


def parent_context(call: tuple) -> "SpanContext | None":
    """The SpanContext of the span a call runs inside, or None."""
    if not call[PARENT_ID]:
        return None
    flags = call[FLAGS]
    return SpanContext(call[TRACE_ID], call[PARENT_ID], bool(flags & tracefile.FLAG_REMOTE_PARENT),
                       _SAMPLED if flags & tracefile.FLAG_PARENT_SAMPLED else _NOT_SAMPLED)


def awaited(call: tuple) -> object:
    """Makes a coroutine's call, recorded over its whole await, the current
    span of its task's context instead of its thread's current call: other
    tasks run on the thread while it awaits, and must not nest inside it;
    the calls it makes itself do. Returns the token that ends this
    (`opentelemetry.context.detach`)."""
    call[THREAD_STATE][CALL] = call[OUTER]
    return _context.attach(trace.set_span_in_context(trace.NonRecordingSpan(call_context(call))))


def unwind(seq: int, exc: BaseException, recorder: "KernelSpans | None") -> None:
    """Ends the calls of this thread numbered `seq` or later that are still
    its running calls once `exc` leaves the wrapper of call `seq`. Only an
    exception a signal handler raised (KeyboardInterrupt) between two steps
    of recording, outside the handlers that end a call, leaves one: without
    this, every later call of the thread would nest inside it."""
    state = tracefile.per_thread.state
    call = state[CALL]
    while call is not None and call[CALL_SEQ] >= seq:
        state[CALL] = call[OUTER]  # also when the end below cannot be recorded
        if recorder is not None:
            try:
                recorder.fail(call, exc, "raised while the call was being recorded")
            except Exception as inner:
                warn_failed_once(f"recording the end of {call[NAME_]}", inner)
        call = state[CALL]


def parent_of(context) -> tuple:
    """(context, trace id, parent span id, flags) for a kernel call whose
    parent is the current span of `context`; trace id and parent 0 when it
    has none (the call starts a trace of its own)."""
    span = trace.get_current_span(context) if context is not None else trace.INVALID_SPAN
    return parent_entry(context, span.get_span_context())


def parent_entry(context, span_context) -> tuple:
    """`parent_of(context)` where `context`'s current span has `span_context`."""
    # SpanContext is a tuple (trace id, span id, is remote, flags, state, is
    # valid): unpacked at once, its properties cost 45 ns each.
    trace_id, parent_id, remote, trace_flags, _, valid = span_context
    if not valid:
        return context, 0, 0, 1
    # Sampled, and so is the parent (FLAG_PARENT_SAMPLED); FLAG_REMOTE_PARENT.
    return context, trace_id, parent_id, (trace_flags & 1) * 9 | (2 if remote else 0)


class _ThroughTracer:
    """Stands for the span processors of a provider that is not the SDK's,
    which takes no finished span: each ended kernel call is made again as a
    span of its tracer (with the same parent, times, attributes, events and
    status, and an id of its own)."""

    def __init__(self, tracer) -> None:
        self._tracer = tracer
        self._span_processors = (self,)
        self._unrecorded = _processor.unrecorded()

    def on_end(self, span) -> None:
        parent = trace.set_span_in_context(trace.NonRecordingSpan(span.parent)) if span.parent else None
        with self._unrecorded:
            made = self._tracer.start_span(span.name, context=parent, kind=span.kind, attributes=span.attributes,
                                           links=span.links, start_time=span.start_time)
            for event in span.events:
                made.add_event(event.name, event.attributes, event.timestamp)
            made.set_status(span.status)
            made.end(end_time=span.end_time)


class KernelSpans:
    """Starts and ends kernel spans; finds the provider (and sets tracing up)
    on the first call, so that importing at level >= 1 sets nothing up until
    a kernel runs."""

    def __init__(self, tracer_provider=None, sdk: bool = True, blackbox: bool = False) -> None:
        self._configured = tracer_provider
        self.sdk = sdk  # False: OTEL_SDK_DISABLED, no provider is touched
        self.provider = None
        self.tracer = None
        self.deliver = sdk and not blackbox  # hand ended calls to the provider's other processors
        self.flags = tracefile.FLAG_BLACKBOX if blackbox else 0
        self.limit = _attribute_limit()
        self._processors = None  # the provider's multi span processor
        self._seen: tuple = ()  # its processors when last looked at
        self._targets = None  # it, when it holds one besides the trace file's
        self._scope = InstrumentationScope(TRACER_NAME, __version__)
        # The OpenTelemetry context of the last call and what it gives a call
        # (see parent_of): contexts are immutable, and consecutive kernel
        # calls mostly run in the same one (a batch's). One tuple, replaced
        # whole, so threads may share it.
        self._parent = parent_of(None)

    def prime(self, parent: tuple) -> None:
        """`parent_entry`'s answer for a context, told before a call looks for it."""
        self._parent = parent

    def setup(self):
        if not self.sdk:
            self.provider = False  # set up: the trace file alone
            return None
        track(self)
        provider = resolve_provider(self._configured)
        self.tracer = provider.get_tracer(TRACER_NAME, __version__)
        carry_process(self.tracer, provider)
        # The SDK keeps its processors privately (tests/test_sdk_fields.py
        # checks where): where they are not, or the provider is not the
        # SDK's, each ended call is made again through its tracer.
        deliver = self.deliver and not sidecar_takes_kernel_spans(provider)
        processors = getattr(provider, "_active_span_processor", None)
        if not isinstance(getattr(processors, "_span_processors", None), tuple):
            processors = _ThroughTracer(self.tracer)
        self._processors = processors if deliver else None
        self.provider = provider
        return self.tracer

    def _refresh_targets(self, processors) -> None:
        """Looks again at the provider's processors (they changed): ended
        calls go to them when one is not the trace file's."""
        present = self._seen = processors._span_processors
        self._targets = processors if any(not isinstance(p, _processor.TraceFileProcessor) for p in present) else None

    def start(self, name: str, level: int, seq: int, extra: dict | None, kind_flags: int = 0,
              _pack=tracefile.KERNEL_SPAN.pack, _encode=tracefile.encode, _bits=random.getrandbits,
              _kind=tracefile.ENCODING_KERNEL_SPAN, _context_now=_context.get_current, _now=time_ns,
              _per_thread=tracefile.per_thread) -> tuple:
        """Writes the start record of a call (its attributes beyond name,
        level and seq in `extra`; `kind_flags`: FLAG_COLLECTIVE for a
        collective) and makes it this thread's current call. It runs once
        per kernel call: the defaults bind what it needs as locals."""
        if self.provider is None:
            self.setup()
        state = _per_thread.state
        state[CALLS] += 1
        outer = state[CALL]
        if outer is not None:
            trace_id, parent_id = outer[TRACE_ID], outer[SPAN_ID]
            flags = (outer[FLAGS] & 1) * 9  # sampled, and so is the parent (FLAG_PARENT_SAMPLED)
        else:
            context = _context_now()
            parent = self._parent
            if parent[0] is not context:
                parent = self._parent = parent_of(context)
            _, trace_id, parent_id, flags = parent
            if not parent_id:
                trace_id = _bits(128) or 1
        flags |= self.flags | kind_flags
        span_id = _bits(64) or 1
        writer = _processor.current
        if writer is not None and not writer.failed:
            if state[NOTED] is not writer:
                writer.note_thread(state)  # the thread's first record: on the first call, the file's creation
            symbol = writer.symbols.get(name) or writer.symbol(name)
            if not symbol:  # no room in the name table: written inline
                flags |= tracefile.FLAG_INLINE_NAME
                extra = (name, extra or {})
            start = _now()  # after the recorder's set-up, which is not the call's time
            record = _pack(trace_id >> 64, trace_id & _LOW64, span_id, parent_id, start, state[IDENT],
                           symbol, 0, flags, seq, level)
            writer.write_record(_kind, record + _encode(extra) if extra else record)
        else:
            writer = None
            start = _now()
        attributes = None
        processors = self._processors
        if processors is not None:
            if processors._span_processors is not self._seen:
                self._refresh_targets(processors)
            if self._targets is not None:
                if flags & tracefile.FLAG_GRAPH_REPLAY:
                    attributes = {NAME: name, LEVEL: level, **tracefile.replay_fields(seq)}
                    calls = captured_calls.get(attributes[GRAPH_ID])
                    if calls is not None:
                        attributes[GRAPH_CALLS] = calls
                else:
                    attributes = {NAME: name, LEVEL: level, SEQ: seq}
                if extra:
                    attributes.update(tracefile.unpack_collective(extra[1] if flags & tracefile.FLAG_INLINE_NAME
                                                                  else extra))
        call = state[CALL] = (trace_id, span_id, flags, start, outer, writer, name, parent_id, attributes, state, seq)
        return call

    def add(self, call: tuple, added: dict) -> None:
        """Attributes of a call that runs, written at once: the statistics of
        its inputs, which need a synchronisation, come after its start record
        so that a hang in earlier GPU work still leaves the call in flight."""
        add_attributes(call, added)

    def end(self, call: tuple, added: dict | None = None, events: tuple = (),
            status: int = _STATUS_UNSET, description: str = "", _now=time_ns,
            _write_end=_processor.write_added_end) -> None:
        """Writes the end record and hands the ended call to the processors."""
        _, span_id, flags, _, outer, writer, _, _, attributes, state, _ = call
        state[CALL] = outer
        end = _now()
        if writer is not None:  # one that failed since the start writes nothing
            _write_end(writer, span_id, end, status, description, events, added)
        if attributes is not None and flags & tracefile.FLAG_SAMPLED:
            self._hand_over(call, end, added, events, status, description)

    def _fitted(self, attributes: dict) -> dict:
        """`attributes` within the SDK's attribute limit, saying how many were left out."""
        if self.limit is not None and len(attributes) > self.limit:
            attributes, dropped = fit(attributes, self.limit - 1)
            attributes[ATTRIBUTES_DROPPED] = dropped
        return attributes

    def _hand_over(self, call: tuple, end: int, added, events, status: int, description: str) -> None:
        attributes = call[ATTRIBUTES]
        if added:
            attributes.update(added)
        span = _processor.KernelSpan(
            call[NAME_], context=call_context(call), parent=parent_context(call), resource=resource_of(self.provider),
            attributes=self._fitted(attributes), events=tuple(Event(name, attrs, time) for name, time, attrs in events),
            kind=SpanKind.INTERNAL,
            status=Status(StatusCode.ERROR, description) if status == _STATUS_ERROR else Status(StatusCode.UNSET),
            start_time=call[START], end_time=end, instrumentation_scope=self._scope)
        self._targets.on_end(span)
        if status == _STATUS_ERROR or attributes.get(HAS_NAN) or attributes.get(HAS_INF):
            self._hand_over_copies(span, attributes, status == _STATUS_ERROR)

    def _hand_over_copies(self, span, attributes: dict, error: bool) -> None:
        """A call that matters, in a batch of several requests: a copy into
        each request trace it hit (record/batches.py), handed over the same way."""
        batch = batches.current()
        if batch is None or not batch.requests:
            return
        original = span.context
        copied = batches.copy_of(original.trace_id, original.span_id)
        for request, request_id in batches.targets(attributes, error, batch.requests):
            if not request.trace_flags.sampled:
                continue
            context = SpanContext(request.trace_id, batches.copy_span_id(original.span_id, request.span_id), False,
                                  request.trace_flags)
            self._targets.on_end(_processor.KernelSpan(
                span.name, context=context, parent=request, links=(Link(original),), resource=span.resource,
                attributes=self._fitted(batches.copy_attributes(attributes, copied, request_id)), events=span.events,
                kind=span.kind, status=span.status,
                start_time=span.start_time, end_time=span.end_time, instrumentation_scope=self._scope))

    def fail(self, call: tuple, exc: BaseException, note: str = "", added: dict | None = None) -> None:
        """Ends a call with status ERROR for `exc` (`note` follows its message)."""
        description = describe_exception(exc) + (f" ({note})" if note else "")
        self.end(call, added, (("exception", time_ns(), exception_event(exc)),), _STATUS_ERROR, description)
