"""Opening a file that may be hostile (a trace file, a dump's metadata, a
traceback beside a trace file): never block on a FIFO, never take anything
but a regular file. Torch-free."""

from __future__ import annotations

import os
import stat


class NotRegularFile(ValueError):
    """The path names a FIFO, a directory, a device...; `kind` says which."""

    def __init__(self, path: str, kind: str) -> None:
        super().__init__(f"{path} is {kind}")
        self.kind = kind


def open_regular(path: str, flags: int = os.O_RDONLY, mode: int = 0o600) -> int:
    """A descriptor of the regular file at `path`, opened with `flags`
    without blocking (a FIFO would block an open for reading); OSError as
    os.open raises it, NotRegularFile for anything but a regular file."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, mode)
    kind = os.fstat(fd).st_mode
    if not stat.S_ISREG(kind):
        os.close(fd)
        raise NotRegularFile(path, "a directory" if stat.S_ISDIR(kind) else
                             "a FIFO" if stat.S_ISFIFO(kind) else "not a regular file")
    os.set_blocking(fd, True)
    return fd
