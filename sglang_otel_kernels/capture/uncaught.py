"""An exception no code caught, recorded as a span (schema.EXCEPTION_SPAN).

A device error (a device-side assert, an illegal address) is raised at the
next synchronisation, usually outside any recorded call: at level 1 on an
H100, the assert in a decorated embedding surfaced at the script's own
`torch.cuda.synchronize()`, every call's span ended ok, and the interpreter
then exited "normally". Recorded as a failed span, it is in the trace file
and wherever spans are exported (Jaeger shows it as an error span), and
`report` says the process ended on that exception. The hooks chain to the
ones they replace, so Python's own traceback is printed as before;
exceptions that are no error (KeyboardInterrupt, SystemExit) are not
recorded, as SGLang's logger logs Exception subclasses only.
"""

from __future__ import annotations

import sys
import threading

from ..record.setup import on_open
from ..record.spans import record_failure
from ..schema import EXCEPTION_SPAN, THREAD_NAME
from .decorator import kernel_tracer

_installed: list = []


def record(exc: BaseException, thread: str) -> None:
    """A failed EXCEPTION_SPAN for `exc`; never raises."""
    if not isinstance(exc, Exception):
        return
    try:
        span = kernel_tracer().start_span(EXCEPTION_SPAN, attributes={THREAD_NAME: thread})
        record_failure(span, exc)
        span.end()
    except Exception:  # the host's own hook runs whatever happened here
        pass


def install(path: str = "") -> None:
    """Once per process, when its first trace file opens (`on_open`)."""
    if _installed:
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, exc, tb):
        record(exc, threading.current_thread().name)
        previous(kind, exc, tb)

    def thread_excepthook(args):
        record(args.exc_value, args.thread.name if args.thread is not None else "a thread")
        previous_thread(args)

    sys.excepthook, threading.excepthook = excepthook, thread_excepthook
    _installed.append(True)


on_open(install)
