"""The NaN flags' crash-safe file, `<trace file>.nanflags` (issue 63).

With SGLANG_KERNEL_API_NAN_FLAGS=1 each recorded call's outputs are reduced
on their device to non-finite flags in a slot of a device buffer
(capture/nan_flags.py); at each step's end the slots written since the last
are copied without blocking into this file's pages, mapped shared, which
outlive the process however it dies. The layout, little-endian:

    header (64 bytes)  magic "SGLNANF1", version, slots, width, pid, the
                       confirmed call number (at 24: the newest call whose
                       flags are known to have landed), creation time (ns)
    index              a slot each (16 bytes): the call number, the rows
                       flagged of its first output, the other outputs
                       flagged; written by the host when the call is made
    flags              a slot each (`width` bytes): one a row of the first
                       output, then one an other output: 1 all finite,
                       0 non-finite; 1 where nothing was written

A slot's flags land at the step's end, its index at the call: a slot is
trusted only when its call number is at most the confirmed one, which the
copy itself writes after the flags (on the same stream), so a crash
between the two never pairs a call with an earlier call's flags. What is
lost to a crash is bounded by the calls since the last step's end.

Every such file read is hostile input: a regular file only, its size
bounded and agreeing with its header, each slot's counts within its width.
Torch-free.
"""

from __future__ import annotations

import dataclasses
import mmap
import os
import struct
import time

from .. import files

MAGIC = b"SGLNANF1"
VERSION = 1
HEADER = struct.Struct("<8sIIIIQQ")  # magic, version, slots, width, pid, confirmed call, created ns
HEADER_SIZE = 64
CONFIRMED_AT = 24  # where the header keeps the confirmed call number (8-aligned: a device copy writes it)
INDEX = struct.Struct("<QHHI")  # call number, rows, other outputs, reserved
MAX_SLOTS = 1 << 16
MAX_WIDTH = 1 << 12
MAX_SIZE = HEADER_SIZE + MAX_SLOTS * (INDEX.size + MAX_WIDTH)
FINITE_BYTE, NONFINITE_BYTE = 1, 0  # a flag's two values


def _size(slots: int, width: int) -> int:
    return HEADER_SIZE + slots * (INDEX.size + width)


class FlagFile:
    """A new flags file, mapped shared for this process to write: `index`
    and `flags` are the two regions (`flags` a writable buffer a device copy
    can land in). Never opens over an existing file (an earlier run's
    evidence): FileExistsError. With no path, the same in memory alone
    (nothing outlives the process)."""

    def __init__(self, path: "str | None", slots: int, width: int) -> None:
        if not (0 < slots <= MAX_SLOTS and 0 < width <= MAX_WIDTH):
            raise ValueError(f"slots must be in 1..{MAX_SLOTS} and width in 1..{MAX_WIDTH}")
        self.path, self.slots, self.width = path, slots, width
        size = _size(slots, width)
        if path is None:
            self.mapping = mmap.mmap(-1, size)
        else:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
            try:
                os.ftruncate(fd, size)
                self.mapping = mmap.mmap(fd, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
            os.close(fd)
        index_at = HEADER_SIZE
        flags_at = index_at + slots * INDEX.size
        view = memoryview(self.mapping)
        self.index = view[index_at:flags_at]
        self.flags = view[flags_at:]
        self.flags[:] = bytes([FINITE_BYTE]) * len(self.flags)  # nothing written reads as finite: never a false flag
        HEADER.pack_into(self.mapping, 0, MAGIC, VERSION, slots, width, os.getpid(), 0, time.time_ns())
        self.header = view[:HEADER_SIZE]

    def set_index(self, slot: int, seq: int, rows: int, others: int, _pack=INDEX.pack_into) -> None:
        _pack(self.index, slot * INDEX.size, seq, rows, others, 0)

    def confirm(self, seq: int) -> None:
        """The flags of calls up to `seq` are in the file (a copy the host made itself)."""
        struct.pack_into("<Q", self.mapping, CONFIRMED_AT, seq)


@dataclasses.dataclass
class Flagged:
    """A call whose flags say it made NaN/Inf: its call number, the rows of
    its first output flagged (of `rows` it had flagged per row), whether an
    other output was."""

    seq: int
    rows: int
    bad_rows: tuple
    other_output: bool


@dataclasses.dataclass
class FlagFileContents:
    path: str
    pid: int
    confirmed: int  # the newest call whose flags are known to have landed
    flagged: list  # Flagged, by call number
    unconfirmed: int  # calls recorded after `confirmed`: their flags may not have landed
    problems: list


def read_flag_file(path: str) -> "FlagFileContents | None":
    """The flagged calls of the flags file at `path`, validated; None when
    there is none; a file that is not one is a problem, never an error."""
    try:
        fd = files.open_regular(path)
    except FileNotFoundError:
        return None
    except (OSError, files.NotRegularFile) as exc:
        return FlagFileContents(path, 0, 0, [], 0, [f"{path}: cannot read the NaN flags ({exc})"])
    try:
        size = os.fstat(fd).st_size
        if not HEADER_SIZE <= size <= MAX_SIZE:
            return FlagFileContents(path, 0, 0, [], 0, [f"{path}: {size} bytes, not a NaN flags file"])
        data = os.pread(fd, size, 0)
    finally:
        os.close(fd)
    magic, version, slots, width, pid, confirmed, _ = HEADER.unpack_from(data, 0)
    if magic != MAGIC or version != VERSION or not (0 < slots <= MAX_SLOTS and 0 < width <= MAX_WIDTH) \
            or len(data) != _size(slots, width):
        return FlagFileContents(path, pid, 0, [], 0, [f"{path}: not a NaN flags file of this version"])
    flags_at = HEADER_SIZE + slots * INDEX.size
    flagged, unconfirmed, problems = [], 0, []
    for slot in range(slots):
        seq, rows, others, _ = INDEX.unpack_from(data, HEADER_SIZE + slot * INDEX.size)
        if seq == 0:
            continue
        if seq > confirmed:
            unconfirmed += 1
            continue
        if rows + others > width:
            problems.append(f"{path}: slot {slot} counts {rows + others} flags in {width} bytes; ignored")
            continue
        cells = data[flags_at + slot * width: flags_at + slot * width + rows + others]
        if NONFINITE_BYTE not in cells:
            continue
        bad = tuple(row for row in range(rows) if cells[row] == NONFINITE_BYTE)
        flagged.append(Flagged(seq, rows, bad, NONFINITE_BYTE in cells[rows:]))
    flagged.sort(key=lambda item: item.seq)
    return FlagFileContents(path, pid, confirmed, flagged, unconfirmed, problems)
