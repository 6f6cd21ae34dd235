"""An exception no code caught, into each open trace file (a RAISED record).

A device error (a device-side assert, an illegal address) is raised at the
next synchronisation, usually outside any recorded call: at level 1 on an
H100, the assert in a decorated embedding surfaced at the script's own
`torch.cuda.synchronize()`, every call's span ended ok, and the interpreter
then exited "normally". Recorded here, `report` says the process ended on
that exception and that the kernel at fault ran before it. The hooks chain
to the ones they replace, so Python's own traceback is printed as before;
exceptions that are no error (KeyboardInterrupt, SystemExit) are not
recorded, as SGLang's logger logs Exception subclasses only.
"""

from __future__ import annotations

import sys
import threading
import time

from . import tracefile
from .silence import FILE_LENGTH

MESSAGE_LENGTH = 2000  # CUDA's messages run to a few hundred characters

_installed: list = []


def frames_of(tb) -> tuple:
    """(file, line, function) of a traceback's frames, innermost first, at most MAX_STACK_FRAMES."""
    frames = []
    while tb is not None:
        code = tb.tb_frame.f_code
        frames.append((code.co_filename[-FILE_LENGTH:], tb.tb_lineno or 0, code.co_name))
        tb = tb.tb_next
    return tuple(reversed(frames[-tracefile.MAX_STACK_FRAMES:]))


def record(exc: BaseException, tb, thread: str) -> None:
    """A RAISED record of `exc` into every open trace file; never raises."""
    if not isinstance(exc, Exception):
        return
    try:
        entry = (tracefile.RAISED, thread[:tracefile.THREAD_NAME_LENGTH], time.time_ns(), type(exc).__name__,
                 str(exc)[:MESSAGE_LENGTH],
                 frames_of(tb))
        tracefile.append_to_open_files(entry)
    except Exception:  # the host's own hook runs whatever happened here
        pass


def install() -> None:
    """Once per process, when its first trace file opens."""
    if _installed:
        return
    previous, previous_thread = sys.excepthook, threading.excepthook

    def excepthook(kind, exc, tb):
        record(exc, tb, threading.current_thread().name)
        previous(kind, exc, tb)

    def thread_excepthook(args):
        record(args.exc_value, args.exc_traceback, args.thread.name if args.thread is not None else "a thread")
        previous_thread(args)

    sys.excepthook, threading.excepthook = excepthook, thread_excepthook
    _installed.append(True)
