"""The production black box: kernel calls recorded straight into the trace
file, without an OpenTelemetry span. Per call, one fixed-size record before
the kernel (site, call number, start time, thread, and the ids of the span
around the call, the request or batch) and one after (end time, status); the
kernel's name is written once per site, and again whenever the ring wraps.
Spans of the application (requests, batches) are recorded as usual, so the
reader puts each call inside them."""

from __future__ import annotations

import itertools
from threading import get_ident
from time import time_ns

from opentelemetry import trace

from ..describe.values import safe_str
from . import tracefile

_LOW64 = (1 << 64) - 1
_site_ids = itertools.count(1)
STATUS_OK = 0
STATUS_ERROR = 2


class BlackBoxSite:
    """One decorated kernel's records."""

    __slots__ = ("site_id", "name", "_noted_in", "_noted_generation")

    def __init__(self, name: str) -> None:
        self.site_id = next(_site_ids)
        self.name = name
        self._noted_in = None  # the writer, and its generation, the name was last written to
        self._noted_generation = -1

    def start(self, writer: "tracefile.TraceFileWriter", seq: int, _pack=tracefile.KERNEL_START.pack,
              _kind=tracefile.ENCODING_KERNEL_START) -> None:
        context = trace.get_current_span().get_span_context()
        thread = get_ident()
        if self._noted_in is not writer or self._noted_generation != writer.generation:
            writer.append((tracefile.SITE, self.site_id, self.name))
            self._noted_in, self._noted_generation = writer, writer.generation
        if writer.thread_generation.get(thread) != writer.generation:
            writer.note_thread(thread)
        trace_id = context.trace_id
        if not writer.failed:
            writer.write_record(_kind, _pack(self.site_id, seq, time_ns(), thread, trace_id >> 64, trace_id & _LOW64,
                                       context.span_id))

    @staticmethod
    def end(writer: "tracefile.TraceFileWriter", seq: int, status: int = STATUS_OK,
            _pack=tracefile.KERNEL_END.pack, _kind=tracefile.ENCODING_KERNEL_END) -> None:
        if not writer.failed:
            writer.write_record(_kind, _pack(seq, time_ns(), status))

    @classmethod
    def fail(cls, writer: "tracefile.TraceFileWriter", seq: int, exc: BaseException) -> None:
        writer.append((tracefile.FAILURE, seq, type(exc).__name__, safe_str(exc)))
        cls.end(writer, seq, STATUS_ERROR)
