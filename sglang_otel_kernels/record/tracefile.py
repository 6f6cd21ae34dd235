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
                                  u64 ring bytes written (a high-water mark,
                                  raised before a record goes past it, so a
                                  reader never scans what was never written),
                                  metadata as JSON (pid, ranks, resource, ...);
                                  its last 8 bytes: i64 heartbeat, the time
                                  (ns) the writer last said it was alive
    ring     (capacity bytes)     records at 8-byte aligned offsets

    record   u32 RECORD_MAGIC, u32 payload length, u64 sequence number,
             u32 CRC-32 of the payload, u32 encoding, payload, padding to 8
             bytes; encoding 0: a marshal tuple (END, THREAD, SYMBOL, TABLE
             or FAILURE record), 1: COMPACT_END, the end of a span whose
             attributes did not change and that has no events (span id, end
             time, status); 2 and 3: KERNEL_START / KERNEL_END, a kernel call
             of the black box of format 2 (read, no longer written); 4:
             SPAN_START, the fixed fields of a starting span then its
             attributes (and links, and its name when it has no symbol) as
             marshal data; 5: KERNEL_SPAN, a kernel call the decorator
             writes as a span: SPAN_START's fields less the scope, its call
             number and level, then (when there are any) its other
             attributes as marshal data; a collective's attributes are
             packed there under one key, PACKED_COLLECTIVE, as a tuple in
             the order of COLLECTIVE_FIELDS (None for an absent one); a
             CUDA graph's replay (FLAG_GRAPH_REPLAY) is one such record, its
             call number the graph's id and its replay number packed
             (REPLAY_SHIFT); it ends with a COMPACT_END, an ATTRIBUTED_END
             or a CALL_END record; 6: ATTRIBUTED_END, the end of a kernel
             call that added attributes (its outputs), or of a span written
             straight (record/file_spans.py) that added some after its
             start, with no events and no description: COMPACT_END's
             fields, then those attributes as marshal data, which repeat
             from call to call and so are read once

Span names, instrumentation scopes and black-box kernel names are written once
as SYMBOL records and referred to by number; thread names once as THREAD
records; the process's ranks, when they become known after the file was
created (torch.distributed initialised, SGLang's scheduler started), as an
IDENTITY record; the kernels a CUDA graph captured, in order, once its
capture ends, as a GRAPH record (bounded: a graph's first MAX_GRAPH_CALLS,
all graphs within a 16th of the ring, the oldest dropped). When the ring
wraps, a TABLE record holding all of them is written first, so every record
the ring still holds can be resolved and a replayed graph's kernels named
however long ago it was captured. A normal interpreter exit, or the file
closed on purpose, writes an EXIT record: a process that died has none. A
thread silent for a while gets a STACK record from the heartbeat thread
(record/silence.py). The table is
bounded (count and bytes, relative to the ring): a name that finds it full,
or is long, is written inline in its span's start record instead, so a
stream of distinct names (request ids in span names) costs neither memory
nor a long stall at a wrap. Thread names beyond a bound drop the oldest.

When a record does not fit before the end of the ring, writing continues at
its start, over the oldest records; a record partly overwritten, or torn by a
crash in mid-copy, fails its CRC and is skipped by the reader, which orders
what remains by sequence number (and trusts only the unbroken run of
sequence numbers ending at the newest record to tell what was in flight).
Variable payloads are `marshal` data (the fastest encoder of Python's tuples,
dicts and big integers in the standard library); the reader only decodes
payloads whose CRC matches, and validates what it decodes.

One file, one live writer: the writer holds an exclusive `flock` on its file
for as long as it writes (the kernel drops it when the process dies, however
it dies). A process that finds its path locked writes `<stem>.<pid><ext>`
instead; one that finds an unlocked trace file there (an earlier run, e.g.
a restarted container's pid 1) renames it aside first, its `.traceback` and
`.delivered` with it, so no run's evidence is overwritten. Files are created
under a temporary name, allocated in full and locked before they are linked
into place, never through a symbolic link, and a path holding anything but a
trace file is refused.
"""

from __future__ import annotations

import atexit
import errno
import fcntl
import json
import marshal
import mmap
import os
import stat
import struct
import tempfile
import threading
import time
import weakref
import zlib
from typing import Callable

from ..notices import warn
from ..schema import COLLECTIVE_FIELDS, GRAPH_ID, GRAPH_REPLAY
from . import core

MAGIC = b"SOKTRACE"
FORMAT_VERSION = 5  # 4 plus ATTRIBUTED_END records
HEADER_SIZE = 65536
# magic, version, header size, capacity, metadata length, ring bytes written
HEADER_PREFIX = struct.Struct("<8sIIQIQ")
WRITTEN_OFFSET = HEADER_PREFIX.size - 8
WRITTEN = struct.Struct("<Q")
WRITTEN_STEP = 1 << 16  # the high-water mark moves in steps: one header write per 64 KiB of records
# The heartbeat: a thread of the writing process stores the time here every
# HEARTBEAT_S, so a reader knows about when a process that died, or hangs,
# was last alive (a hung process writes no record).
ALIVE_OFFSET = HEADER_SIZE - 8
ALIVE = struct.Struct("<q")
HEARTBEAT_S = 1.0
# madvise's MADV_POPULATE_WRITE (Linux 5.14): the pages made present and writable, their bytes untouched.
_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23 if os.uname().sysname == "Linux" else None)
_AHEAD = 512 << 10  # the ring's bytes kept populated past the writer during its first lap, at least
_AHEAD_S = 0.5  # and what it writes in this long, at the rate it wrote since the last look
RECORD_MAGIC = 0x524B4F53  # b"SOKR"
RECORD_HEADER = struct.Struct("<IIQII")
_RECORD_HEADER_SIZE = RECORD_HEADER.size
ENCODING_MARSHAL = 0
ENCODING_COMPACT_END = 1
ENCODING_KERNEL_START = 2
ENCODING_KERNEL_END = 3
ENCODING_SPAN_START = 4
ENCODING_KERNEL_SPAN = 5
ENCODING_ATTRIBUTED_END = 6  # COMPACT_END, then the attributes added at the end as marshal data
COMPACT_END = struct.Struct("<QqB")  # span id, end time, status code
# Trace id (high, low), span id, parent span id (0: none), start time,
# thread, name symbol, scope symbol, kind, flags; marshal data follows.
SPAN_START = struct.Struct("<QQQQqQIIBB")
FLAG_SAMPLED = 1
FLAG_REMOTE_PARENT = 2
FLAG_LINKS = 4  # the marshal data is (attributes, links), not attributes alone
FLAG_PARENT_SAMPLED = 8  # the parent's sampled flag, for a parent-based export sampler
FLAG_INLINE_NAME = 16  # the marshal data is (name, what it would be without this flag)
FLAG_BLACKBOX = 32  # a kernel span recorded by the black box (level-1 detail, for the file only)
FLAG_COLLECTIVE = 64  # a collective or point-to-point op (its attributes say which, in which group, its number)
FLAG_GRAPH_REPLAY = 128  # a CUDA graph's replay: its call number is (graph id << REPLAY_SHIFT) | replay number
REPLAY_SHIFT = 40
CALL_SEQ_MASK = (1 << REPLAY_SHIFT) - 1
# A kernel call as a span: trace id (high, low), span id, parent span id,
# start time, thread, name symbol, kind, flags, call number, level.
KERNEL_SPAN = struct.Struct("<QQQQqQIBBQB")
# Black box: a kernel call recorded without a span. Kernel name symbol, call number,
# start time, thread, then the trace id (high, low) and span id of the span
# current around the call (zeros when none).
KERNEL_START = struct.Struct("<IQqQQQQ")
KERNEL_END = struct.Struct("<QqB")  # call number, end time, status code
ALIGN = 8
MARSHAL_VERSION = 4
# The name table: at most this many symbols, holding at most a 16th of the
# ring in total, each at most SYMBOL_MAX_LENGTH characters; thread names (cut
# to THREAD_NAME_LENGTH) for at most MAX_THREADS threads, one per KiB of ring.
MAX_SYMBOLS = 4096
SYMBOL_MAX_LENGTH = 256
MAX_THREADS = 1024
THREAD_NAME_LENGTH = 64
# A trace file takes at most this share of the free space of its filesystem.
DISK_SHARE = 2

# Record kinds, the first item of every marshal payload tuple.
END = "E"
THREAD = "T"  # (THREAD, ident, name)
SYMBOL = "Y"  # (SYMBOL, number, value): a span name, a (scope name, version) pair or a kernel name
TABLE = "Z"  # (TABLE, {number: value}, {ident: thread name}, identity, {graph id: calls}): all of them, after a wrap
FAILURE = "X"  # (FAILURE, call number, exception type, message): a black-box call of format 2 that raised
CALL_END = "F"  # (CALL_END, span id, end time, status, description, events, attributes added at the end)
ATTRIBUTES = "A"  # (ATTRIBUTES, span id, attributes added while it runs): level-5 statistics, a dump directory
MODE = "M"  # (MODE, what a sidecar exports from here on): MODE_KERNELS_ONLY once the application exports its own
MODE_KERNELS_ONLY = "kernels"
IDENTITY = "I"  # (IDENTITY, {"rank": 0, "world_size": 8, "tp_rank": 0, "job": ...}): the process's ranks, all known so far
# (EXIT, time): the interpreter exited normally (atexit ran), or the file was closed on purpose; a
# process that died has none.
EXIT = "Q"
GRAPH = "G"  # (GRAPH, graph id, calls, calls left out): a CUDA graph's captured kernels, each (name, shapes, dtypes)
STACK = "S"  # (STACK, thread ident, time, silent since, frames): where a thread silent for a while is, innermost first
MAX_STACK_FRAMES = 64  # frames a STACK record holds at most
MAX_GRAPH_CALLS = 4096

# A collective's attributes in a KERNEL_SPAN record: one tuple under one key
# instead of a dozen keys (a third of the bytes, and a reader checks them by
# position), unpacked into the `sglang.collective.*` attributes on reading.
PACKED_COLLECTIVE = "sglang.collective"


def unpack_collective(attributes: dict) -> dict:
    """`attributes` with a packed collective (PACKED_COLLECTIVE) written out
    as its `sglang.collective.*` attributes, first."""
    packed = attributes.get(PACKED_COLLECTIVE)
    if packed is None:
        return attributes
    out = {key: value for key, value in zip(COLLECTIVE_FIELDS, packed) if value is not None}
    out.update((key, value) for key, value in attributes.items() if key != PACKED_COLLECTIVE)
    return out


def replay_fields(seq: int) -> dict:
    """A CUDA graph replay's graph id and replay number, from its record's call number."""
    return {GRAPH_ID: seq >> REPLAY_SHIFT, GRAPH_REPLAY: seq & CALL_SEQ_MASK}


class PyRing:
    """The ring's write state for the Python core: the twin of the compiled
    core's `_native.Ring` (the Python writer copies records itself)."""

    __slots__ = ("offset", "sequence", "inline_end")

    def __init__(self) -> None:
        self.offset = self.sequence = 0
        self.inline_end = -1

    def attach(self, view) -> None:
        pass

    def detach(self) -> None:
        self.inline_end = -1


_Ring = core.native.Ring if core.NATIVE else PyRing
_writers: "weakref.WeakSet[TraceFileWriter]" = weakref.WeakSet()


class _PerThread(threading.local):
    """What recording keeps per thread, in one list so that a record reads a
    thread-local once (each read costs 40 ns here): [the writer that has this
    thread's name, the thread's ident, the kernel call running on it (see
    record/spans.py), how many kernel calls it has started (a batch's count
    is the difference over the batch)]. Per thread object, not per ident:
    Python reuses the ident of a thread that ended for a new one."""

    def __init__(self) -> None:
        ident = threading.get_ident()
        self.state = thread_states[ident] = [None, ident, None, 0]


NOTED, IDENT, CALL, CALLS = range(4)
# Every thread's state by ident (the newest thread of an ident), for the
# heartbeat's look at threads that went silent (record/silence.py).
thread_states: dict[int, list] = {}
per_thread = _PerThread()


def resolve_path(template: str, pid: int) -> str:
    """The path a process writes: `%i` becomes the pid."""
    if "%i" in template:
        return os.path.abspath(template.replace("%i", str(pid)))
    return os.path.abspath(template)


def _child_path(path: str, tag: str) -> str:
    stem, ext = os.path.splitext(path)
    return f"{stem}.{tag}{ext}"


def traceback_path(trace_path: str) -> str:
    """Where faulthandler writes the Python traceback of a fatal signal."""
    return trace_path + ".traceback"


def delivered_path(trace_path: str) -> str:
    """Where the export sidecar lists the spans it delivered (record/ledger.py)."""
    return trace_path + ".delivered"


def nan_flags_path(trace_path: str) -> str:
    """Where the NaN flags of its calls land (record/flag_file.py)."""
    return trace_path + ".nanflags"


# The files that belong to a trace file: they go where it goes (kept aside, pruned).
BESIDE = (traceback_path, delivered_path, nan_flags_path)


class _Refused(Exception):
    """The path cannot hold our trace file (the message says why); nothing
    there was touched."""


def _symbol_size(value) -> int:
    return len(value) if isinstance(value, str) else sum(len(part) for part in value)


class TraceFileWriter:
    """Appends records to one process's trace file; thread-safe, never raises.

    The file is created on the first record. After `fork`, the child drops the
    parent's mapping and lock (without touching the parent's file) and creates
    its own file on its first record.
    """

    def __init__(
        self,
        template: str,
        capacity: int,
        fsync: bool = False,
        metadata: dict | None = None,
        on_open: "Callable[[str], None] | None" = None,
        on_failure: "Callable[[], None] | None" = None,
        on_beat: "Callable[[TraceFileWriter, int], None] | None" = None,
    ) -> None:
        self.template = template
        self.capacity = capacity - capacity % ALIGN
        self.fsync = fsync
        self.metadata = dict(metadata or {})
        self.on_open = on_open
        self.on_failure = on_failure
        self.on_beat = on_beat  # called by the heartbeat thread with the time of each beat
        self.path: str | None = None
        self.failed = False
        self.dropped = 0
        self._lock = threading.Lock()
        self._fd: int | None = None  # open while writing: it holds the file's flock
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._ring: memoryview | None = None  # the records' part of _view
        # Where the next record goes, its sequence number, and where a record
        # may end and still be copied inline by write_record (the high-water
        # mark; -1 while there is no mapping, with fsync, or while _put
        # writes): in C when the compiled core records (record/core.py).
        self._core = _Ring()
        self._written = 0  # the high-water mark published in the header
        self.wraps = 0
        # Written once each (and again in the TABLE after each wrap); read
        # without the lock on the hot path, added to under it.
        self.symbols: dict = {}
        self.threads: dict = {}
        self._symbol_bytes = 0
        self._max_symbol_bytes = self.capacity // 16
        self.max_threads = max(16, min(MAX_THREADS, self.capacity >> 10))
        # The process's ranks as known now (identity.py): in the header of a
        # file created after they are known, else an IDENTITY record; in every TABLE.
        self.identity: dict = {}
        # CUDA graphs' captured kernels (graph id -> (calls, calls left out)), in every TABLE.
        self.graphs: dict = {}
        self._graph_bytes: dict = {}
        self._forked_from: int | None = None
        self._closed = False
        _writers.add(self)

    # -- file life cycle -------------------------------------------------

    def _open(self) -> bool:
        pid = os.getpid()
        wanted = resolve_path(self.template, pid)
        # The path asked for, then (while a live process holds it) this process's own.
        candidates = [wanted, _child_path(wanted, str(pid))] + [_child_path(wanted, f"{pid}-{n}") for n in (1, 2, 3)]
        fd = None
        try:
            # A directory asked for that is not there yet (one per job, say) is
            # made, private: without it every call of the run would go unrecorded.
            os.makedirs(os.path.dirname(wanted), mode=0o700, exist_ok=True)
            for path in candidates:
                fd = self._claim(path)
                if fd is not None:
                    break
            else:
                raise _Refused(f"{wanted} and {len(candidates) - 1} alternatives are in use by other processes")
            self._map = mmap.mmap(fd, HEADER_SIZE + self.capacity, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError, OverflowError, _Refused) as exc:
            if fd is not None:
                os.close(fd)
            self.failed = True
            warn(
                f"cannot create the trace file: {exc}; kernel calls go on without it "
                "(set SGLANG_KERNEL_API_TRACEFILE to a writable path of its own, or 'off')"
            )
            if self.on_failure is not None:
                self.on_failure()
            return False
        self._fd = fd
        self._view = memoryview(self._map)
        self._ring = self._view[HEADER_SIZE:]
        self.path = path
        self._core.offset = self._written = 0
        self._core.attach(self._ring)
        if path != wanted:
            warn(f"{wanted} is being written by another live process; this process ({pid}) writes {path}")
        threading.Thread(target=self._beat, name="sglang-otel-kernels-heartbeat", daemon=True).start()
        if _POPULATE_WRITE is not None:
            threading.Thread(target=self._populate, name="sglang-otel-kernels-populate", daemon=True).start()
        _exit_record_at_exit()
        if self.on_open is not None:
            self.on_open(path)
        return True

    def _claim(self, path: str) -> "int | None":
        """A new trace file at `path`, allocated, headed and locked, as an open
        descriptor; None when a live process writes the trace file there. An
        earlier run's file there is renamed aside first."""
        for _ in range(8):  # each turn loses a race with another process at most
            try:
                info = os.lstat(path)
            except FileNotFoundError:
                fd = self._create(path)
                if fd is not None:
                    return fd
                continue
            if not stat.S_ISREG(info.st_mode):
                kind = "a symbolic link" if stat.S_ISLNK(info.st_mode) else "not a regular file"
                raise _Refused(f"{path} is {kind}; a trace file is never written through it")
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    return None  # a live writer holds it
                if os.pread(fd, len(MAGIC), 0) != MAGIC:
                    raise _Refused(f"{path} exists and is not a trace file; it is left as it is")
                locked = os.fstat(fd)
                if _same_file(path, locked):
                    _rotate(path, locked.st_mtime)
            finally:
                os.close(fd)
        raise _Refused(f"{path} keeps changing under this process")

    def _create(self, path: str) -> "int | None":
        """Creates the file at `path` whole, or returns None if another process
        put one there first. A failure removes what it made."""
        total = HEADER_SIZE + self.capacity
        directory = os.path.dirname(path)
        disk = os.statvfs(directory)
        free = disk.f_bavail * disk.f_frsize
        if total * DISK_SHARE > free:
            raise _Refused(f"{path} would take {total >> 20} MiB of the {free >> 20} MiB free on its filesystem "
                           f"(at most 1/{DISK_SHARE} is used; set a smaller SGLANG_KERNEL_API_TRACEFILE_SIZE)")
        fd, temporary = tempfile.mkstemp(prefix=f".{os.path.basename(path)}.", suffix=".tmp", dir=directory)
        try:
            os.set_inheritable(fd, False)
            os.fchmod(fd, 0o600)  # whatever the umask
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if hasattr(os, "posix_fallocate"):
                os.posix_fallocate(fd, 0, total)
            else:
                os.ftruncate(fd, total)
            os.pwrite(fd, self._header(os.getpid()), 0)
            os.pwrite(fd, ALIVE.pack(time.time_ns()), ALIVE_OFFSET)
            linked = _link_new(temporary, path)
        except BaseException as exc:
            os.close(fd)
            _remove(temporary)
            if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EFBIG, errno.EDQUOT):
                raise _Refused(f"{path}: {exc.strerror} while allocating {total >> 20} MiB; "
                               "nothing was left on disk") from None
            raise
        _remove(temporary)
        if not linked:
            os.close(fd)
            return None
        return fd

    def _header(self, pid: int) -> bytes:
        # `created` tells this file from an earlier one of the same pid (a container's pid 1 restarted).
        metadata = dict(self.metadata, pid=pid, ppid=os.getppid(), created=time.time_ns())
        if self._forked_from is not None:
            metadata["forked_from"] = self._forked_from
        if self.identity:
            metadata["ranks"] = dict(metadata.get("ranks") or {}, **self.identity)
        body = json.dumps(metadata, default=str).encode("ascii")  # json.dumps escapes what is not ASCII
        room = ALIVE_OFFSET - HEADER_PREFIX.size
        if len(body) > room:
            body = json.dumps({"pid": pid, "metadata_truncated": True}).encode("utf-8")
        return HEADER_PREFIX.pack(MAGIC, FORMAT_VERSION, HEADER_SIZE, self.capacity, len(body), 0) + body

    def after_fork_in_child(self) -> None:
        # The mapping is shared with the parent: writing through it would
        # corrupt the parent's file. Forget it; the child opens its own. The
        # descriptor shares the parent's lock: closing this copy keeps it.
        self._core.detach()  # the parent's ring is not this process's to write
        self._core.offset = self._core.sequence = 0
        self._view = self._ring = None
        self._map = None
        if self._fd is not None:
            try:
                os.close(self._fd)
            except OSError:
                pass
            self._fd = None
        self._lock = threading.Lock()
        self._forked_from = os.getppid()
        resource = self.metadata.get("resource")
        if isinstance(resource, dict):  # the sidecar takes the resource from here: the child's own pid
            self.metadata["resource"] = dict(resource, **{"process.pid": os.getpid()})
        self.path = None
        self.identity = {}  # the child's own ranks, if it learns any
        self.graphs, self._graph_bytes = {}, {}  # and graphs
        self.symbols = {}
        self.threads = {}
        self._symbol_bytes = 0

    def close(self) -> None:
        """For good: a record that comes late (a span ending after the file
        was replaced) is dropped, never a reason to create the file again,
        which could truncate the file of the writer that replaced this one.
        Closed on purpose (the trace file turned off or replaced), the file
        ends with an EXIT record: its writer ended it, it did not die."""
        if self._view is not None and not self._closed:
            self.append((EXIT, time.time_ns()))
        with self._lock:
            self._closed = True
            self._core.detach()
            ring, view, mapped, fd = self._ring, self._view, self._map, self._fd
            self._ring = self._view = self._map = self._fd = None
        if view is not None:
            ring.release()
            view.release()
        if mapped is not None:
            try:
                mapped.close()
            except (BufferError, ValueError):
                pass
        if fd is not None:
            # Unlocked by hand: the lock belongs to the open file, which a mapping the populating thread
            # still holds (its export stops `mapped.close()`) keeps open after the descriptor is closed.
            try:
                fcntl.flock(fd, fcntl.LOCK_UN)
            except OSError:
                pass
            os.close(fd)

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
        file, written as a SYMBOL record the first time; 0 when the file
        failed, or the table has no room for it (the caller writes it inline)."""
        number = self.symbols.get(value)
        if number is None:
            size = _symbol_size(value)
            if (size > SYMBOL_MAX_LENGTH or len(self.symbols) >= MAX_SYMBOLS
                    or self._symbol_bytes + size > self._max_symbol_bytes):
                return 0
            with self._lock:
                number = self.symbols.get(value)
                if number is None and self._ready():
                    number = self.symbols[value] = len(self.symbols) + 1
                    self._symbol_bytes += size
                    self._put(ENCODING_MARSHAL, encode((SYMBOL, number, value)))
        return number or 0

    def note_thread(self, state: list) -> None:
        """Writes the calling thread's name, once per thread (callers check
        `state[NOTED] is not writer` first, `state` this thread's
        `per_thread.state`), keeping the newest `max_threads`."""
        name = threading.current_thread().name[:THREAD_NAME_LENGTH]
        ident = state[IDENT]
        with self._lock:
            if self._ready():
                state[NOTED] = self
                if self.threads.get(ident) != name:
                    self.threads.pop(ident, None)
                    if len(self.threads) >= self.max_threads:
                        del self.threads[next(iter(self.threads))]
                    self.threads[ident] = name
                    self._put(ENCODING_MARSHAL, encode((THREAD, ident, name)))

    def set_identity(self, identity: dict) -> None:
        """The process's ranks, all known so far: in the header if the file
        is created after this, else in an IDENTITY record now."""
        with self._lock:
            if identity == self.identity:
                return
            self.identity = dict(identity)
            if self._view is not None:
                self._put(ENCODING_MARSHAL, encode((IDENTITY, self.identity)))

    def add_graph(self, graph_id: int, calls: tuple, left_out: int) -> None:
        """The kernels a CUDA graph captured (each a (name, input shapes,
        input dtypes) tuple, names as symbols where the table has room): a
        GRAPH record now, and in every TABLE after it while the graphs' part
        of the table, a 16th of the ring, has room (the oldest graphs go; a
        graph too big for it alone is in its GRAPH record only)."""
        payload = encode((GRAPH, graph_id, calls, left_out))
        with self._lock:
            self.graphs[graph_id] = (calls, left_out)
            self._graph_bytes[graph_id] = len(payload)
            while self.graphs and sum(self._graph_bytes.values()) > self.capacity // 16:
                oldest = next(iter(self.graphs))
                del self.graphs[oldest], self._graph_bytes[oldest]
            if self._ready():
                self._put(ENCODING_MARSHAL, payload)

    def _beat(self) -> None:
        """The heartbeat thread: the time into the header every HEARTBEAT_S
        while the file is open (one 8-byte store; it ends with the file),
        then `on_beat`."""
        while True:
            with self._lock:
                if self._view is None:
                    return
                now = time.time_ns()
                ALIVE.pack_into(self._view, ALIVE_OFFSET, now)
            if self.on_beat is not None:
                try:
                    self.on_beat(self, now)
                except Exception as exc:  # the heartbeat goes on whatever its watcher meets
                    self.on_beat = None
                    warn(f"the heartbeat's look at silent threads stopped ({type(exc).__name__}: {exc})")
            time.sleep(HEARTBEAT_S)

    def _populate(self) -> None:
        """The populating thread: the ring's pages made present and writable
        ahead of the writer during its first lap, off the calls' thread:
        each page the first lap reaches would otherwise cost the call that
        first writes to it a page fault (one in 30 level-1 calls, one in 8
        at level 3; about 10 us each on an allocated but unwritten ext4 file
        here, a round trip on a network filesystem). It keeps `_AHEAD`, or
        what the writer writes in `_AHEAD_S` at its rate, populated past the
        writer, so a process that records little dirties little more than
        it wrote, and it ends once the first lap is over. Through libc with
        the GIL let go (mmap.madvise holds it), a buffer export keeping the
        mapping in place while madvise runs (`close` then leaves unmapping
        to the collector). Where the kernel refuses (older than 5.14,
        another system), the first lap faults as before."""
        try:
            import ctypes

            madvise = ctypes.CDLL(None, use_errno=True).madvise
            madvise.argtypes, madvise.restype = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int), ctypes.c_int
        except (OSError, AttributeError, ImportError):
            return
        total, done, before, looked = HEADER_SIZE + self.capacity, 0, None, 0.0
        while done < total:
            with self._lock:
                if self._map is None:
                    return
                written = HEADER_SIZE + self._core.offset
                anchor = ctypes.c_char.from_buffer(self._map)
            now = time.monotonic()
            try:
                if before is not None and written < before:
                    return  # it lapped: the writer has been everywhere
                # Bytes a second since the last look (none known at the first).
                rate = None if before is None else (written - before) / max(now - looked, 1e-3)
                ahead = written + max(_AHEAD, int((rate or 0.0) * _AHEAD_S))
                target = min(total, ahead + -ahead % mmap.PAGESIZE)  # where the next madvise starts: a page's start
                if target > done and madvise(ctypes.addressof(anchor) + done, target - done, _POPULATE_WRITE):
                    return
            finally:
                del anchor
            done, before, looked = max(done, target), written, now
            # Back before the writer is halfway through what is populated ahead of it (an idle one, seldom;
            # soon after the first look, to learn its rate).
            time.sleep(0.005 if rate is None else min(max((done - written) / max(rate, 1.0) / 2, 0.005), 0.5))

    def _write_python(self, encoding: int, payload: bytes, _crc=zlib.crc32, _pack_into=RECORD_HEADER.pack_into,
                      _magic=RECORD_MAGIC, _framed=_RECORD_HEADER_SIZE + ALIGN - 1) -> None:
        """Frames and copies one encoded record into the ring (thread-safe).
        It runs twice per kernel call: the defaults bind what it needs as
        locals, and a record that fits before the ring's end, below the
        published high-water mark, is copied inline. The lock is taken by a
        `with` block, not by hand: an exception raised by a signal handler
        (KeyboardInterrupt) right after a hand-taken `acquire()` returns, before
        its `try`, would leave the lock held, and every later record, this
        thread's or another's, would wait for it forever."""
        length = len(payload)
        crc = _crc(payload)
        with self._lock:
            state = self._core
            offset = state.offset
            end = offset + ((_framed + length) & -ALIGN)
            if end > state.inline_end:
                if self._ready():
                    self._put(encoding, payload)
                return
            # The state changes last, after the copy (see _put).
            sequence = state.sequence + 1
            ring = self._ring
            _pack_into(ring, offset, _magic, length, sequence, crc, encoding)
            start = offset + _RECORD_HEADER_SIZE
            ring[start : start + length] = payload
            state.sequence = sequence
            state.offset = end

    def _write_compiled(self, encoding: int, payload: bytes) -> None:
        """write_record of the compiled core: the ring copies a record that
        fits inline in C (holding the GIL, so whole), without the lock."""
        if not self._core.write(encoding, payload):
            with self._lock:
                if not self._core.write(encoding, payload) and self._ready():
                    self._put(encoding, payload)

    # Frames and copies one encoded record into the ring (thread-safe).
    write_record = _write_compiled if core.NATIVE else _write_python

    def _ready(self) -> bool:
        # With the lock held: the file is created on the first record.
        return self._view is not None or (not self.failed and not self._closed and self._open())

    def _put(self, encoding: int, payload: bytes) -> None:
        # With the lock held. No record is copied inline meanwhile: computing
        # a large record's CRC lets other threads run, and the compiled core
        # copies without the lock.
        state = self._core
        state.inline_end = -1
        try:
            self._put_locked(state, encoding, payload)
        finally:
            state.inline_end = self._written if self._written and self._view is not None and not self.fsync else -1

    def _put_locked(self, state, encoding: int, payload: bytes) -> None:
        # Everything that calls a function comes before the ring's state
        # changes, and those are plain assignments and copies, where CPython
        # raises no exception a signal handler sends: so an interrupted record
        # (KeyboardInterrupt) leaves the state as it was, never a lap begun
        # without its names nor a gap in the sequence.
        length = len(payload)
        size = RECORD_HEADER.size + length
        padded = (size + ALIGN - 1) & -ALIGN
        if padded > self.capacity:
            self.dropped += 1
            return
        offset = state.offset
        sequence = state.sequence + 1
        lap = offset + padded > self.capacity
        table = b""
        if lap:
            # The names the ring still refers to, before anything else in the new lap.
            body = encode((TABLE, {n: v for v, n in self.symbols.items()}, dict(self.threads), self.identity,
                           dict(self.graphs)))
            table = _frame(ENCODING_MARSHAL, body, sequence)
            table_size = len(table)
            offset = (table_size + ALIGN - 1) & -ALIGN
            if offset + padded > self.capacity:
                # No room for both: the record alone, where it would overwrite
                # the table and leave a gap in the sequence.
                table, offset = b"", 0
            else:
                sequence += 1
        record = _frame(encoding, payload, sequence)
        end = offset + padded
        if end > self._written:
            # Raised before the record lands, so the header always covers it.
            written = min(self.capacity, (end + WRITTEN_STEP - 1) // WRITTEN_STEP * WRITTEN_STEP)
            WRITTEN.pack_into(self._view, WRITTEN_OFFSET, written)
            self._written = written
        ring = self._ring
        if lap:
            self.wraps += 1
        if table:
            ring[0:table_size] = table
        ring[offset : offset + size] = record
        state.sequence = sequence
        state.offset = end
        if self.fsync:
            start = HEADER_SIZE + offset
            page = start - start % mmap.PAGESIZE
            self._map.flush(page, start + size - page)
            if table:
                self._map.flush(HEADER_SIZE, table_size)  # the ring starts on a page


def _frame(encoding: int, payload: bytes, sequence: int, _crc=zlib.crc32, _pack=RECORD_HEADER.pack) -> bytes:
    """A record as it lands in the ring: its header, then its payload."""
    return _pack(RECORD_MAGIC, len(payload), sequence, _crc(payload), encoding) + payload


def _same_file(path: str, info: os.stat_result) -> bool:
    """Whether `path` still names the file `info` describes (another process
    may have renamed it aside and created a new one meanwhile)."""
    try:
        now = os.lstat(path)
    except FileNotFoundError:
        return False
    return (now.st_dev, now.st_ino) == (info.st_dev, info.st_ino)


def _link_new(source: str, path: str) -> bool:
    """Gives the file at `source` the name `path` unless something has that
    name already (False then): a hard link, which never replaces."""
    try:
        os.link(source, path, follow_symlinks=False)
        return True
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOSYS, errno.EMLINK):
            raise
    # A filesystem without hard links: check, then rename (a narrow race).
    if os.path.lexists(path):
        return False
    os.rename(source, path)
    return True


def _remove(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _rotate(path: str, mtime: float) -> None:
    """Renames an earlier run's trace file (and its traceback) aside, to
    `<stem>.prev-<its last write time><ext>`, never over another file."""
    stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(mtime))
    for n in range(1000):
        aside = _child_path(path, f"prev-{stamp}" + (f"-{n}" if n else ""))
        if _link_new(path, aside):
            break
    else:
        raise _Refused(f"{path}: an earlier run's file is there and no free name was found to keep it")
    if os.path.exists(path):  # a hard link: drop the old name (a rename already did)
        os.unlink(path)
    for beside in BESIDE:  # what belongs to it goes with it
        old = beside(path)
        if os.path.isfile(old) and not os.path.islink(old):
            if _link_new(old, beside(aside)):
                _remove(old)
    warn(f"a trace file that no live process writes (an earlier run's) was at {path}; it is kept as {aside}")


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


_exit_hook: list = []


def _exit_record_at_exit() -> None:
    """Once per process: an EXIT record into each open file when the
    interpreter exits normally, so a reader tells an exit from a death."""
    if not _exit_hook:
        _exit_hook.append(atexit.register(_write_exit_records))


def _write_exit_records() -> None:
    now = time.time_ns()
    for writer in list(_writers):
        if writer._view is not None:
            writer.append((EXIT, now))


def _after_fork_in_child() -> None:
    # The forking thread, now the child's only one, names itself in the child's file.
    state = per_thread.state
    state[NOTED], state[IDENT] = None, threading.get_ident()
    thread_states.clear()
    thread_states[state[IDENT]] = state
    for writer in list(_writers):
        writer.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
