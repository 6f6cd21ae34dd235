"""What a follower of a live trace file keeps of the spans that ended, so
that how its process ended is decided where every reader decides it
(recover/verdict.py `ending`, through the report's `process_entry`) from a
few spans, not the whole file read again once the process is gone: the
kernel call that ended last, the last failure and the newest failed call,
the newest exceptions no code caught with the call that ended before each,
and why the process was told to stop. Torch-free."""

from __future__ import annotations

import collections
from typing import Any

from ..schema import COPY_OF, EXCEPTION_SPAN, HUNG, NAME, STOP_SPAN
from ..recover.batch_failures import MAX_UNCAUGHT, is_failure
from ..recover.ranks import state_of
from ..record.reader import Assembler, RecoveredSpan, TraceFileContents
from ..recover.report import process_entry


class EndingSpans:
    def __init__(self, assembler: Assembler) -> None:
        self._assembler = assembler
        # The (start, end) records of a plain call that ended well (live/wire.py's, never made a span),
        # while it is the last call that ended: made a span only when asked for.
        self.plain: "tuple | None" = None
        self._last_call: "RecoveredSpan | None" = None
        self._failure: "RecoveredSpan | None" = None
        self._failed_call: "RecoveredSpan | None" = None
        self._stop: "RecoveredSpan | None" = None
        self._uncaught: collections.deque = collections.deque(maxlen=MAX_UNCAUGHT)  # (its span, the call before)

    def keep(self, span: RecoveredSpan) -> None:
        """A span of the file that ended (copies and early exports of calls
        still running are not the process's)."""
        attributes = span.attributes
        if span.in_flight or COPY_OF in attributes or HUNG in attributes:
            return
        if NAME in attributes:
            self._last_call, self.plain = span, None
            if span.status_code == "ERROR":
                self._failed_call = span
        if is_failure(span):
            self._failure = span
            if span.name == EXCEPTION_SPAN:
                self._uncaught.append((span, self.last_call()))
        if span.name == STOP_SPAN:
            self._stop = span

    def last_call(self) -> "RecoveredSpan | None":
        if self.plain is not None:
            self._last_call, self.plain = self._assembler.span(*self.plain), None
        return self._last_call

    def ending(self, path: str, metadata: dict, in_flight: "list[RecoveredSpan]", last_alive: int, exited: bool,
               died: int, signal: str) -> dict[str, Any]:
        """How the process ended (`ending`'s dict), of what was kept and the
        spans `in_flight` at its end: it `exited`, or died at `died` (ns; 0:
        not known) of `signal` ("" for none)."""
        kept = [self.last_call(), self._failure, self._failed_call, self._stop, *in_flight,
                *(span for pair in self._uncaught for span in pair)]
        spans = sorted({span.span_id: span for span in kept if span is not None}.values(),
                       key=lambda span: span.start_time)
        contents = TraceFileContents(path, metadata, spans, records=len(spans), skipped=0, problems=[],
                                     last_time=last_alive, exited=exited, died=died,
                                     fatal_signal=None if exited else signal)
        return process_entry(contents, state_of(contents, last_alive), len(spans))["ending"]
