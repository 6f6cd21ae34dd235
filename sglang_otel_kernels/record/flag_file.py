"""The NaN flags' crash-safe file, `<trace file>.nanflags` (issue 63).

With SGLANG_KERNEL_API_NAN_FLAGS=1 each recorded call's outputs are reduced
on their device to non-finite flags in a slot of a device buffer
(capture/nan_flags.py); at each step's end the slots written since the last
are copied without blocking into this file's pages, mapped shared, which
outlive the process however it dies. The layout, little-endian:

    header (64 bytes)  magic "SGLNANF1", version, slots, width, pid, the
                       confirmed order (at 24: the newest slot, by the
                       order slots are taken in, whose flags are known to
                       have landed), creation time (ns)
    index              a slot each (24 bytes): the call number, the order
                       it was taken in (from 1), two counts (for a CALL the
                       rows flagged of its first output and the other
                       outputs flagged), its kind; written by the host
                       when the slot is taken
    flags              a slot each (`width` bytes)

A slot's kind says what its flags are:

    CALL    a recorded call: one flag a row of its first output, then one
            an other output: 1 all finite, 0 non-finite; 1 where nothing
            was written
    REPLAY  a CUDA graph's replay (its call number packs the graph and the
            replay), reduced on the device by the graph itself: byte 0 is
            0 when a captured call made NaN/Inf or was fed it (its
            arguments flagged, SGLANG_KERNEL_API_NAN_FLAGS_INPUTS); bytes
            1-3 the first such call's position in the graph, bytes 4-6 the
            rows of its first output, each number in three digits of base
            255, the least first, each digit stored plus 1 (never 0, the
            non-finite byte); byte 7 its outputs' flag; bytes 8-10 plus 1
            each: its arguments flagged (0: they were not), how many of
            them are positional, 1 where the first is its self; bytes
            11-26 a flag each of those arguments (REPLAY_INPUTS); then a
            flag a row of its first output's, as many as the slot holds
    WATCH   a tensor watched outside any call (SGLang's logits): not read
            from the file
    INPUTS  a recorded call's tensor arguments, taken before it runs
            (SGLANG_KERNEL_API_NAN_FLAGS_INPUTS; its call number is its
            CALL slot's): one flag an argument, the positional ones (their
            count: the first of the two) then the keyword ones (the second:
            all of them), a list, tuple or dict of tensors one flag, a
            module the flag of its own parameters and buffers; 1 where the
            argument is no floating tensor. Its last index field is
            SELF_FIRST where the first positional one is the call's self (a
            recorded method's module)

A slot's flags land at the step's end, its index when it is taken: a slot is
trusted only when its order is at most the confirmed one, which the copy
itself writes after the flags (on the same stream), so a crash between the
two never pairs a call with an earlier call's flags. What is lost to a
crash is bounded by the calls since the last step's end.

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
from ..schema import NONFINITE, NONFINITE_FLAG, NONFINITE_INPUTS_CHECKED

MAGIC = b"SGLNANF1"
VERSION = 3
HEADER = struct.Struct("<8sIIIIQQ")  # magic, version, slots, width, pid, confirmed order, created ns
HEADER_SIZE = 64
CONFIRMED_AT = 24  # where the header keeps the confirmed order (8-aligned: a device copy writes it)
INDEX = struct.Struct("<QQHHHH")  # call number, order, two counts (rows, other outputs), kind, SELF_FIRST or 0
CALL, REPLAY, WATCH, INPUTS = 0, 1, 2, 3  # a slot's kinds
SELF_FIRST = 1
DIGIT = 255  # a REPLAY slot's numbers: REPLAY_DIGITS digits of base DIGIT, each stored plus 1
REPLAY_DIGITS = 3
REPLAY_OUTPUT = 1 + 2 * REPLAY_DIGITS  # a REPLAY slot's byte after the flag and two numbers: its call's outputs'
REPLAY_COUNTS = REPLAY_OUTPUT + 1  # then three counts plus 1: its arguments flagged, positional, self first
REPLAY_ARGUMENTS = REPLAY_COUNTS + 3  # then a flag each of up to REPLAY_INPUTS arguments
REPLAY_INPUTS = 16
REPLAY_HEAD = REPLAY_ARGUMENTS + REPLAY_INPUTS  # a REPLAY slot's bytes before its rows' flags
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

    def set_index(self, slot: int, seq: int, order: int, rows: int, others: int, kind: int, marks: int = 0,
                  _pack=INDEX.pack_into) -> None:
        _pack(self.index, slot * INDEX.size, seq, order, rows, others, kind, marks)

    def confirm(self, order: int) -> None:
        """The flags of slots taken up to `order` are in the file (a copy the host made itself)."""
        struct.pack_into("<Q", self.mapping, CONFIRMED_AT, order)


def argument_name(at: int, positional: int, self_first: bool, keywords: "list | tuple") -> str:
    """The name of an INPUTS slot's argument `at` (of which the first
    `positional` are positional, the first of them the call's self where
    `self_first`; `keywords`, the keyword ones' names), as level 5 names
    it: `input.arg1`, `input.cache`, `input.self`."""
    if at < positional:
        return "input.self" if self_first and at == 0 else f"input.arg{at - self_first}"
    return f"input.{keywords[at - positional]}"


def argument_names(flagged: "Flagged", keywords: "list | tuple") -> tuple:
    """The names of the arguments whose flags said NaN/Inf (`flagged.inputs`),
    its keyword ones by `keywords` where those name each, else
    `input.keyword<its place among them>`."""
    if len(keywords) != flagged.arguments - flagged.positional:
        keywords = [f"keyword{at}" for at in range(flagged.arguments - flagged.positional)]
    return tuple(argument_name(at, flagged.positional, flagged.self_first, keywords) for at in flagged.inputs or ())


def flagged_attributes(fed: "tuple | None", output: bool) -> dict:
    """What a call the NaN flags found first in its step is marked with, live
    (capture/nan_flags.py) or from this file (record/reader.py): `fed`, the
    names of its arguments that held NaN/Inf where they were flagged too
    (None: they were not), `output`, whether its outputs' flags said so."""
    attributes = {NONFINITE_FLAG: True, NONFINITE: (*(fed or ()), *(("output",) if output else ()))}
    if fed is not None:
        attributes[NONFINITE_INPUTS_CHECKED] = True
    return attributes


def decode_replay(cells: bytes, seq: int = 0) -> "Flagged | None":
    """A REPLAY slot's `cells` (of replay `seq`): the first captured call that
    made NaN/Inf or was fed it, with its first output's rows, the flagged
    ones among those the slot holds and, where its arguments were flagged,
    theirs; None when none did or the slot is not one."""
    if len(cells) < REPLAY_HEAD or cells[0] != NONFINITE_BYTE or 0 in cells[1:REPLAY_OUTPUT] \
            or 0 in cells[REPLAY_COUNTS:REPLAY_ARGUMENTS]:
        return None
    position, rows = (sum((digit - 1) * DIGIT ** power for power, digit in enumerate(cells[at:at + REPLAY_DIGITS]))
                      for at in (1, 1 + REPLAY_DIGITS))
    count, positional, self_first = (cells[at] - 1 for at in range(REPLAY_COUNTS, REPLAY_ARGUMENTS))
    if position < 1 or count > REPLAY_INPUTS or positional > count or self_first > 1:
        return None
    inputs = tuple(at for at in range(count) if cells[REPLAY_ARGUMENTS + at] == NONFINITE_BYTE) if count else None
    flags = cells[REPLAY_HEAD: REPLAY_HEAD + rows]
    return Flagged(seq, rows, tuple(row for row, flag in enumerate(flags) if flag == NONFINITE_BYTE), False, position,
                   inputs, positional, count, bool(self_first) and positional > 0,
                   cells[REPLAY_OUTPUT] == NONFINITE_BYTE)


@dataclasses.dataclass
class Flagged:
    """A slot whose flags say NaN/Inf: its call number, the rows of its first
    output flagged (of `rows` it had flagged per row), whether an other
    output was; for a CUDA graph's replay, the position of the captured
    call that made it (`position`, 0 for a call). Where the call's
    arguments were flagged too (an INPUTS slot; a replay's captured call's
    in its REPLAY slot): `inputs`, the positions of
    those whose flags said NaN/Inf (empty: all finite), of its `arguments`
    flagged, of which the first `positional` are positional (the first its
    self where `self_first`); `output`: whether its outputs' flags said
    so (a call fed NaN/Inf may die in it or mask it)."""

    seq: int
    rows: int
    bad_rows: tuple
    other_output: bool
    position: int = 0
    inputs: "tuple | None" = None
    positional: int = 0
    arguments: int = 0
    self_first: bool = False
    output: bool = True


@dataclasses.dataclass
class FlagFileContents:
    path: str
    pid: int
    confirmed: int  # the order of the newest slot whose flags are known to have landed
    flagged: list  # Flagged, in the order their slots were taken
    unconfirmed: int  # slots taken after `confirmed`: their flags may not have landed
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
    unconfirmed, problems = 0, []
    ordered = []
    inputs = {}  # call number -> (order, positional count, count, self first, flagged positions) of its INPUTS slot
    for slot in range(slots):
        seq, order, rows, others, kind, marks = INDEX.unpack_from(data, HEADER_SIZE + slot * INDEX.size)
        if order == 0 or kind == WATCH:
            continue
        if order > confirmed:
            unconfirmed += 1
            continue
        cells = data[flags_at + slot * width: flags_at + (slot + 1) * width]
        if kind == REPLAY:
            replay = decode_replay(cells, seq)
            if replay is not None:
                ordered.append((order, replay))
            continue
        if kind == INPUTS and rows <= others <= width:
            inputs[seq] = (order, rows, others, bool(marks & SELF_FIRST) and rows > 0,
                           tuple(at for at in range(others) if cells[at] == NONFINITE_BYTE))
            continue
        if kind != CALL or rows + others > width:
            problems.append(f"{path}: slot {slot} is of kind {kind} with counts {rows} and {others}, which do not "
                            f"fit its {width} bytes; ignored")
            continue
        cells = cells[:rows + others]
        if NONFINITE_BYTE not in cells:
            continue
        bad = tuple(row for row in range(rows) if cells[row] == NONFINITE_BYTE)
        ordered.append((order, Flagged(seq, rows, bad, NONFINITE_BYTE in cells[rows:])))
    calls = {flagged.seq: at for at, (_, flagged) in enumerate(ordered) if not flagged.position}
    for seq, (order, positional, count, self_first, bad) in inputs.items():
        at = calls.get(seq)
        if at is not None:
            flagged = ordered[at][1]
            flagged.inputs, flagged.positional, flagged.arguments, flagged.self_first = bad, positional, count, self_first
            if bad:  # fed NaN/Inf: it counts from its arguments' flags, taken before its outputs'
                ordered[at] = (order, flagged)
        elif bad:  # its outputs' flags said nothing, or never landed (it died in it, or raised)
            ordered.append((order, Flagged(seq, 0, (), False, inputs=bad, positional=positional, arguments=count,
                                           self_first=self_first, output=False)))
    ordered.sort(key=lambda item: item[0])  # the order slots were taken in: calls and replays alike
    return FlagFileContents(path, pid, confirmed, [item for _, item in ordered], unconfirmed, problems)
