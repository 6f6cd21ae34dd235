"""One OpenTelemetry span per kernel call, through the OpenTelemetry API.

The span is a child of whatever span is current (the caller's request or
batch), is made current itself while the kernel runs (so nested kernels nest),
and is started with every input attribute already set.
"""

from __future__ import annotations

import traceback

from opentelemetry import context as context_api
from opentelemetry import trace
from opentelemetry.trace import SpanKind, Status, StatusCode

from .._version import __version__
from ..describe.values import safe_str
from ..schema import ATTRIBUTES_DROPPED
from ..text import utf8
from .attributes import fit
from .setup import resolve_provider

TRACER_NAME = "sglang_otel_kernels"


def _attribute_limit(tracer) -> int | None:
    """The per-span attribute limit the SDK will enforce, or None if unlimited.

    The SDK keeps it on the tracer; a proxy tracer (no provider installed yet)
    falls back to the limit the standard OTEL_* variables give."""
    limits = getattr(tracer, "_span_limits", None)
    if limits is None:
        try:
            from opentelemetry.sdk.trace import SpanLimits
        except ImportError:
            return None
        limits = SpanLimits()
    limit = getattr(limits, "max_span_attributes", None)
    return limit if isinstance(limit, int) and limit >= 0 else None


def describe_exception(exc: BaseException) -> str:
    message = safe_str(exc)
    return f"{type(exc).__name__}: {message}" if message else type(exc).__name__


def record_failure(span, exc: BaseException) -> None:
    """Status ERROR and the `exception` event, as the SDK's record_exception
    writes them but with every text valid UTF-8: one message holding a file
    name decoded with surrogateescape would make OTLP fail the whole batch."""
    span.set_status(Status(StatusCode.ERROR, describe_exception(exc)))
    try:
        stacktrace = utf8("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    except Exception:
        stacktrace = ""
    span.add_event("exception", {"exception.type": type(exc).__name__, "exception.message": safe_str(exc),
                                 "exception.stacktrace": stacktrace, "exception.escaped": "True"})


class SpanRecorder:
    """Starts and ends kernel spans; finds its tracer on the first span, so
    that importing at level >= 1 sets nothing up until a kernel runs."""

    def __init__(self, tracer_provider=None) -> None:
        self._configured = tracer_provider
        self.tracer = None
        self.limit: int | None = None
        self.start_room: int | None = None

    def setup(self):
        provider = resolve_provider(self._configured)
        tracer = provider.get_tracer(TRACER_NAME, __version__)
        limit = _attribute_limit(tracer)
        self.limit = limit
        # Room left at the start for the result's attributes and the drop count.
        self.start_room = None if limit is None else max(limit - min(32, limit // 4) - 1, 3)
        self.tracer = tracer
        return tracer

    def start(self, name: str, attrs: dict):
        """Starts the span, makes it current, returns (span, context token)."""
        tracer = self.tracer or self.setup()
        dropped = 0
        if self.start_room is not None:
            attrs, dropped = fit(attrs, self.start_room)
            if dropped:
                attrs[ATTRIBUTES_DROPPED] = dropped
        span = tracer.start_span(name, kind=SpanKind.INTERNAL, attributes=attrs)
        token = context_api.attach(trace.set_span_in_context(span))
        return span, token

    def add(self, span, attrs: dict) -> None:
        """Sets more attributes, within what the span has room for."""
        if not attrs or not span.is_recording():
            return
        present = getattr(span, "attributes", None)
        # Past the cheap check only when the span is close to its limit.
        if self.limit is not None and present is not None and len(present) + len(attrs) >= self.limit:
            new = {key: value for key, value in attrs.items() if key not in present}
            room = self.limit - len(present) - 1
            if len(new) > room:
                already = present.get(ATTRIBUTES_DROPPED, 0)
                kept, dropped = fit(new, room)
                attrs = {key: value for key, value in attrs.items() if key in present or key in kept}
                attrs[ATTRIBUTES_DROPPED] = already + dropped
        span.set_attributes(attrs)

    fail = staticmethod(record_failure)

    @staticmethod
    def end(span, token) -> None:
        try:
            span.end()
        finally:
            context_api.detach(token)
