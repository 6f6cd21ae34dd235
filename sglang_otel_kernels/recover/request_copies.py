"""Copies of the calls that matter into the request traces of their batch,
made by the paths that export spans read back from a trace file or an
archive: the sidecar, `replay` and `export` (record/batches.py holds the
rule, which in-process export applies too).

A kernel span's batch is found by walking up its parents; the batch's
request traces by the `<batch>.request` spans that link to it (their link
carries `sglang.batch.size`). A copy is the original with the request's
trace id, a span id of its own (the same on every path), the request span as
its parent, a link to the original, and `sglang.kernel.copy_of`.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Iterable

from ..record import batches
from ..schema import BATCH_SIZE, COPY_OF, NAME, REQUEST_ID
from ..record.reader import RecoveredSpan

_HOPS = 64  # parents walked up from a call to its batch
_KNOWN = 1024  # spans whose request spans are remembered
# The open spans linking to a span: (trace id, span id, attributes, the link's attributes, sampled) each.
Linking = Callable[[int], Iterable[tuple]]


class RequestTraces:
    """The copies a span gets, given how to find a span's parent
    (`parent_of`, None when unknown) and the spans linking to one (`linking_to`)."""

    def __init__(self, parent_of: Callable[[int], "int | None"], linking_to: Linking) -> None:
        self._parent_of = parent_of
        self._linking_to = linking_to
        # Asked again for each call of a batch that matters (a NaN flows through all of them); a batch's
        # request spans all start before its first kernel, so an answer holds while the batch runs.
        self._known: dict[int, list] = {}

    def _requests_of(self, span_id: int) -> list[tuple[int, int, bool, "str | None"]]:
        """The request spans of a batch: (trace id, span id, sampled, request id) each; [] for another span."""
        found = self._known.get(span_id)
        if found is None:
            if len(self._known) >= _KNOWN:
                self._known.clear()
            found = self._known[span_id] = [
                (trace_id, request_span, sampled, attributes.get(REQUEST_ID))
                for trace_id, request_span, attributes, link, sampled in self._linking_to(span_id)
                if BATCH_SIZE in link]
        return found

    def copies(self, span: RecoveredSpan) -> list[RecoveredSpan]:
        attributes = span.attributes
        error = span.status_code == "ERROR"
        if NAME not in attributes or COPY_OF in attributes or not batches.matters(attributes, error):
            return []
        requests: list = []
        current, hops = span.parent_span_id, 0
        while current and not requests and hops < _HOPS:
            requests = self._requests_of(current)
            current = self._parent_of(current)
            hops += 1
        copied = batches.copy_of(span.trace_id, span.span_id)
        return [dataclasses.replace(
            span, trace_id=trace_id, span_id=batches.copy_span_id(span.span_id, request_span),
            parent_span_id=request_span, parent_is_remote=False, parent_sampled=sampled,
            trace_flags=(span.trace_flags & ~1) | sampled,
            attributes=batches.copy_attributes(attributes, copied, request_id), events=list(span.events),
            links=[(span.trace_id, span.span_id, {})])
            for trace_id, request_span, sampled, request_id in batches.targets(attributes, error, requests)]


def of_spans(spans: list[RecoveredSpan]) -> RequestTraces:
    """The request traces of a whole file's (or archive's) spans."""
    parents = {span.span_id: span.parent_span_id for span in spans}
    linking: dict[int, list[tuple]] = {}
    for span in spans:
        for _, linked, link_attributes in span.links:
            linking.setdefault(linked, []).append(
                (span.trace_id, span.span_id, span.attributes, link_attributes, bool(span.trace_flags & 1)))
    return RequestTraces(parents.get, lambda span_id: linking.get(span_id, ()))


def with_copies(spans: list[RecoveredSpan], leave_out: "set[int] | frozenset" = frozenset()) -> tuple[list, int]:
    """`spans`, less those whose id is in `leave_out`, each followed by its
    copies (a copy already among `spans`, from an archive, is not made
    again); and how many copies were added. A span left out (the sidecar
    delivered it, with its copies) that matters for its NaN flags alone
    still gets its copies: those flags came after it was delivered (read
    live a step later, or from the flags file a crash left), so the sidecar
    copied it nowhere."""
    traces = of_spans(spans)
    present = {span.span_id for span in spans}
    out: list[RecoveredSpan] = []
    added = 0
    for span in spans:
        if span.span_id not in leave_out:
            out.append(span)
        elif not batches.matters_for_its_flags_alone(span.attributes, span.status_code == "ERROR"):
            continue
        for copy in traces.copies(span):
            if copy.span_id not in present:
                out.append(copy)
                added += 1
    return out, added
