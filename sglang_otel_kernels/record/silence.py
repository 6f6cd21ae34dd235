"""Where a silent thread waits.

A rank stuck outside any decorated call (a lock never released, a CPU-side
broadcast of scheduling data, a deadlock in Python) records nothing, so the
trace file alone cannot say where it is. The writer's heartbeat thread looks
at each thread's call counter once a second (tracefile.per_thread: nothing
is added to the kernel path); a thread that has recorded calls and then
records none for SGLANG_KERNEL_API_HANG_SECONDS gets its Python stack
written into the trace file as a STACK record: at most MAX_STACK_FRAMES frames,
once per silent period, and again when the stack changes or the ring wraps
(so that a long silence survives the laps of a busy process).
"""

from __future__ import annotations

import sys
import threading

from . import tracefile
from .tracefile import CALLS, MAX_STACK_FRAMES, STACK

_FILE_LENGTH = 200  # the end of a long path is the part that tells
_SLACK = 64  # states of threads that ended, kept until there are more than this


def stack_of(frame) -> tuple:
    """(file, line, function) of each frame from `frame` outwards, at most MAX_STACK_FRAMES."""
    frames = []
    while frame is not None and len(frames) < MAX_STACK_FRAMES:
        code = frame.f_code
        frames.append((code.co_filename[-_FILE_LENGTH:], frame.f_lineno or 0, code.co_name))
        frame = frame.f_back
    return tuple(frames)


class SilentThreads:
    """Called by a writer's heartbeat (`check`) with the time of the beat."""

    def __init__(self, after_s: float) -> None:
        self.after_ns = int(after_s * 1e9)
        # ident -> (its call count, since when it has not changed, what was written: (stack, ring wraps) or None)
        self._seen: dict[int, tuple] = {}

    def check(self, writer: "tracefile.TraceFileWriter", now: int) -> None:
        states = tracefile.thread_states
        if len(states) > threading.active_count() + _SLACK:  # threads that ended (a thread per request)
            alive = {thread.ident for thread in threading.enumerate()}
            for ident in [ident for ident in states if ident not in alive]:
                states.pop(ident, None)
                self._seen.pop(ident, None)
        current = None
        for ident, state in list(states.items()):
            calls = state[CALLS]
            seen = self._seen.get(ident)
            if seen is None or seen[0] != calls:
                self._seen[ident] = (calls, now, None)
                continue
            if not calls or now - seen[1] < self.after_ns:
                continue
            if current is None:
                current = sys._current_frames()
            frame = current.get(ident)
            if frame is None:  # the thread has ended
                del self._seen[ident]
                if tracefile.thread_states.get(ident) is state:
                    del tracefile.thread_states[ident]
                continue
            written = (stack_of(frame), writer.wraps)
            if written != seen[2]:
                writer.append((STACK, ident, now, seen[1], written[0]))
                self._seen[ident] = (calls, seen[1], written)
