"""The production black box: kernel calls recorded straight into the trace
file, without an OpenTelemetry span. Per call, one fixed-size record before
the kernel (kernel name symbol, call number, start time, thread, and the ids
of the span around the call, the request or batch) and one after (end time,
status). Spans of the application (requests, batches) are recorded as usual,
so the reader puts each call inside them."""

from __future__ import annotations

from threading import get_ident
from time import time_ns

from opentelemetry import trace

from ..describe.values import safe_str
from . import tracefile

_LOW64 = (1 << 64) - 1
STATUS_OK = 0
STATUS_ERROR = 2


def start(writer: "tracefile.TraceFileWriter", name: str, seq: int, _pack=tracefile.KERNEL_START.pack,
          _kind=tracefile.ENCODING_KERNEL_START, _current=trace.get_current_span) -> None:
    context = _current().get_span_context()
    thread = get_ident()
    if thread not in writer.threads:
        writer.note_thread(thread)
    trace_id = context.trace_id
    writer.write_record(_kind, _pack(writer.symbol(name), seq, time_ns(), thread, trace_id >> 64, trace_id & _LOW64,
                                     context.span_id))


def end(writer: "tracefile.TraceFileWriter", seq: int, status: int = STATUS_OK,
        _pack=tracefile.KERNEL_END.pack, _kind=tracefile.ENCODING_KERNEL_END) -> None:
    writer.write_record(_kind, _pack(seq, time_ns(), status))


def fail(writer: "tracefile.TraceFileWriter", seq: int, exc: BaseException) -> None:
    writer.append((tracefile.FAILURE, seq, type(exc).__name__, safe_str(exc)))
    end(writer, seq, STATUS_ERROR)
