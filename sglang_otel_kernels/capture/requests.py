"""Kernel spans inside request traces.

A serving engine runs one forward pass for a batch of requests, each with its
own trace. `forward_batch` opens a batch span that links to every request (and
is the request's child when there is only one); with several requests, each
request's trace also gets a short span linking back to the batch, so from any
request in Jaeger one reaches the kernels that served it, and under which the
calls that matter to it (failed, in flight at a death, hung, NaN/Inf out) are
copied (record/batches.py). `inject`/`extract`
carry a request's context across processes as a small picklable dict, as
SGLang carries it from its tokenizer process to its scheduler.
"""

from __future__ import annotations

import hashlib
import operator
import threading
from typing import Any, ContextManager, Iterable, Mapping, Sequence

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.sdk.trace.id_generator import IdGenerator
from opentelemetry.trace import DEFAULT_TRACE_STATE, Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from .. import config as _config
from ..notices import warn_failed_once, warn_once
from ..record import batches, core, identity
from ..record.file_spans import FileSpan, file_only, start_of, write_end
from ..record.spans import describe_exception, record_failure
from ..record.tracefile import CALLS, per_thread
from ..schema import BATCH_KERNEL_CALLS, BATCH_REQUEST_IDS, BATCH_SIZE, BATCH_UNTRACED, REQUEST_ID
from . import nan_flags
from .decorator import kernel_tracer, prime_parent


_propagator = TraceContextTextMapPropagator()
_getter = DefaultGetter()


def inject(context: context_api.Context | None = None) -> dict[str, str]:
    """The current (or given) trace context as a W3C carrier
    (`{"traceparent": ..., "tracestate": ...}`), a dict that pickles."""
    carrier: dict[str, str] = {}
    _propagator.inject(carrier, context=context)
    return carrier


def extract(carrier: Mapping[str, str] | str) -> context_api.Context:
    """A Context holding the remote span of a W3C carrier or `traceparent`
    string; use it as `context=` of a span, or `context.attach()` it."""
    if isinstance(carrier, str):
        carrier = {"traceparent": carrier}
    return _propagator.extract(carrier, getter=_getter)


def span_context_of(request: Any) -> SpanContext | None:
    """A request's span context: a SpanContext, a Span, a W3C carrier dict, a
    `traceparent` string, a Context, or an object exposing one of these as
    `span_context`, `trace_context`, `traceparent` or `carrier`."""
    if request is None:  # an untraced request (SGLang's without --enable-trace): every decode step
        return None
    if isinstance(request, SpanContext):
        return request if request.is_valid else None
    if isinstance(request, context_api.Context):  # SGLang's root_span_context: before the ABC checks below
        return span_context_of(trace.get_current_span(request).get_span_context())
    if isinstance(request, trace.Span):
        return span_context_of(request.get_span_context())
    if isinstance(request, str):
        return span_context_of(trace.get_current_span(extract(request)).get_span_context())
    if isinstance(request, Mapping):
        if "traceparent" not in request:
            return None
        return span_context_of(trace.get_current_span(extract(request)).get_span_context())
    for name in ("span_context", "trace_context", "traceparent", "carrier"):
        value = getattr(request, name, None)
        if value is not None and value is not request:
            return span_context_of(value)
    return None


def _request_id(request: Any) -> str | None:
    for name in ("rid", "request_id"):
        value = getattr(request, name, None)
        if value is not None:
            return str(value)
    return None


def _normalise(requests: Iterable[Any]) -> list[tuple[SpanContext | None, str | None]]:
    """(context, request id) pairs; a `(context-like, request id)` tuple names
    the id explicitly."""
    out = []
    for request in requests:
        if isinstance(request, tuple) and len(request) == 2:
            context_like, request_id = request
            out.append((span_context_of(context_like), None if request_id is None else str(request_id)))
        else:
            out.append((span_context_of(request), _request_id(request)))
    return out


def _keyed_trace_id(key: Any) -> int:
    """A batch's trace id, from its key and the job: the same on every rank.
    A key of a step number and what stays from step to step (SGLang's: its
    forward count and request ids) has the rest hashed once while it stays,
    and each step's number mixed in (every decode step comes here)."""
    global _base
    job = identity.value("job")
    if type(key) is not tuple or len(key) != 2 or type(key[0]) is not int or type(key[1]) is not tuple:
        return _digest((job, key))
    step, rest = key
    base = _base
    try:
        same = base[0] == rest and base[1] == job
    except Exception:  # items that do not compare: hashed every time
        return _digest((job, key))
    if not same:
        base = _base = (rest, job, _digest((job, rest)))
    # Multiplying by an odd number is a bijection modulo 2**128: one key's steps never share an id.
    return ((base[2] ^ step) * _MIX) & _ID_MASK or 1


def _digest(value: Any) -> int:
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=16).digest(), "big")


_base: tuple = (object(), None, 0)  # (the last stable part of a key, the job, their digest)
_MIX = 0x9E3779B97F4A7C15F39CC0605CEDC835
_ID_MASK = (1 << 128) - 1


def _context_of(span_context: SpanContext) -> context_api.Context:
    return trace.set_span_in_context(trace.NonRecordingSpan(span_context))


class _KeyedTraceIds(IdGenerator):
    """The provider's ids, except the trace id of a batch span started with
    a key (`forward_batch(batch_key=...)`): derived from the key and the
    job, so that every rank running that batch puts its spans in one trace."""

    def __init__(self, inner: IdGenerator) -> None:
        self.inner = inner
        self._local = threading.local()

    def keyed(self, key: Any) -> None:
        """The next trace id this thread generates comes from `key`."""
        self._local.pending = _keyed_trace_id(key)

    def forget(self) -> None:
        """No key for the next trace id (the span it was for has started)."""
        self._local.pending = None

    def generate_trace_id(self) -> int:
        pending = getattr(self._local, "pending", None)
        self._local.pending, self._local.last_keyed = None, pending is not None
        return pending if pending is not None else self.inner.generate_trace_id()

    def generate_span_id(self) -> int:
        return self.inner.generate_span_id()

    def is_trace_id_random(self) -> bool:
        return not getattr(self._local, "last_keyed", False) and self.inner.is_trace_id_random()


def _keyed_ids(tracer) -> "_KeyedTraceIds | None":
    """Our tracer's id generator made able to take a batch key, once; None
    for a tracer that is not the SDK's (its trace ids stay its own)."""
    ids = getattr(tracer, "id_generator", None)
    if isinstance(ids, _KeyedTraceIds) or ids is None:
        return ids
    tracer.id_generator = _KeyedTraceIds(ids)
    return tracer.id_generator


def _row_counts(rows: Any, members: int) -> "tuple[int, ...] | None":
    """`forward_batch`'s `rows`: one non-negative integer per request (numpy's
    and torch's integer scalars too), else None with one warning (the batch
    runs on; a tensor with a row per request still maps)."""
    if rows is None:
        return None
    try:
        counts = tuple(map(operator.index, rows))
        if len(counts) == members and (not counts or min(counts) >= 0):
            return counts
        problem = f"{len(counts)} values for {members} requests" if len(counts) != members else "a negative count"
    except TypeError:
        problem = "not a sequence of integers"
    warn_once(f"rows: {problem}", f"forward_batch(rows=...) ignored: {problem}; each request is taken as one row")
    return None


def forward_batch(
    requests: Iterable[Any],
    name: str = "forward_batch",
    attributes: Mapping[str, Any] | None = None,
    batch_key: Any = None,
    rows: Sequence[int] | None = None,
    end_later: bool = False,
) -> ContextManager[trace.Span]:
    """A batch span around one forward pass (`with forward_batch(...) as span:`);
    kernel spans opened inside are its children. An exception ends it (and the request
    spans) with status ERROR and is re-raised. `batch_key` (any value with a
    stable repr, the same on every rank for the same batch, such as a step
    number and the request ids) gives a batch of several requests a trace id
    derived from it, so the batch spans and kernels of all tensor-parallel
    ranks share one trace. `rows`: each request's row count in
    token-flattened tensors (prefill / extend: its extend length), so that at
    level 5 the rows of an output holding NaN/Inf are mapped to the requests
    they belong to; without it, a tensor with one row per request (decode)
    is mapped. The batch and its request spans end with
    `sglang.batch.kernel_calls`, the kernel calls made on this thread inside.
    `end_later`: a batch that ran leaves its span open for the caller to end
    (`end()`), after the engine's own work on its results: a process that
    dies meanwhile died while that batch was served."""
    return _BatchScope(requests, name, attributes, batch_key, rows, end_later)


class _Members:
    """What a batch span and its kernel calls need of the batch's requests:
    the attributes naming them, the links to the traced ones, the parent (a
    batch of one traced request), the Batch its calls see. Made when the
    requests change and reused while the same ones run again: a scheduler's
    decode steps run one batch of the same requests after another, and making
    these every step cost more than the span's records."""

    __slots__ = ("key", "rows", "attributes", "links", "parent", "traced", "names", "counts", "published")

    def __init__(self, key: tuple, members: list, counts: "tuple[int, ...] | None") -> None:
        self.key = key
        self.rows = None if counts is None else list(counts)  # what a caller's list of them compares equal to
        request_ids, traced, names = [], [], []
        for position, member in enumerate(members):
            span_context, request_id = member
            if request_id is not None:
                request_ids.append(request_id)
                names.append(request_id)
            else:
                names.append(f"#{position}")
            if span_context is not None:
                traced.append(member)
        size = len(members)
        # Shared by the spans of every step these requests run: never changed (FileSpan and the SDK copy or add).
        self.attributes: dict[str, Any] = {BATCH_SIZE: size, BATCH_REQUEST_IDS: request_ids}
        if len(traced) < size:
            self.attributes[BATCH_UNTRACED] = size - len(traced)
        self.links = tuple(Link(span_context, {REQUEST_ID: request_id} if request_id else None)
                           for span_context, request_id in traced)
        self.parent = traced[0][0] if size == 1 and traced else None
        self.traced = traced if size > 1 else ()  # each gets a request span under the batch, linked to it
        self.names, self.counts = names, counts
        # With request spans, the Batch names them, new every step; without, one serves every step.
        self.published = None if self.traced else batches.Batch((), names, counts)


_recent: "_Members | None" = None  # the last batch's (any thread's: one reference, replaced whole)


def _members_of(members: list, rows: Any) -> _Members:
    """The `_Members` of these (context, request id) pairs: the last batch's when they are the same."""
    global _recent
    key = (members, None if rows is None else _row_counts(rows, len(members)))
    recent = _recent
    if recent is None or recent.key != key:
        recent = _recent = _Members(key, members, key[1])
    return recent


# OpenTelemetry's ContextVar where the runtime context is its default one (chosen when
# OpenTelemetry's context module is imported): a batch attaches and detaches through it directly,
# every step; None: through OpenTelemetry's API.
_variable = core.context_var()[0]


def _detach_failed(error: Exception) -> None:
    # As OpenTelemetry's detach: a token of another context is told, not raised.
    warn_failed_once("detaching a batch's context", error)


# The compiled core opens a batch span of the trace file alone, with no request spans, itself
# (every decode step of an untraced request, or of one traced request): None where it cannot.
_open_natively = None
if core.native is not None and _variable is not None:
    core.native.set_batch(SpanContext, TraceFlags(TraceFlags.SAMPLED), DEFAULT_TRACE_STATE, context_api.Context,
                          batches.SPAN_KEY, batches.BATCH_KEY, BATCH_KERNEL_CALLS, write_end, record_failure,
                          _detach_failed)
    _open_natively = core.native.open_batch


class _BatchScope:
    """`forward_batch`'s context manager."""

    __slots__ = ("_arguments", "_end_later", "_opened")

    def __init__(self, requests, name, attributes, batch_key, rows, end_later) -> None:
        self._arguments = (requests, name, attributes, batch_key, rows)
        self._end_later = end_later

    def __enter__(self) -> trace.Span:
        requests, name, attributes, batch_key, rows = self._arguments
        self._opened = open_batch(_normalise(requests), name, attributes, batch_key, rows, self._end_later)
        return self._opened.span

    def __exit__(self, kind, exc, traceback) -> bool:
        self._opened.close(exc if kind is not None else None)
        return False  # the exception, if any, goes on


class OpenBatch:
    """A batch span `open_batch` opened, its context attached: `span`, and
    `close`, which detaches it and ends it (and its request spans)."""

    __slots__ = ("span", "_request_spans", "_token", "_state", "_calls_before", "_end_later")

    def close(self, exc: "BaseException | None") -> None:
        """After the batch ran (`exc`: None) or raised `exc`, which is recorded
        on its spans (status ERROR). The span is left open where it ran and
        was opened with `end_later`."""
        batch, request_spans = self.span, self._request_spans
        try:
            if exc is not None:
                record_failure(batch, exc)
                for span in request_spans:
                    span.set_status(Status(StatusCode.ERROR, describe_exception(exc)))
        finally:
            if _variable is None:
                context_api.detach(self._token)
            else:
                try:
                    _variable.reset(self._token)
                except Exception as error:  # as OpenTelemetry's detach: a token of another context is told, not raised
                    warn_failed_once("detaching a batch's context", error)
            calls = self._state[CALLS] - self._calls_before
            for span in request_spans:
                span.set_attribute(BATCH_KERNEL_CALLS, calls)
                span.end()
            batch.set_attribute(BATCH_KERNEL_CALLS, calls)
            if exc is not None or not self._end_later:
                batch.end()
            nan_flags.step_ended()


def open_batch(members: list, name: str, attributes: "Mapping[str, Any] | None", batch_key: Any,
               rows: "Sequence[int] | None", end_later: bool) -> OpenBatch:
    """`forward_batch`'s span (with its request spans), opened for `members`,
    the batch's (span context or None, request id or None) pairs, and its
    context attached: an engine's integration calls this every step, without
    a context manager's calls. An OpenBatch, or the compiled core's
    `BatchScope` where the core opened it (the same `span` and `close`)."""
    tracer = kernel_tracer()
    current = _variable.get() if _variable is not None else context_api.get_current()
    batch_members = _recent
    # The last batch's requests and rows (every decode step, the rows a new list of the same counts): no call.
    if (batch_members is None or batch_members.key[0] != members
            or (rows != batch_members.rows if type(rows) is list else rows is not None or batch_members.rows is not None)):
        batch_members = _members_of(members, rows)
    batch_attributes = {**batch_members.attributes, **attributes} if attributes else batch_members.attributes
    links, parent, traced = batch_members.links, batch_members.parent, batch_members.traced
    if file_only(tracer, len(links)):  # the trace file alone: its records written straight (record/file_spans.py)
        around = parent or batches.current_span_context(current)
        trace_id = _keyed_trace_id(batch_key) if batch_key is not None and not around[5] else None
        if _open_natively is not None and not traced and not _config.get_config().nan_flags:  # its end: ours
            start = start_of(name, batch_attributes, links)
            try:
                opened = start and _open_natively(FileSpan, start, around if around[5] else None, trace_id, current,
                                                  batch_members.published, end_later)
            except Exception as exc:
                warn_failed_once("a batch span in the compiled core", exc)
                opened = None
            if opened is not None:
                return opened
        batch = FileSpan(name, around, batch_attributes, links, trace_id=trace_id)
        if traced:
            batch_link = (Link(batch.get_span_context(), {BATCH_SIZE: len(batch_members.names)}),)
            request_spans = [FileSpan(f"{name}.request", span_context, {REQUEST_ID: request_id} if request_id else {},
                                      batch_link) for span_context, request_id in traced]
    else:
        ids = _keyed_ids(tracer) if parent is None and batch_key is not None else None
        if ids is not None:
            ids.keyed(batch_key)
        try:
            batch = tracer.start_span(name, context=None if parent is None else _context_of(parent),
                                      kind=SpanKind.INTERNAL, attributes=batch_attributes, links=links)
        finally:
            if ids is not None:
                ids.forget()
        if traced:
            batch_link = [Link(batch.get_span_context(), {BATCH_SIZE: len(batch_members.names)})]
            request_spans = [tracer.start_span(f"{name}.request", context=_context_of(span_context),
                                               kind=SpanKind.INTERNAL,
                                               attributes={REQUEST_ID: request_id} if request_id else None,
                                               links=batch_link) for span_context, request_id in traced]
    if traced:  # the request spans copies go under
        published = batches.Batch(tuple((span.get_span_context(), request_id)
                                        for span, (_, request_id) in zip(request_spans, traced)),
                                  batch_members.names, batch_members.counts)
    else:
        request_spans, published = (), batch_members.published
    opened = OpenBatch()
    opened.span, opened._request_spans, opened._end_later = batch, request_spans, end_later
    opened._state = state = per_thread.state
    opened._calls_before = state[CALLS]
    published = batches.publish(published, batch, current)
    opened._token = _variable.set(published) if _variable is not None else context_api.attach(published)
    prime_parent(published, batch.get_span_context())
    return opened
