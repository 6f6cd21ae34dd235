"""The crash-safe trace file: a fixed-size ring of records in a shared memory map.

A record copied into a MAP_SHARED mapping of a regular file is in the page
cache the moment the copy ends, so it reaches the file whatever kills the
process afterwards (SIGKILL, a segfault, abort, os._exit) with no system call
and no fsync; only a kernel crash or power loss can lose it (`fsync=True`
adds an msync per record for that, at a large cost). The file is allocated in
full when created, so a full disk shows then, as one warning, and never as a
SIGBUS on a later write.

Layout (all integers little-endian):

    header   (HEADER_SIZE bytes)  b"SOKTRACE", u32 format version, u32 header
                                  size, u64 ring capacity, u32 metadata length,
                                  metadata as JSON (pid, ranks, resource, ...)
    ring     (capacity bytes)     records at 8-byte aligned offsets

    record   u32 RECORD_MAGIC, u32 payload length, u64 sequence number,
             u32 CRC-32 of the payload, u32 encoding, payload, padding to 8
             bytes; encoding 0: a marshal tuple (END, THREAD, SYMBOL, TABLE
             or FAILURE record), 1: COMPACT_END, the end of a span whose
             attributes did not change and that has no events (span id, end
             time, status); 2 and 3: KERNEL_START / KERNEL_END, a kernel call
             of the black box, recorded without a span; 4: SPAN_START, the
             fixed fields of a starting span then its attributes (and links)
             as marshal data

Span names, instrumentation scopes and black-box kernel names are written once
as SYMBOL records and referred to by number; thread names once as THREAD
records. When the ring wraps, a TABLE record holding all of them is written
first, so every record the ring still holds can be resolved.

When a record does not fit before the end of the ring, writing continues at
its start, over the oldest records; a record partly overwritten, or torn by a
crash in mid-copy, fails its CRC and is skipped by the reader, which orders
what remains by sequence number. Variable payloads are `marshal` data (the
fastest encoder of Python's tuples, dicts and big integers in the standard
library); the reader only decodes payloads whose CRC matches.
"""

from __future__ import annotations

import json
import marshal
import mmap
import os
import struct
import threading
import weakref
import zlib
from typing import Callable

from ..notices import warn

MAGIC = b"SOKTRACE"
FORMAT_VERSION = 2
HEADER_SIZE = 65536
HEADER_PREFIX = struct.Struct("<8sIIQI")
RECORD_MAGIC = 0x524B4F53  # b"SOKR"
RECORD_HEADER = struct.Struct("<IIQII")
ENCODING_MARSHAL = 0
ENCODING_COMPACT_END = 1
ENCODING_KERNEL_START = 2
ENCODING_KERNEL_END = 3
ENCODING_SPAN_START = 4
COMPACT_END = struct.Struct("<QqB")  # span id, end time, status code
# Trace id (high, low), span id, parent span id (0: none), start time,
# thread, name symbol, scope symbol, kind, flags; marshal data follows.
SPAN_START = struct.Struct("<QQQQqQIIBB")
FLAG_SAMPLED = 1
FLAG_REMOTE_PARENT = 2
FLAG_LINKS = 4  # the marshal data is (attributes, links), not attributes alone
FLAG_PARENT_SAMPLED = 8  # the parent's sampled flag, for a parent-based export sampler
# Black box: a kernel call recorded without a span. Kernel name symbol, call number,
# start time, thread, then the trace id (high, low) and span id of the span
# current around the call (zeros when none).
KERNEL_START = struct.Struct("<IQqQQQQ")
KERNEL_END = struct.Struct("<QqB")  # call number, end time, status code
ALIGN = 8
MARSHAL_VERSION = 4

# Record kinds, the first item of every marshal payload tuple.
END = "E"
THREAD = "T"  # (THREAD, ident, name)
SYMBOL = "Y"  # (SYMBOL, number, value): a span name, a (scope name, version) pair or a kernel name
TABLE = "Z"  # (TABLE, {number: value}, {ident: thread name}): all symbols and threads, after a wrap
FAILURE = "X"  # (FAILURE, call number, exception type, message): a black-box call that raised

_writers: "weakref.WeakSet[TraceFileWriter]" = weakref.WeakSet()


def resolve_path(template: str, pid: int) -> str:
    """`%i` becomes the pid; a forked child whose template has no `%i` gets
    `.<pid>` before the extension, so it never writes into its parent's file."""
    if "%i" in template:
        return os.path.abspath(template.replace("%i", str(pid)))
    return os.path.abspath(template)


def _child_path(path: str, pid: int) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}.{pid}{ext}"


class TraceFileWriter:
    """Appends records to one process's trace file; thread-safe, never raises.

    The file is created on the first record. After `fork`, the child drops the
    parent's mapping (without touching the parent's file) and creates its own
    file on its first record.
    """

    def __init__(
        self,
        template: str,
        capacity: int,
        fsync: bool = False,
        metadata: dict | None = None,
        on_open: "Callable[[str], None] | None" = None,
        on_failure: "Callable[[], None] | None" = None,
    ) -> None:
        self.template = template
        self.capacity = capacity - capacity % ALIGN
        self.fsync = fsync
        self.metadata = dict(metadata or {})
        self.on_open = on_open
        self.on_failure = on_failure
        self.path: str | None = None
        self.failed = False
        self.dropped = 0
        self._lock = threading.Lock()
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._offset = 0
        self._sequence = 0
        self.wraps = 0
        # Written once each (and again in the TABLE after each wrap); read
        # without the lock on the hot path, added to under it.
        self.symbols: dict = {}
        self.threads: dict = {}
        self._forked_from: int | None = None
        self._closed = False
        _writers.add(self)

    # -- file life cycle -------------------------------------------------

    def _open(self) -> bool:
        pid = os.getpid()
        path = resolve_path(self.template, pid)
        if self._forked_from is not None and "%i" not in self.template:
            path = _child_path(path, pid)
        header = self._header(pid)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | getattr(os, "O_CLOEXEC", 0), 0o600)
            try:
                os.fchmod(fd, 0o600)  # whatever the umask, and for a file that existed
                total = HEADER_SIZE + self.capacity
                if hasattr(os, "posix_fallocate"):
                    os.posix_fallocate(fd, 0, total)
                else:
                    os.ftruncate(fd, total)
                os.pwrite(fd, header, 0)
                self._map = mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            finally:
                os.close(fd)
        except (OSError, ValueError) as exc:
            self.failed = True
            warn(
                f"cannot create the trace file {path!r} ({exc}); kernel calls go on without it "
                "(set SGLANG_KERNEL_API_TRACEFILE to a writable path, or 'off')"
            )
            if self.on_failure is not None:
                self.on_failure()
            return False
        self._view = memoryview(self._map)
        self.path = path
        self._offset = 0
        if self.on_open is not None:
            self.on_open(path)
        return True

    def _header(self, pid: int) -> bytes:
        metadata = dict(self.metadata, pid=pid, ppid=os.getppid())
        if self._forked_from is not None:
            metadata["forked_from"] = self._forked_from
        body = json.dumps(metadata, default=str).encode("utf-8")
        room = HEADER_SIZE - HEADER_PREFIX.size
        if len(body) > room:
            body = json.dumps({"pid": pid, "metadata_truncated": True}).encode("utf-8")
        return HEADER_PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.capacity, len(body)) + body

    def after_fork_in_child(self) -> None:
        # The mapping is shared with the parent: writing through it would
        # corrupt the parent's file. Forget it; the child opens its own.
        self._view = None
        self._map = None
        self._lock = threading.Lock()
        self._forked_from = os.getppid()
        self.path = None
        self._sequence = 0
        self.symbols = {}
        self.threads = {}

    def close(self) -> None:
        """For good: a record that comes late (a span ending after the file
        was replaced) is dropped, never a reason to create the file again,
        which could truncate the file of the writer that replaced this one."""
        with self._lock:
            self._closed = True
            view, mapped = self._view, self._map
            self._view = self._map = None
        if view is not None:
            view.release()
        if mapped is not None:
            try:
                mapped.close()
            except (BufferError, ValueError):
                pass

    # -- writing ---------------------------------------------------------

    def append(self, record: tuple) -> None:
        """Writes one marshal record tuple (thread-safe, never raises)."""
        if not self.failed:
            self.write_record(ENCODING_MARSHAL, encode(record))

    def append_end(self, span_id: int, end_time: int, status: int) -> None:
        """The end of a span that added nothing but its end time and status."""
        if not self.failed:
            self.write_record(ENCODING_COMPACT_END, COMPACT_END.pack(span_id, end_time, status))

    def symbol(self, value) -> int:
        """The number standing for `value` (a str or a tuple of str) in this
        file, written as a SYMBOL record the first time; 0 if the file failed."""
        number = self.symbols.get(value)
        if number is None:
            with self._lock:
                number = self.symbols.get(value)
                if number is None and self._ready():
                    number = self.symbols[value] = len(self.symbols) + 1
                    self._put(ENCODING_MARSHAL, encode((SYMBOL, number, value)))
        return number or 0

    def note_thread(self, ident: int) -> None:
        """Writes the calling thread's name, once."""
        if ident not in self.threads:
            name = threading.current_thread().name
            with self._lock:
                if ident not in self.threads and self._ready():
                    self.threads[ident] = name
                    self._put(ENCODING_MARSHAL, encode((THREAD, ident, name)))

    def write_record(self, encoding: int, payload: bytes, _crc=zlib.crc32, _pack=RECORD_HEADER.pack) -> None:
        """Frames and copies one encoded record into the ring (thread-safe).
        It runs twice per kernel call: the defaults bind what it needs as
        locals, and a record that fits before the ring's end is copied inline."""
        length = len(payload)
        crc = _crc(payload)
        lock = self._lock
        lock.acquire()
        try:
            offset = self._offset
            end = offset + ((RECORD_HEADER.size + length + ALIGN - 1) & -ALIGN)
            view = self._view
            if view is None or end > self.capacity or self.fsync:
                if self._ready():
                    self._put(encoding, payload)
                return
            sequence = self._sequence = self._sequence + 1
            start = HEADER_SIZE + offset
            view[start : start + RECORD_HEADER.size + length] = _pack(RECORD_MAGIC, length, sequence, crc, encoding) + payload
            self._offset = end
        finally:
            lock.release()

    def _ready(self) -> bool:
        # With the lock held: the file is created on the first record.
        return self._view is not None or (not self.failed and not self._closed and self._open())

    def _put(self, encoding: int, payload: bytes, _crc=zlib.crc32, _pack=RECORD_HEADER.pack) -> None:
        # With the lock held. The defaults bind what it needs as locals: it
        # runs twice per kernel call.
        length = len(payload)
        size = RECORD_HEADER.size + length
        padded = (size + ALIGN - 1) & -ALIGN
        if padded > self.capacity:
            self.dropped += 1
            return
        offset = self._offset
        if offset + padded > self.capacity:
            self._offset = 0
            self.wraps += 1
            # The names the ring still refers to, before anything else in the new lap.
            self._put(ENCODING_MARSHAL, encode((TABLE, {n: v for v, n in self.symbols.items()}, dict(self.threads))))
            offset = self._offset if self._offset + padded <= self.capacity else 0
        sequence = self._sequence = self._sequence + 1
        start = HEADER_SIZE + offset
        self._view[start : start + size] = _pack(RECORD_MAGIC, length, sequence, _crc(payload), encoding) + payload
        self._offset = offset + padded
        if self.fsync:
            page = start - start % mmap.PAGESIZE
            self._map.flush(page, start + size - page)


def encode(record, _dumps=marshal.dumps) -> bytes:
    """marshal data of `record`; what marshal refuses is written as its repr."""
    try:
        return _dumps(record, MARSHAL_VERSION)
    except ValueError:
        return _marshal_with_reprs(record)


def _marshal_with_reprs(value):
    """Encodes what marshal refuses (an exotic attribute value) as its repr."""

    def clean(item):
        if isinstance(item, (str, int, float, bool, bytes, type(None))):
            return item
        if isinstance(item, (tuple, list)):
            return tuple(clean(x) for x in item)
        if isinstance(item, dict):
            return {str(k): clean(v) for k, v in item.items()}
        return repr(item)

    return marshal.dumps(clean(value), MARSHAL_VERSION)


def _after_fork_in_child() -> None:
    for writer in list(_writers):
        writer.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
