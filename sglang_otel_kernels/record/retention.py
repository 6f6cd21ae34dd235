"""Which trace files of earlier runs a directory keeps.

Every run writes a file (by default `sglang_kernel_trace_<pid>.sgltrace` in
the working directory), so when a process creates its file, the files earlier
runs of the same name pattern left beside it are looked at, in a background
thread: the newest `keep` stay whatever they hold; of the older ones, a file
is removed only when it is plainly uneventful: no live writer holds it, it
reads back whole, no call was in flight when its process ended, no call
failed, and no traceback was saved beside it. A crash, a failure, a file
that cannot be judged and a live process's file are never removed.
"""

from __future__ import annotations

import glob
import os

from ..config import DEFAULT_TRACE_FILE_KEEP
from .tracefile import BESIDE, traceback_path
from .reader import TraceFileError, read_trace_file


def earlier_files(template: str, own: str) -> list[str]:
    """The files of this name pattern (`%i` any pid; a fixed path's rotated
    `.prev-*` and `.<pid>` siblings), newest first, this process's own left out."""
    pattern = glob.escape(os.path.abspath(template))
    stem, ext = os.path.splitext(pattern)
    patterns = {pattern.replace("%i", "*"), f"{stem.replace('%i', '*')}.*{ext}"}
    found = {path for each in patterns for path in glob.glob(each) if os.path.isfile(path)} - {own}
    return sorted(found, key=_mtime, reverse=True)


def _mtime(path: str) -> float:
    try:
        return os.stat(path).st_mtime
    except OSError:
        return 0.0


def uneventful(path: str) -> bool:
    """Nothing in the file that a user could want: see the module's words."""
    try:
        if os.path.getsize(traceback_path(path)) > 0:
            return False
    except OSError:
        pass
    try:
        contents = read_trace_file(path)
    except TraceFileError:
        return False
    return not (contents.live or contents.problems or
                any(span.in_flight or span.status_code == "ERROR" for span in contents.spans))


def prune(template: str, own: str, keep: int = DEFAULT_TRACE_FILE_KEEP) -> list[str]:
    """Removes the uneventful files beyond the newest `keep`; returns them."""
    removed = []
    for path in earlier_files(template, own)[keep:]:
        if not uneventful(path):
            continue
        for each in (path, *(beside(path) for beside in BESIDE)):
            try:
                os.unlink(each)
            except OSError:
                continue
            if each == path:
                removed.append(path)
    return removed
