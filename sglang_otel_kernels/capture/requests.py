"""Kernel spans inside request traces.

A serving engine runs one forward pass for a batch of requests, each with its
own trace. `forward_batch` opens a batch span that links to every request (and
is the request's child when there is only one); with several requests, each
request's trace also gets a short span linking back to the batch, so from any
request in Jaeger one reaches the kernels that served it. `inject`/`extract`
carry a request's context across processes as a small picklable dict, as
SGLang carries it from its tokenizer process to its scheduler.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterable, Iterator, Mapping

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.propagators.textmap import DefaultGetter
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from ..record.spans import describe_exception, record_failure
from ..schema import BATCH_REQUEST_IDS, BATCH_SIZE, BATCH_UNTRACED, REQUEST_ID
from .decorator import kernel_tracer


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
    if isinstance(request, SpanContext):
        return request if request.is_valid else None
    if isinstance(request, trace.Span):
        return span_context_of(request.get_span_context())
    if isinstance(request, str):
        return span_context_of(trace.get_current_span(extract(request)).get_span_context())
    if isinstance(request, context_api.Context):
        return span_context_of(trace.get_current_span(request).get_span_context())
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


@contextlib.contextmanager
def forward_batch(
    requests: Iterable[Any],
    name: str = "forward_batch",
    attributes: Mapping[str, Any] | None = None,
) -> Iterator[trace.Span]:
    """A batch span around one forward pass; kernel spans opened inside are its
    children. Yields the batch span. An exception ends it (and the request
    spans) with status ERROR and is re-raised."""
    tracer = kernel_tracer()
    members = _normalise(requests)
    request_ids = [request_id for _, request_id in members if request_id is not None]
    traced = [(span_context, request_id) for span_context, request_id in members if span_context is not None]
    batch_attributes: dict[str, Any] = {BATCH_SIZE: len(members), BATCH_REQUEST_IDS: request_ids}
    if len(traced) < len(members):
        batch_attributes[BATCH_UNTRACED] = len(members) - len(traced)
    batch_attributes.update(attributes or {})
    links = [Link(span_context, {REQUEST_ID: request_id} if request_id else None) for span_context, request_id in traced]
    parent = None
    if len(members) == 1 and traced:
        parent = trace.set_span_in_context(trace.NonRecordingSpan(traced[0][0]))
    batch = tracer.start_span(name, context=parent, kind=SpanKind.INTERNAL, attributes=batch_attributes, links=links)
    request_spans = []
    if len(members) > 1:
        batch_link = [Link(batch.get_span_context(), {BATCH_SIZE: len(members)})]
        for span_context, request_id in traced:
            request_spans.append(
                tracer.start_span(
                    f"{name}.request",
                    context=trace.set_span_in_context(trace.NonRecordingSpan(span_context)),
                    kind=SpanKind.INTERNAL,
                    attributes={REQUEST_ID: request_id} if request_id else None,
                    links=batch_link,
                )
            )
    token = context_api.attach(trace.set_span_in_context(batch))
    try:
        yield batch
    except BaseException as exc:
        record_failure(batch, exc)
        for span in request_spans:
            span.set_status(Status(StatusCode.ERROR, describe_exception(exc)))
        raise
    finally:
        context_api.detach(token)
        for span in request_spans:
            span.end()
        batch.end()
