"""A batch's requests, as the kernel calls it runs see them.

One forward pass serves many requests, each with a trace of its own; its
kernel spans sit in the batch's trace. A call that matters (it failed, was in
flight at a death, was exported as hung, or put NaN/Inf into an output) is
also copied into the trace of each request it hit, as a child of that
request's `<batch>.request` span (docs/span-schema.md, "Copies"). This module
holds the rule every exporting path applies (in-process, the sidecar,
`replay`, `export`): which calls are copied, into which requests, and the
copy's identity; and the batch `forward_batch` publishes in the
OpenTelemetry context: where its request spans are, and which rows of a
tensor belong to which request (NaN provenance, level 5). Torch-free.
"""

from __future__ import annotations

import bisect
import hashlib
import itertools
from typing import Iterable, Sequence, TypeVar

from opentelemetry import context as context_api
from opentelemetry import trace

from ..schema import (COPY_OF, CULPRIT_REQUESTS, HAS_INF, HAS_NAN, HUNG, IN_FLIGHT, NONFINITE, NONFINITE_FLAG,
                      NONFINITE_REQUESTS, REQUEST_CULPRIT)

# Request ids `sglang.kernel.nonfinite_requests` names at most (the first ones, in batch order).
MAX_NONFINITE_REQUESTS = 256
# The key a context holds its batch under.
BATCH_KEY = context_api.create_key("sglang_otel_kernels.batch")
# The key OpenTelemetry keeps a context's current span under, as its own API sets it.
(SPAN_KEY,) = trace.set_span_in_context(trace.INVALID_SPAN, context_api.Context()).keys()
Request = TypeVar("Request", bound=tuple)


class Batch:
    """What `forward_batch` knows of its requests: `requests`, the request
    spans copies go under (one per traced request of a batch of several,
    each `(span context, request id or None)`); `names`, each member's
    request id (`#<position>` when it has none), in row order; `rows`, each
    member's row count in token-flattened tensors, when declared."""

    __slots__ = ("requests", "names", "_rows", "_starts")

    def __init__(self, requests: tuple, names: Sequence[str], rows: "Sequence[int] | None" = None) -> None:
        self.requests = requests
        self.names = tuple(names)
        self._rows = rows
        self._starts: "tuple[int, ...] | None" = None

    def owners(self, leading: int, rows: Iterable[int]) -> "list[str] | None":
        """The request ids owning `rows` of a tensor whose leading dimension
        is `leading`, in batch order; None when that dimension maps to no
        request (neither the declared row counts' sum nor one per request)."""
        # Where each member's rows start in a tensor of sum(rows) rows, and that sum last: made
        # here, when NaN/Inf is found, not every step.
        starts = self._starts
        if starts is None and self._rows is not None:
            starts = self._starts = tuple(itertools.accumulate(self._rows, initial=0))
        if starts is not None and leading == starts[-1]:
            members = {bisect.bisect_right(starts, row) - 1 for row in rows}
        elif leading == len(self.names):
            members = set(rows)
        else:
            return None
        return [self.names[index] for index in sorted(members) if 0 <= index < len(self.names)]


def publish(batch: Batch, span: trace.Span, context: context_api.Context) -> context_api.Context:
    """`context` with `span` as its current span and `batch` as the batch its
    kernel calls run in: one copy of it, not one a value (every decode step)."""
    return context_api.Context({**context, SPAN_KEY: span, BATCH_KEY: batch})


def current_span_context(context: context_api.Context) -> trace.SpanContext:
    """The context of `context`'s current span (`trace.get_current_span`'s, from a context in hand)."""
    span = context.get(SPAN_KEY)
    if span is None:  # before Span's ABC check, which costs microseconds with the caches cold (every step)
        return trace.INVALID_SPAN_CONTEXT
    return span.get_span_context() if isinstance(span, trace.Span) else trace.INVALID_SPAN_CONTEXT


def current() -> "Batch | None":
    """The batch the calling kernel runs in, if any."""
    return context_api.get_value(BATCH_KEY)


def output_flagged(attributes) -> bool:
    """Whether a kernel span flagged NaN/Inf on an output (level 5's statistics, or the NaN flags)."""
    if not (attributes.get(HAS_NAN) is True or attributes.get(HAS_INF) is True
            or attributes.get(NONFINITE_FLAG) is True):
        return False
    return any(path == "output" or str(path).startswith("output.") for path in attributes.get(NONFINITE) or ())


def _failed(attributes, error: bool) -> bool:
    """It failed (`error`, which a call in flight at a death also is), or was exported as hung."""
    return error or attributes.get(HUNG) is True or attributes.get(IN_FLIGHT) is True


def matters(attributes, error: bool) -> bool:
    """Whether a kernel span is copied into its batch's request traces: it
    failed, or flagged NaN/Inf on an output."""
    return _failed(attributes, error) or output_flagged(attributes)


def matters_for_its_flags_alone(attributes, error: bool) -> bool:
    """Whether a kernel span matters only for its NaN flags, which are learnt
    after its end (capture/nan_flags.py, or the reader from the flags file a
    crash left): whoever delivered it as it ended copied it nowhere."""
    return not _failed(attributes, error) and attributes.get(NONFINITE_FLAG) is True and not (
        attributes.get(HAS_NAN) is True or attributes.get(HAS_INF) is True)


def targets(attributes, error: bool, requests: Sequence[Request]) -> list[Request]:
    """The requests of `requests` (tuples whose last item is the request id
    or None) a kernel span is copied to: all of them for a failure, a call in
    flight or hung; for NaN/Inf alone, those named by
    `sglang.kernel.nonfinite_requests` when its rows were mapped, else all."""
    if error or attributes.get(HUNG) is True or attributes.get(IN_FLIGHT) is True:
        return list(requests)
    if not output_flagged(attributes):
        return []
    named = attributes.get(NONFINITE_REQUESTS)
    if not isinstance(named, (tuple, list)):
        return list(requests)
    chosen = set(map(str, named))
    return [request for request in requests if request[-1] is not None and str(request[-1]) in chosen]


def copy_span_id(original: int, request_span: int) -> int:
    """The span id of the copy of span `original` under request span
    `request_span`: the same on every path and every run, so a copy made
    twice (an archive exported again) is recognised as one."""
    digest = hashlib.blake2b(original.to_bytes(8, "big") + request_span.to_bytes(8, "big"), digest_size=8).digest()
    return int.from_bytes(digest, "big") or 1


def copy_of(trace_id: int, span_id: int) -> str:
    """The value of `sglang.kernel.copy_of`: the original's `<trace id>:<span id>`, in hex."""
    return f"{trace_id:032x}:{span_id:016x}"


def copy_attributes(attributes: dict, copied: str, request_id) -> dict:
    """The attributes of the copy (`copied`, the original's `copy_of`) into
    the trace of request `request_id`: the original's, with
    `sglang.request.culprit` true in the trace of a request the failure was
    traced to (`sglang.kernel.culprit_requests`)."""
    found = {COPY_OF: copied, **attributes}
    culprits = attributes.get(CULPRIT_REQUESTS)
    if request_id is not None and isinstance(culprits, (tuple, list)) and str(request_id) in map(str, culprits):
        found[REQUEST_CULPRIT] = True
    return found
