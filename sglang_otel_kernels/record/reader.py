"""Reads a trace file back: the spans that ended, and those still in flight
when the process died, in the order they started.

Every file is hostile input. Only a regular file is opened (a FIFO would
block), only the part of the ring the header says was written is scanned,
and what a record decodes to is validated and cleaned (attribute keys are
strings, values OTLP can carry, ids and times in range, text valid UTF-8)
before anything uses it. A missing, empty, foreign or truncated header raises
`TraceFileError` with what is wrong; torn or overwritten records are skipped
and counted, and a start whose end may have been overwritten (it lies before
a break in the sequence numbers) is never taken for a call in flight.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import fcntl
import gc
import json
import marshal
import mmap
import operator
import os
import re
import struct
import zlib
from typing import Any, Iterable

from .. import files
from .._version import __version__
from . import tracefile as fmt
from .flag_file import argument_names, flagged_attributes, read_flag_file
from ..schema import (BATCH_REQUEST_IDS, BLACKBOX, COLLECTIVE_FIELDS, DEATH_SPAN, FATAL_SIGNAL, GRAPH_CALLS,
                      GRAPH_CAPTURED, GRAPH_FIRST_NONFINITE, GRAPH_ID, GRAPH_POSITION, GRAPH_REPLAY, IN_FLIGHT,
                      INPUT_PREFIX, LEVEL, NAME, NONFINITE_FLAG, NONFINITE_REQUESTS, SEQ, TRACER_NAME)
from ..text import utf8

IN_FLIGHT_DESCRIPTION = "the process ended during this call (no end record)"
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
_RECORD_MAGIC_BYTES = struct.pack("<I", fmt.RECORD_MAGIC)
COMPACT_END_RECORD = "e"
_KERNEL_START = "ks"
_KERNEL_END = "ke"
SPAN_START_RECORD = "s"
_START_ATTRIBUTES = 9  # where a SPAN_START_RECORD tuple holds its attributes (see _span)
# Not in any file: the reader's mark of a break in the sequence numbers (the
# ring overwrote, or a follower was lapped by, the records in between).
GAP = ("gap",)
# A record whose checksum holds but whose content does not (a crafted file,
# or a record kind of a newer writer): ignored, but no break in the sequence.
MALFORMED = ("malformed",)
# Black-box calls have no span id of their own: theirs is made from the call
# number, with a high tag no random id of the SDK is likely to share.
_BLACKBOX_SPAN_TAG = 0xB1AC << 48
_END_FIELDS = 8
_MAX_UNSURE = 1 << 16
# The scope of the kernel spans the decorator writes.
KERNEL_SCOPE = (TRACER_NAME, __version__)
_KERNEL_SCOPE = -1


class TraceFileError(Exception):
    """The file cannot be read as a trace file; the message says why."""


@dataclasses.dataclass(slots=True)
class RecoveredSpan:
    name: str
    trace_id: int
    span_id: int
    parent_span_id: int  # 0 for a root span
    parent_is_remote: bool
    kind: int  # opentelemetry.trace.SpanKind value
    start_time: int  # ns since the epoch
    end_time: int | None  # None while in flight
    status_code: str  # "UNSET", "OK" or "ERROR"
    status_description: str
    attributes: dict[str, Any]
    events: list[tuple[str, int, dict[str, Any]]]
    links: list[tuple[int, int, dict[str, Any]]]
    thread_id: int
    thread_name: str | None
    scope_name: str
    scope_version: str
    trace_flags: int
    in_flight: bool
    parent_sampled: bool = True  # the parent's sampled flag (for parent-based export sampling)


@dataclasses.dataclass
class TraceFileContents:
    path: str
    metadata: dict[str, Any]
    spans: list[RecoveredSpan]
    records: int  # valid records read
    skipped: int  # records torn by a crash or partly overwritten
    problems: list[str]  # what was wrong with the file, if anything
    last_time: int  # the newest timestamp in the file (about when it was last written)
    live: bool = False  # its writer still runs (it holds the file's lock): calls in flight are running now
    heartbeat: int = 0  # when the writer last said it was alive (ns; 0: unknown), also while it hangs
    exited: bool = False  # the interpreter exited normally (an EXIT record): not killed, not crashed
    died: int = 0  # when the writer died of a fatal signal, from its traceback file (ns; 0: unknown)
    # How a writer that died ended: the fatal signal it recorded ("SIGSEGV"), "" when it recorded none
    # (killed from outside: SIGKILL, a watchdog, the OOM killer; or the machine went down); None: not known.
    fatal_signal: str | None = None
    format_version: int | None = None  # a trace file's format (None: OTLP JSON, Jaeger)
    # Where its threads were once silent for a while: ident -> (when written, silent since, frames innermost first)
    stacks: dict = dataclasses.field(default_factory=dict)
    # CUDA graphs the file names: id -> (their captured calls, each (name, input shapes, input dtypes), calls left out)
    graphs: dict = dataclasses.field(default_factory=dict)

    @property
    def last_alive(self) -> int:
        """The last sign of life of the writer: its heartbeat, newest record or death (ns)."""
        return max(self.heartbeat, self.last_time, self.died)


def read_trace(path: str | os.PathLike) -> list[RecoveredSpan]:
    """The spans in the trace file at `path`, ended and in flight, in start order."""
    return read_trace_file(path).spans


def read_trace_file(path: str | os.PathLike) -> TraceFileContents:
    path = os.fspath(path)
    with map_trace_file(path) as data, _collector_paused():
        contents = _parse(path, data)
    merge_nan_flags(contents)
    contents.live = writer_alive(path)
    if not contents.live and not contents.exited:
        note_death(contents)
    return contents


def merge_nan_flags(contents: TraceFileContents) -> None:
    """The NaN flags a process left beside its trace file (record/flag_file.py)
    on the calls and CUDA graph replays they name: the first flagged one
    under each parent (a step's batch) is marked `nonfinite_flag`, as the
    live reading marks it (a replay with its first flagged captured call,
    named from the graph's call list), with the requests of its flagged rows
    where they are its batch's requests one a row, and where its arguments
    were flagged too, those that held NaN/Inf. What a crash kept of the
    flags, read from the file alone; a file of another process is a
    problem, never read."""
    found = read_flag_file(fmt.nan_flags_path(contents.path))
    if found is None:
        return
    contents.problems.extend(found.problems)
    pid = contents.metadata.get("pid")
    if found.flagged and isinstance(pid, int) and found.pid != pid:
        contents.problems.append(f"{found.path}: written by pid {found.pid}, not by this file's {pid}; not read")
        return
    if found.unconfirmed and not contents.exited:
        contents.problems.append(f"the NaN flags of the last {found.unconfirmed} call(s) and CUDA graph replay(s) had "
                                 "not landed when the process ended (those since its last step's end)")
    if not found.flagged:
        return
    calls, replays, captured = {}, {}, {}
    for span in contents.spans:
        if GRAPH_REPLAY in span.attributes:
            replays[(span.attributes.get(GRAPH_ID), span.attributes[GRAPH_REPLAY])] = span
        elif NAME in span.attributes:
            calls[span.attributes.get(SEQ)] = span
            if GRAPH_POSITION in span.attributes:  # made while a graph was captured: its keywords name its replays'
                captured[(span.attributes.get(GRAPH_ID), span.attributes[GRAPH_POSITION])] = span
    marked = {span.parent_span_id for span in (*calls.values(), *replays.values())
              if span.attributes.get(NONFINITE_FLAG) is True}
    by_id = {span.span_id: span for span in contents.spans}
    for flagged in found.flagged:
        if flagged.position:
            fields = fmt.replay_fields(flagged.seq)
            span = replays.get((fields[GRAPH_ID], fields[GRAPH_REPLAY]))
        else:
            span = calls.get(flagged.seq)
        if span is None or span.parent_span_id in marked:
            continue
        marked.add(span.parent_span_id)
        named = captured.get((span.attributes.get(GRAPH_ID), flagged.position), span) if flagged.position else span
        fed = None if flagged.inputs is None else _argument_names(named, flagged)
        span.attributes.update(flagged_attributes(fed, flagged.output))
        if flagged.position:
            span.attributes[GRAPH_FIRST_NONFINITE] = f"{flagged.position}: " + _captured_name(
                contents.graphs.get(span.attributes.get(GRAPH_ID)), flagged.position)
        batch = by_id.get(span.parent_span_id)
        ids = span.attributes.get(BATCH_REQUEST_IDS) or (batch.attributes.get(BATCH_REQUEST_IDS) if batch else None)
        if isinstance(ids, (tuple, list)) and flagged.bad_rows and flagged.rows == len(ids):
            span.attributes[NONFINITE_REQUESTS] = tuple(str(ids[row]) for row in flagged.bad_rows)


def _argument_names(span: RecoveredSpan, flagged: Any) -> tuple:
    """The names of the arguments whose flags said NaN/Inf (`flagged`, a
    flag_file.Flagged), as level 5 names them: `input.arg1`; a keyword one
    by its name where the call's span (a replay's: its captured call's, made
    at capture) lists every keyword of the call (from level 3), else
    `input.keyword<its place among them>`; `input.self`."""
    names = (key[len(INPUT_PREFIX):].partition(".")[0] for key in span.attributes if key.startswith(INPUT_PREFIX))
    return argument_names(flagged, [name for name in dict.fromkeys(names) if not re.fullmatch(r"arg\d+", name)])


def _captured_name(graph: Any, position: int) -> str:
    """The name of a graph's captured call at `position` (its GRAPH record's, validated when read), or "?"."""
    calls = graph[0] if isinstance(graph, tuple) and graph else ()
    name = calls[position - 1][0] if 0 < position <= len(calls) else None
    return name if isinstance(name, str) else "?"


def note_death(contents: TraceFileContents) -> None:
    """For a file whose writer neither runs nor exited: when and how it died (`death`)."""
    contents.died, contents.fatal_signal = death(contents.path, contents.last_alive, contents.spans)


def death(path: str, alive: int, spans: Iterable[RecoveredSpan]) -> tuple[int, str]:
    """(when, of which fatal signal) the writer of the file at `path`, last
    alive at `alive`, died, from faulthandler's traceback beside it: (0, "")
    when it recorded none. Said on each of `spans` in flight too
    (FATAL_SIGNAL), for what is exported of them."""
    spans = list(spans)
    died = death_time(path, alive, {span.thread_id for span in spans})
    signal = fatal_signal(path) if died else ""
    for span in spans:
        if span.in_flight:
            span.attributes[FATAL_SIGNAL] = signal or "none"
    return died, signal


# faulthandler's words for the fatal signals it catches.
_FATAL_WORDS = {"Segmentation fault": "SIGSEGV", "Aborted": "SIGABRT", "Bus error": "SIGBUS",
                "Floating-point exception": "SIGFPE", "Floating point exception": "SIGFPE",
                "Illegal instruction": "SIGILL"}


def innermost_call(calls: "Iterable[RecoveredSpan]") -> "RecoveredSpan | None":
    """The call a process is in: of the kernel calls in flight, the one that
    started last (an outer call waits for it)."""
    return max(calls, key=lambda span: span.start_time, default=None)


def where_written(pid: Any, path: "str | None") -> str:
    """`pid 4242, trace_4242.sgltrace`: a process and its file. A process
    read from Jaeger (`jaeger:SERVICE/HOST/PID`) has no file: its host instead."""
    if path and path.startswith("jaeger:") and path.count("/") >= 2:
        return f"pid {pid} on {path.rsplit('/', 2)[-2]}"
    return f"pid {pid}, {os.path.basename(path or '?')}"


def said_ending(spans: list[RecoveredSpan]) -> str | None:
    """How the process of exported spans ended, as its sidecar wrote on the
    calls it left in flight, or on its death span (FATAL_SIGNAL; see
    `fatal_signal`); None: not said."""
    for span in spans:
        said = span.attributes.get(FATAL_SIGNAL) if span.in_flight or span.name == DEATH_SPAN else None
        if said == "none":
            return ""
        if said in _FATAL_WORDS.values() or said in ("a fatal signal", "SIGTERM"):
            return said
    return None


def fatal_signal(path: str) -> str:
    """The fatal signal named by the newest dump of the traceback file of
    the trace file at `path` ("a fatal signal" when it names none we know);
    SIGTERM for a dump without faulthandler's "Fatal Python error" line:
    the only signal the recorder registers it for (record/setup.py)."""
    text = read_text(fmt.traceback_path(path), limit=1 << 16)
    if "Fatal Python error: " not in text:
        return "SIGTERM" if text.strip() else "a fatal signal"
    words = text.rsplit("Fatal Python error: ", 1)[-1].split("\n", 1)[0].strip()
    return _FATAL_WORDS.get(words, "a fatal signal")


def death_time(path: str, alive: int, threads: "set[int] | frozenset[int]" = frozenset()) -> int:
    """When the writer of the trace file at `path` died of a fatal signal
    (ns; 0: unknown): the time faulthandler wrote its traceback beside the
    file. A call in flight runs until then, often well after its start
    record, the newest. That time is believed only within two heartbeats
    after `alive`, the last sign of life. Files copied off the node (`cp`
    without -p, `kubectl cp`, `scp`, a tar of whole seconds) lose that time:
    a fatal error's dump that names one of `threads` (the file's, by their
    ident, as faulthandler prints them) is tied to the file by what it says,
    and the death is then dated at the last sign of life."""
    try:
        fd = open_regular(fmt.traceback_path(path))
    except TraceFileError:
        return 0
    try:
        stat = os.fstat(fd)
    finally:
        os.close(fd)
    written = stat.st_mtime_ns
    # A file's times come from the kernel's coarse clock, a tick (up to 10 ms) behind the records' clock.
    if stat.st_size and alive - _COARSE_CLOCK_NS < written <= alive + int(2e9 * fmt.HEARTBEAT_S):
        return max(written, alive)
    if stat.st_size and threads and _fatal_dump_of(path, threads):
        return alive
    return 0


# faulthandler's head of each thread's stack: `Current thread 0x00007f3a... (most recent call first):`.
_DUMPED_THREAD = re.compile(r"^(?:Current thread|Thread) 0x([0-9a-f]{1,16}) ", re.MULTILINE)


def _fatal_dump_of(path: str, threads: "set[int] | frozenset[int]") -> bool:
    """Whether the traceback file of the trace file at `path` holds a fatal
    error's dump (faulthandler's, written as the process died: nothing runs
    after it) naming one of `threads`. A SIGTERM's lines do not count: an
    application's handler may have kept the process running after them."""
    text = read_text(fmt.traceback_path(path), limit=1 << 16)
    if "Fatal Python error: " not in text:
        return False
    dump = text.rsplit("Fatal Python error: ", 1)[-1]
    return any(int(ident, 16) in threads for ident in _DUMPED_THREAD.findall(dump))


_COARSE_CLOCK_NS = 10_000_000


@contextlib.contextmanager
def _collector_paused():
    """Python's cyclic garbage collector off while a file is parsed: a
    million records make millions of tuples and dicts, none in a cycle, and
    the collections their allocations set off took a third of the time."""
    paused = gc.isenabled()
    if paused:
        gc.disable()
    try:
        yield
    finally:
        if paused:
            gc.enable()


def writer_alive(path: str) -> bool:
    """Whether a live process writes the file: a writer holds an exclusive
    flock on it while it runs, and the kernel drops it however it dies."""
    try:
        fd = open_regular(path)
    except TraceFileError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:
        return False  # a filesystem without locks: nothing known
    finally:
        os.close(fd)


def open_regular(path: str) -> int:
    """A read-only descriptor of the regular file at `path`; TraceFileError
    for anything else (a FIFO, a device, a directory), without blocking."""
    try:
        return files.open_regular(path)
    except files.NotRegularFile as exc:
        raise TraceFileError(f"{path}: is {exc.kind}, not a trace file") from None
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file") from None
    except PermissionError:
        raise TraceFileError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read ({exc.strerror or exc})") from None


def map_trace_file(path: str) -> mmap.mmap:
    """The regular file at `path` mapped read-only."""
    fd = open_regular(path)
    try:
        if os.fstat(fd).st_size == 0:
            raise TraceFileError(f"{path}: empty file, not a trace file")
        return mmap.mmap(fd, 0, access=mmap.ACCESS_READ)
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read ({exc.strerror or exc})") from None
    finally:
        os.close(fd)


def read_text(path: str, limit: int = 1 << 20) -> str:
    """The end (at most `limit` bytes) of a regular text file beside a trace
    file, as valid text; "" when there is none or it is not a regular file."""
    try:
        fd = open_regular(path)
    except TraceFileError:
        return ""
    try:
        size = os.fstat(fd).st_size
        data = os.pread(fd, limit, max(size - limit, 0))
    except OSError:
        return ""
    finally:
        os.close(fd)
    return data.decode("utf-8", "replace")


# Format 2 had no high-water mark: its whole ring is scanned. Format 4
# added the heartbeat at the end of the header and records 3 does not know;
# 5 the ATTRIBUTED_END encoding.
_PREFIXES = {2: struct.Struct("<8sIIQI"), 3: fmt.HEADER_PREFIX, 4: fmt.HEADER_PREFIX,
             fmt.FORMAT_VERSION: fmt.HEADER_PREFIX}
READ_FORMATS = tuple(sorted(_PREFIXES))  # the trace-file formats this reader reads


def read_heartbeat(data) -> int:
    """When the writer of a mapped file last said it was alive (ns), 0 when
    the file has no heartbeat (an older format) or a value no clock gives."""
    version, header_size = struct.unpack_from("<II", data, 8)
    if version < 4 or header_size != fmt.HEADER_SIZE or len(data) < header_size:
        return 0
    alive = fmt.ALIVE.unpack_from(data, fmt.ALIVE_OFFSET)[0]
    return alive if 0 < alive < _INT64[1] else 0


def read_header(path: str, data, written_only: bool = True) -> tuple[dict, int, int, list[str]]:
    """(metadata, first ring byte, end of the ring, problems) of a mapped
    trace file; the end of what was written in it, unless `written_only` is
    false (a live file, whose writer moves that mark)."""
    problems: list[str] = []
    if len(data) < fmt.HEADER_PREFIX.size or bytes(data[:8]) != fmt.MAGIC:
        if bytes(data[:8]) == fmt.MAGIC[: min(8, len(data))]:
            raise TraceFileError(f"{path}: truncated inside its header ({len(data)} bytes)")
        raise TraceFileError(f"{path}: not a sglang-otel-kernels trace file (no {fmt.MAGIC.decode()} header)")
    version = struct.unpack_from("<I", data, 8)[0]
    prefix = _PREFIXES.get(version)
    if prefix is None:
        raise TraceFileError(f"{path}: trace file format {version}, this reader knows {sorted(_PREFIXES)}")
    _, _, header_size, capacity, meta_len, *written = prefix.unpack_from(data, 0)
    if header_size < prefix.size or meta_len > header_size - prefix.size:
        raise TraceFileError(f"{path}: damaged header (header size {header_size}, metadata {meta_len} bytes)")
    metadata = _metadata(data, prefix.size, meta_len, problems)
    if written and written_only:
        capacity = min(capacity, written[0])
    ring_end = header_size + capacity
    if len(data) < ring_end:
        problems.append(f"file truncated: {max(len(data) - header_size, 0)} of {capacity} record bytes present")
        ring_end = len(data)
    return metadata, header_size, ring_end, problems


def data_extents(path: str, start: int, end: int) -> list[tuple[int, int]]:
    """The parts of bytes [start, end) of a file that hold data: the holes
    of a sparse file (pages never written) are left out, so that a file with
    no high-water mark (format 2, or a crafted one) reads in a time bounded
    by what it holds, not by its size. Where the filesystem cannot tell
    (no SEEK_DATA), the whole range."""
    try:
        fd = open_regular(path)
    except TraceFileError:
        return [(start, end)]
    extents: list[tuple[int, int]] = []
    position = start
    try:
        while position < end:
            try:
                first = os.lseek(fd, position, os.SEEK_DATA)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but a hole from here to the end
                    break
                return [(start, end)]
            if first >= end:
                break
            position = min(os.lseek(fd, first, os.SEEK_HOLE), end)
            extents.append((first, position))
    finally:
        os.close(fd)
    return extents


def _parse(path: str, data) -> TraceFileContents:
    metadata, base, ring_end, problems = read_header(path, data)
    entries, skipped = [], 0
    extents = data_extents(path, base, ring_end)
    for first, last in extents:
        # Records are aligned from the ring's start; a hole ends on a page, which is aligned too.
        found, torn = scan(data, base + -(-(first - base) // fmt.ALIGN) * fmt.ALIGN, last)
        entries += found
        skipped += torn
    if len(extents) > 1:
        entries.sort()
    if skipped:
        problems.append(f"{skipped} record(s) torn by a crash or partly overwritten were skipped")
    malformed = sum(1 for entry in entries if entry[2] is MALFORMED)
    if malformed:
        problems.append(f"{malformed} record(s) with a valid checksum but malformed content were ignored")
    heartbeat = read_heartbeat(data)
    spans, last_time, assembler = _assemble(with_gaps(entries))
    if assembler.identity:
        metadata["ranks"] = dict(metadata.get("ranks") if isinstance(metadata.get("ranks"), dict) else {},
                                 **assembler.identity)
    if assembler.orphans:
        problems.append(f"{assembler.orphans} span end(s) whose start is not in the file (overwritten by newer "
                        "records, or begun before recording did) were left out")
    if assembler.unsure:
        problems.append(f"{len(assembler.unsure)} span start(s) from before a break in the ring, whose end may have "
                        "been overwritten, were left out (not counted as in flight)")
    return TraceFileContents(path, metadata, spans, len(entries), skipped, problems, last_time,
                             heartbeat=heartbeat, exited=assembler.exited, graphs=assembler.graph_calls(),
                             stacks=assembler.stacks, format_version=struct.unpack_from("<I", data, 8)[0])


def with_gaps(entries: list[tuple[int, int, tuple]]) -> list[tuple]:
    """The records of `entries` (in sequence order) with GAP where the
    unbroken run of sequence numbers that ends at the newest record begins,
    if anything older survives: only in that run does a start without its end
    mean a call in flight."""
    records = [record for _, _, record in entries]
    if not entries or entries[-1][0] - entries[0][0] == len(entries) - 1:
        return records  # sequence numbers are unique: none is missing between the first and the last
    start = len(entries) - 1
    while start > 0 and entries[start - 1][0] == entries[start][0] - 1:
        start -= 1
    if start > 0:
        records.insert(start, GAP)
    return records


def _metadata(data, start: int, meta_len: int, problems: list[str]) -> dict:
    try:
        value = json.loads(bytes(data[start : start + meta_len]).decode("utf-8"))
        if isinstance(value, dict):
            return _clean_json(value)
    except (UnicodeDecodeError, ValueError, RecursionError):
        pass
    problems.append("the header's metadata is damaged")
    return {}


def _clean_json(value):
    """JSON with its text made valid UTF-8 (json.loads accepts lone surrogates)."""
    if isinstance(value, str):
        return utf8(value)
    if isinstance(value, list):
        return [_clean_json(item) for item in value]
    if isinstance(value, dict):
        return {utf8(key): _clean_json(item) for key, item in value.items()}
    return value


def record_at(data, position: int, end: int) -> "tuple[int, tuple, int] | None":
    """(sequence, record, position after it) of a whole, valid record at
    `position`, else None (no record, torn, or not one this reader knows).
    The payload is copied first, then checked and read: a live writer may
    overwrite the ring meanwhile."""
    header = fmt.RECORD_HEADER
    if position + header.size > end:
        return None
    magic, length, sequence, crc, encoding = header.unpack_from(data, position)
    payload_start = position + header.size
    if magic != fmt.RECORD_MAGIC or not length or payload_start + length > end:
        return None
    payload = data[payload_start : payload_start + length]
    record = payload_record(payload, payload, 0, length, crc, encoding)  # bytes slice as a memoryview would
    if record is None:
        return None
    size = header.size + length
    return sequence, record, position + size + (-size) % fmt.ALIGN


def payload_record(data, view: memoryview, start: int, length: int, crc: int, encoding: int,
                   _crc32=zlib.crc32, _compact=fmt.COMPACT_END.unpack_from, _compact_size=fmt.COMPACT_END.size):
    """The record whose payload is at `start` of `data` (`view`: its
    memoryview, or the same bytes), validated and cleaned, decoded without a
    copy for the common encodings: None for one that fails its CRC, MALFORMED for one
    whose content this reader does not take (it still counts as a record in
    the sequence). Once per record of a file: the defaults bind what it needs."""
    stop = start + length
    if _crc32(view[start:stop]) != crc:
        return None
    if encoding == fmt.ENCODING_KERNEL_SPAN:
        return _kernel_span(data, view, start, length) or MALFORMED
    if encoding == fmt.ENCODING_ATTRIBUTED_END:
        return _attributed_end(data, view, start, length) or MALFORMED
    if encoding == fmt.ENCODING_COMPACT_END and length == _compact_size:
        span_id, end_time, status = _compact(data, start)
        return (COMPACT_END_RECORD, span_id, end_time, status) if end_time >= 0 else MALFORMED
    return _content(bytes(view[start:stop]), encoding) or MALFORMED


def scan(data, base: int, end: int) -> tuple[list[tuple[int, int, tuple]], int]:
    """Every valid record in the ring as (sequence, position after it, record),
    oldest first, and how many torn or partly overwritten ones were skipped.
    Records follow one another: each is read where the previous one ended,
    and only past what is not a record is the next magic searched for. It
    runs once per record of a file (a million in 16 MiB): the common records
    are decoded here, from the mapping, without a copy."""
    entries: list[tuple[int, int, tuple]] = []
    append = entries.append
    skipped = 0
    view = memoryview(data)
    unpack, header_size, align = fmt.RECORD_HEADER.unpack_from, fmt.RECORD_HEADER.size, fmt.ALIGN
    magic_value, find, magic_bytes = fmt.RECORD_MAGIC, data.find, _RECORD_MAGIC_BYTES
    position = base
    try:
        while position + header_size <= end:
            magic, length, sequence, crc, encoding = unpack(data, position)
            if magic != magic_value:  # not a record: the next aligned magic, if any
                found = find(magic_bytes, position + 1, end)
                while found >= 0 and (found - base) % align:
                    found = find(magic_bytes, found + 1, end)
                if found < 0:
                    break
                position = found
                continue
            start = position + header_size
            stop = start + length
            record = payload_record(data, view, start, length, crc, encoding) if length and stop <= end else None
            if record is None:
                skipped += 1  # torn by a crash in mid-write, or partly overwritten
                position += align
                continue
            position = stop + (-(header_size + length)) % align
            append((sequence, position, record))
    finally:
        view.release()
    entries.sort()  # by sequence number: unique, so the rest of a tuple is never compared
    return entries, skipped


def _content(payload: bytes, encoding: int):
    """A record of the encodings `payload_record` does not decode itself (a
    COMPACT_END of the wrong size is none: None)."""
    if encoding == fmt.ENCODING_KERNEL_START:
        if len(payload) != fmt.KERNEL_START.size:
            return None
        fields = fmt.KERNEL_START.unpack(payload)
        return (_KERNEL_START, *fields) if fields[2] >= 0 else None
    if encoding == fmt.ENCODING_KERNEL_END:
        if len(payload) != fmt.KERNEL_END.size:
            return None
        fields = fmt.KERNEL_END.unpack(payload)
        return (_KERNEL_END, *fields) if fields[1] >= 0 else None
    if encoding == fmt.ENCODING_SPAN_START:
        return _span_start(payload)
    if encoding != fmt.ENCODING_MARSHAL:
        return None
    record = _unmarshal(payload)
    if not isinstance(record, tuple) or not record:
        return None
    kind = record[0]
    if kind == fmt.END and len(record) == _END_FIELDS:
        return _end(record)
    if kind == fmt.CALL_END and len(record) == 7:
        return _call_end(record)
    if kind == fmt.ATTRIBUTES and len(record) == 3 and _is_u64(record[1]):
        attributes = _attributes(record[2])
        return None if attributes is None else (fmt.ATTRIBUTES, record[1], attributes)
    if kind == fmt.MODE and len(record) == 2 and type(record[1]) is str:
        return record
    if kind == fmt.THREAD and len(record) == 3 and _is_u64(record[1]) and type(record[2]) is str:
        return (fmt.THREAD, record[1], utf8(record[2]))
    if kind == fmt.SYMBOL and len(record) == 3 and type(record[1]) is int:
        value = _symbol(record[2])
        return None if value is None else (fmt.SYMBOL, record[1], value)
    if kind == fmt.TABLE and 3 <= len(record) <= 5 and isinstance(record[1], dict) and isinstance(record[2], dict):
        symbols = {number: value for number, value in ((n, _symbol(v)) for n, v in record[1].items())
                   if type(number) is int and value is not None}
        threads = {ident: utf8(name) for ident, name in record[2].items() if _is_u64(ident) and type(name) is str}
        identity = _identity(record[3]) if len(record) >= 4 else {}
        graphs = _graphs(record[4]) if len(record) == 5 else {}
        return None if identity is None or graphs is None else (fmt.TABLE, symbols, threads, identity, graphs)
    if kind == fmt.GRAPH and len(record) == 4 and _is_u64(record[1]):
        graph = _graph(record[2], record[3])
        return None if graph is None else (fmt.GRAPH, record[1], graph)
    if kind == fmt.IDENTITY and len(record) == 2:
        identity = _identity(record[1])
        return None if identity is None else (fmt.IDENTITY, identity)
    if kind == fmt.EXIT and len(record) == 2 and _is_time(record[1]):
        return record
    if kind == fmt.STACK and len(record) == 5 and _is_u64(record[1]) and _is_time(record[2]) and _is_time(record[3]):
        frames = _frames(record[4])
        return None if frames is None else (fmt.STACK, record[1], record[2], record[3], frames)
    if (kind == fmt.FAILURE and len(record) == 4 and type(record[1]) is int
            and type(record[2]) is str and type(record[3]) is str):
        return (fmt.FAILURE, record[1], utf8(record[2]), utf8(record[3]))
    return None


def _unmarshal(payload):
    try:
        return marshal.loads(payload)
    except (ValueError, EOFError, TypeError, RecursionError, MemoryError):
        return None


_INT64 = (-(1 << 63), (1 << 63) - 1)
_MAX_NESTING = 8


def _is_u64(value) -> bool:
    return type(value) is int and 0 <= value < 1 << 64


def _is_time(value) -> bool:
    return type(value) is int and 0 <= value <= _INT64[1]


def _symbol(value):
    """A symbol's value: a name, or a (scope name, version) pair; else None."""
    if type(value) is str:
        return utf8(value)
    if type(value) is tuple and len(value) == 2 and all(type(part) is str for part in value):
        return (utf8(value[0]), utf8(value[1]))
    return None


def _frames(value) -> "tuple | None":
    """A STACK record's frames, each (file, line, function), at most MAX_STACK_FRAMES; None when malformed."""
    if type(value) is not tuple or len(value) > fmt.MAX_STACK_FRAMES:
        return None
    frames = []
    for frame in value:
        if not (type(frame) is tuple and len(frame) == 3 and type(frame[0]) is str and type(frame[1]) is int
                and type(frame[2]) is str and 0 <= frame[1] < 1 << 31):
            return None
        frames.append((utf8(frame[0][-256:]), frame[1], utf8(frame[2][:256])))
    return tuple(frames)


def _graph(calls, left_out) -> "tuple | None":
    """A graph's captured calls, each (name: a symbol number or text, input
    shapes, input dtypes), and how many were left out; None when malformed."""
    if type(calls) is not tuple or len(calls) > fmt.MAX_GRAPH_CALLS or type(left_out) is not int or left_out < 0:
        return None
    clean = []
    for call in calls:
        if type(call) is not tuple or len(call) != 3 or type(call[0]) not in (int, str):
            return None
        shapes, dtypes = _texts(call[1]), _texts(call[2])
        if shapes is False or dtypes is False:
            return None
        clean.append((utf8(call[0]) if type(call[0]) is str else call[0], shapes, dtypes))
    return tuple(clean), left_out


def _graphs(value) -> "dict | None":
    """A TABLE's graphs (id -> their calls, see `_graph`), the malformed
    ones left out; None when it is no dict."""
    if type(value) is not dict:
        return None
    kept = {}
    for graph_id, graph in value.items():
        graph = _graph(*graph) if _is_u64(graph_id) and type(graph) is tuple and len(graph) == 2 else None
        if graph is not None:
            kept[graph_id] = graph
    return kept


def _identity(value) -> "dict | None":
    """A process's ranks: text keys, plain values (numbers, text)."""
    clean = _attributes(value)
    if clean is None:
        return None
    return {key: item for key, item in clean.items() if type(item) in (int, str, float)}


def _value(value, depth: int = 0):
    """An attribute value OTLP can carry (text valid UTF-8, ints within int64,
    sequences and maps of such), or None for anything else (code objects,
    sets, bytes, nesting past a bound)."""
    kind = type(value)
    if kind is str:
        return value if value.isascii() else utf8(value)
    if kind is bool or kind is float:
        return value
    if kind is int:
        return value if _INT64[0] <= value <= _INT64[1] else str(value)
    if depth >= _MAX_NESTING:
        return None
    if kind is tuple or kind is list:
        kinds = set(map(type, value))
        if kinds == {str} and all(map(str.isascii, value)):
            return tuple(value)  # text, as collectives' shapes and dtypes are: checked without a call per item
        if kinds == {int} and _INT64[0] <= min(value) and max(value) <= _INT64[1]:
            return tuple(value)
        items = tuple(_value(item, depth + 1) for item in value)
        return None if None in items else items
    if kind is dict:
        return _attributes(value, depth + 1)
    return None


def _attributes(value, depth: int = 0) -> "dict | None":
    """An attribute map with string keys and valid values (the others
    dropped); None when `value` is not a dict at all. Text and numbers, what
    most values are, are checked here, without a call per value."""
    if type(value) is not dict:
        return None
    clean = {}
    low, high = _INT64
    for key, item in value.items():
        if type(key) is not str:
            continue
        kind = type(item)
        if kind is str:
            if not item.isascii():
                item = utf8(item)
        elif kind is int:
            if not low <= item <= high:
                item = str(item)
        elif kind is not bool and kind is not float:
            item = _value(item, depth)
            if item is None:
                continue
        clean[key if key.isascii() else utf8(key)] = item
    return clean


def _events(value) -> "tuple | None":
    if type(value) is not tuple:
        return None
    events = []
    for event in value:
        if type(event) is tuple and len(event) == 3 and type(event[0]) is str and _is_time(event[1]):
            attributes = _attributes(event[2])
            if attributes is not None:
                events.append((utf8(event[0]), event[1], attributes))
    return tuple(events)


def _links(value) -> "tuple | None":
    if type(value) is not tuple:
        return None
    links = []
    for link in value:
        if (type(link) is tuple and len(link) == 3 and type(link[0]) is int and 0 < link[0] < 1 << 128
                and _is_u64(link[1]) and link[1]):
            attributes = _attributes(link[2])
            if attributes is not None:
                links.append((link[0], link[1], attributes))
    return tuple(links)


def _span_start(payload: bytes):
    """(SPAN_START_RECORD, trace id, span id, parent id, name (symbol number, or the
    name itself when written inline), kind, start, thread, scope symbol,
    attributes, links, sampled flag, remote parent, parent sampled)."""
    fixed = fmt.SPAN_START
    if len(payload) < fixed.size:
        return None
    high, low, span_id, parent_id, start, thread, name, scope, kind, flags = fixed.unpack_from(payload)
    if start < 0 or kind > 4:
        return None
    data = _unmarshal(payload[fixed.size :])
    if flags & fmt.FLAG_INLINE_NAME:
        name, data = _inline_name(data)
    links: "tuple | None" = ()
    if flags & fmt.FLAG_LINKS:
        if not (type(data) is tuple and len(data) == 2):
            return None
        data, links = data[0], _links(data[1])
    attributes = _attributes(data)
    if attributes is None or links is None:
        return None
    return (SPAN_START_RECORD, (high << 64) | low, span_id, parent_id, name, kind, start, thread, scope, attributes, links,
            flags & fmt.FLAG_SAMPLED, bool(flags & fmt.FLAG_REMOTE_PARENT), bool(flags & fmt.FLAG_PARENT_SAMPLED), None)


def _inline_name(data) -> tuple:
    """(name, the rest) of marshal data written with FLAG_INLINE_NAME; for
    malformed data (0, None), which the caller's checks then refuse."""
    if type(data) is tuple and len(data) == 2 and type(data[0]) is str:
        return utf8(data[0]), data[1]
    return 0, None


def _kernel_span(data, view: memoryview, offset: int, length: int, _unpack=fmt.KERNEL_SPAN.unpack_from,
                 _size=fmt.KERNEL_SPAN.size):
    """A kernel call's start (the record's payload at `offset` of the mapped
    `data`), as a SPAN_START_RECORD tuple whose scope is _KERNEL_SCOPE: its name
    goes first among its attributes when it is made. Once per kernel call of
    a file: the defaults bind what it needs as locals."""
    if length < _size:
        return None
    high, low, span_id, parent_id, start, thread, name, kind, flags, seq, level = _unpack(data, offset)
    if start < 0 or kind > 4:
        return None
    # The name, once resolved, goes first; a CUDA graph's replay has its graph and replay number, not a call number.
    replay = flags & fmt.FLAG_GRAPH_REPLAY
    attributes: "dict | None" = ({NAME: None, LEVEL: level, **fmt.replay_fields(seq)}
                                 if replay else {NAME: None, LEVEL: level, SEQ: seq})
    if flags & fmt.FLAG_BLACKBOX:
        attributes[BLACKBOX] = True
    extra = _NOTHING
    if length > _size:
        payload = bytes(view[offset + _size : offset + length])
        inline = flags & fmt.FLAG_INLINE_NAME
        # A site's calls mostly carry the same attributes (its shapes, its
        # batch): their payload's reading is kept, never changed once made.
        known = _extras.get((inline, payload)) if len(payload) <= _EXTRA_CACHED else None
        if known is None:
            known = _kept(_extras, (inline, payload), _extra(payload, inline), len(payload))
        if known is False:
            return None
        if inline:
            name = known[0]
        extra = known[1]
        attributes.update(extra)
    return (SPAN_START_RECORD, (high << 64) | low, span_id, parent_id, name, kind, start, thread, _KERNEL_SCOPE, attributes,
            (), flags & fmt.FLAG_SAMPLED, bool(flags & fmt.FLAG_REMOTE_PARENT), bool(flags & fmt.FLAG_PARENT_SAMPLED),
            None if replay else extra)


# The readings of kernel spans' attribute payloads, by (inline-name flag,
# payload): bounded, emptied when full. A kernel call's start record ends
# with the reading its attributes were made of (after its name, level, call
# number and black-box mark, in that order), or None when they were made
# otherwise: a replay's, or changed after its start. Never changed, so a
# reading's encoding can be kept by the sidecar (live/wire.py).
_NOTHING: dict = {}
_extras: dict = {}
_EXTRAS_LIMIT, _EXTRA_CACHED = 4096, 4096


def _extra(payload: bytes, inline: int):
    """(the name written inline or None, attributes) of a kernel span's
    marshalled payload, the collective's first; False when malformed."""
    data = _unmarshal(payload)
    name = None
    if inline:
        name, data = _inline_name(data)
    attributes = {}
    if type(data) is dict and fmt.PACKED_COLLECTIVE in data:
        collective = _collective(data.pop(fmt.PACKED_COLLECTIVE))
        if collective is None:
            return False
        attributes.update(collective)
    extra = _attributes(data) if data else {}
    if extra is None:
        return False
    attributes.update(extra)
    return name, attributes


def _attributed_end(data, view: memoryview, offset: int, length: int, _unpack=fmt.COMPACT_END.unpack_from,
                    _size=fmt.COMPACT_END.size):
    """A kernel call's end with the attributes it added (an ATTRIBUTED_END
    payload at `offset` of `data`), as a CALL_END tuple. Its attributes are
    read once per distinct payload, like a start's (`_extras`): the tuple
    shares that dict, which nothing changes."""
    if length <= _size:
        return None
    span_id, end_time, status = _unpack(data, offset)
    if end_time < 0:
        return None
    payload = bytes(view[offset + _size : offset + length])
    attributes = _ends.get(payload)
    if attributes is None:
        attributes = _attributes(_unmarshal(payload))
        if attributes is None:
            return None
        _kept(_ends, payload, attributes, len(payload))
    return (fmt.CALL_END, span_id, end_time, status, "", (), attributes)


_ends: dict = {}  # the attributes of ATTRIBUTED_END payloads, by payload: bounded, emptied when full


def _kept(cache: dict, key, value, size: int):
    """`value`, kept in `cache` (`_extras`, `_ends`) under `key` when its
    payload's `size` is small enough; the cache is emptied when full."""
    if size <= _EXTRA_CACHED:
        if len(cache) >= _EXTRAS_LIMIT:
            cache.clear()
        cache[key] = value
    return value


_TEXTS, _NUMBERS = {str}, {int}
_OPTIONAL_NUMBER = (int, type(None))


def _texts(value):
    """A tuple of text (shapes, dtypes) made valid UTF-8; False for anything else."""
    if type(value) is not tuple or (value and set(map(type, value)) != _TEXTS):
        return False
    return value if all(map(str.isascii, value)) else tuple(map(utf8, value))


def _collective(packed, _fields=COLLECTIVE_FIELDS) -> "dict | None":
    """A packed collective's attributes (tracefile.COLLECTIVE_FIELDS' values
    in order, None where absent), each checked for its type; None when
    malformed. Once per collective of a file: checks by whole tuples."""
    if type(packed) is not tuple or len(packed) != len(_fields):
        return None
    op, group, ranks, seq, asynchronous, in_shapes, in_dtypes, out_shapes, out_dtypes, reduce, peer, root, tag = packed
    low, high = _INT64
    if (type(op) is not str or type(group) is not str or type(seq) is not int or not low <= seq <= high
            or type(asynchronous) is not bool or type(ranks) is not tuple
            or (ranks and (set(map(type, ranks)) != _NUMBERS or min(ranks) < low or max(ranks) > high))
            or type(reduce) not in (str, type(None)) or type(peer) not in (int, str, type(None))
            or type(root) not in _OPTIONAL_NUMBER or type(tag) not in _OPTIONAL_NUMBER
            or (type(peer) is int and not low <= peer <= high) or (root is not None and not low <= root <= high)
            or (tag is not None and not low <= tag <= high)):
        return None
    values = [utf8(op), utf8(group), ranks, seq, asynchronous]
    for text in (in_shapes, in_dtypes, out_shapes, out_dtypes):
        if text is not None:
            text = _texts(text)
            if text is False:
                return None
        values.append(text)
    values += (reduce if reduce is None else utf8(reduce), utf8(peer) if type(peer) is str else peer, root, tag)
    return {key: value for key, value in zip(_fields, values) if value is not None}


def _ending(status, description, events, attributes) -> bool:
    """Whether the fields an end record shares are of the right types (the
    events and attributes are cleaned one by one afterwards)."""
    return type(status) is int and type(description) is str and type(events) is tuple and type(attributes) is dict


def _call_end(record: tuple) -> "tuple | None":
    _, span_id, end_time, status, description, events, attributes = record
    if not (_is_u64(span_id) and _is_time(end_time) and _ending(status, description, events, attributes)):
        return None
    return (fmt.CALL_END, span_id, end_time, status, utf8(description), _events(events), _attributes(attributes))


def _end(record: tuple) -> "tuple | None":
    _, trace_id, span_id, end_time, status, description, events, attributes = record
    if not (type(trace_id) is int and 0 <= trace_id < 1 << 128 and _is_u64(span_id) and _is_time(end_time)
            and _ending(status, description, events, attributes)):
        return None
    return (fmt.END, trace_id, span_id, end_time, status, utf8(description), _events(events), _attributes(attributes))


_MAX_LATE = 65536  # spans with attributes written after their end, kept by a reader


class Assembler:
    """Pairs start and end records (in sequence order) into spans, one record
    at a time: the reader feeds it a whole file, `follow` a live one. Names
    are resolved when a span is made, so that a TABLE written after a wrap
    resolves the starts it follows."""

    def __init__(self) -> None:
        self.threads: dict[int, str] = {}
        self.symbols: dict[int, Any] = {}
        self.starts: dict[int, tuple] = {}  # span id -> start record, while open
        self.calls: dict[int, tuple] = {}  # black-box call number -> KERNEL_START record, while open
        # Starts open at a GAP: their end may have been lost, so they are
        # paired if it comes and otherwise never reported in flight.
        self.unsure: dict = {}
        self.failures: dict[int, tuple] = {}
        self.last_time = 0
        self.orphans = 0  # ends whose start the ring had overwritten
        self.identity: dict = {}  # the process's ranks learnt after its file was created
        self.exited = False  # an EXIT record: the interpreter exited normally
        self.graphs: dict = {}  # CUDA graph id -> (its captured calls, names as in the file; calls left out)
        self.stacks: dict = {}  # thread ident -> (time, silent since, frames): its newest STACK record
        # Attributes written after a span ended (a CUDA graph replay's NaN flags), by span id; bounded.
        self.late: dict[int, dict] = {}

    def add(self, record: tuple) -> "tuple | None":
        """Takes one record; returns (start, end) when it ends a span or call."""
        kind = record[0]
        # The common records first, with comparisons rather than calls: this
        # runs once per record (a million in a full 16 MiB file).
        if kind is SPAN_START_RECORD:
            self.starts[record[2]] = record
            if record[6] > self.last_time:
                self.last_time = record[6]
        elif kind is COMPACT_END_RECORD or kind == fmt.END or kind == fmt.CALL_END:
            span_id, end_time = (record[2], record[3]) if kind == fmt.END else (record[1], record[2])
            if end_time > self.last_time:
                self.last_time = end_time
            start = self.starts.pop(span_id, None) or self.unsure.pop(("s", span_id), None)
            if start is not None:
                return start, record
            self.orphans += 1
        elif kind == _KERNEL_START:
            self.calls[record[2]] = record
            self.last_time = max(self.last_time, record[3])
        elif kind == _KERNEL_END:
            self.last_time = max(self.last_time, record[2])
            start = self.calls.pop(record[1], None) or self.unsure.pop(("k", record[1]), None)
            if start is not None:
                return start, record
        elif record is GAP:
            self.unsure.update((("s", span_id), start) for span_id, start in self.starts.items())
            self.unsure.update((("k", seq), start) for seq, start in self.calls.items())
            self.starts.clear()
            self.calls.clear()
            while len(self.unsure) > _MAX_UNSURE:  # a follower lapped again and again
                del self.unsure[next(iter(self.unsure))]
        elif kind == fmt.ATTRIBUTES:
            start = self.starts.get(record[1])
            if start is not None:  # a span's attributes added after its start record, before its kernel ran
                attributes = {**start[_START_ATTRIBUTES], **record[2]}
                self.starts[record[1]] = (*start[:_START_ATTRIBUTES], attributes, *start[_START_ATTRIBUTES + 1:-1], None)
            elif len(self.late) < _MAX_LATE:  # after its end: for the span made already
                self.late.setdefault(record[1], {}).update(record[2])
        elif kind == fmt.FAILURE:
            self.failures[record[1]] = record
        elif kind == fmt.THREAD:
            self.threads[record[1]] = str(record[2])
        elif kind == fmt.SYMBOL:
            self.symbols[record[1]] = record[2]
        elif kind == fmt.TABLE:
            self.symbols.update(record[1])
            self.threads.update((ident, str(name)) for ident, name in record[2].items())
            self.identity.update(record[3])
            self.graphs.update(record[4])
        elif kind == fmt.GRAPH:
            self.graphs[record[1]] = record[2]
        elif kind == fmt.IDENTITY:
            self.identity.update(record[1])
        elif kind == fmt.EXIT:
            self.exited = True
            self.last_time = max(self.last_time, record[1])
        elif kind == fmt.STACK:
            self.stacks[record[1]] = record[2:]
        return None

    def span(self, start: tuple, end: "tuple | None") -> RecoveredSpan:
        """The span of a start record and its end (None: still in flight)."""
        if start[0] == _KERNEL_START:
            return self._call(start, end)
        span = _span(start, end, self.threads, self.symbols)
        graph_id = span.attributes.get(GRAPH_REPLAY) and span.attributes.get(GRAPH_ID)
        if graph_id is not None and graph_id in self.graphs:
            calls, left_out = self.graphs[graph_id]
            span.attributes[GRAPH_CALLS] = len(calls) + left_out
            if span.in_flight:  # the suspects, on the span wherever it goes (export, the sidecar, replay)
                span.attributes[GRAPH_CAPTURED] = tuple(
                    f"{symbol_name(self.symbols, name)} {', '.join(shapes)}".rstrip() for name, shapes, _ in calls)
        return span

    def graph_calls(self) -> dict:
        """The graphs' captured calls with their names resolved: id -> (calls, calls left out)."""
        return {graph_id: (tuple((symbol_name(self.symbols, name), shapes, dtypes) for name, shapes, dtypes in calls),
                           left_out) for graph_id, (calls, left_out) in self.graphs.items()}

    def kernel_calls_started_before(self, time_ns: int) -> list[tuple]:
        """The start records of kernel calls in flight that started before `time_ns`."""
        return [start for start in self.starts.values() if start[8] == _KERNEL_SCOPE and start[6] < time_ns]

    def parent_of(self, span_id: int) -> "int | None":
        """The parent span id of a span still open (its batch, an outer call), or None."""
        start = self.starts.get(span_id)
        return None if start is None or start[0] is not SPAN_START_RECORD else start[3]

    def linking_to(self, span_id: int) -> list[tuple[int, int, dict, dict, bool]]:
        """The open spans with a link to span `span_id`: (trace id, span id,
        attributes, the link's attributes, sampled) each."""
        return [(start[1], start[2], start[9], link[2], bool(start[11]))
                for start in self.starts.values() if start[0] is SPAN_START_RECORD and start[10]
                for link in start[10] if link[1] == span_id]

    def in_flight(self) -> list[RecoveredSpan]:
        """The spans and calls started and not ended."""
        return [self.span(start, None) for start in (*self.starts.values(), *self.calls.values())]

    def _call(self, start: tuple, end: "tuple | None") -> RecoveredSpan:
        _, site, seq, start_time, thread, trace_high, trace_low, parent_id = start
        name = symbol_name(self.symbols, site)
        attributes = {NAME: name, SEQ: seq, BLACKBOX: True}
        events: list = []
        if end is None:
            end_time, status, description = None, "ERROR", IN_FLIGHT_DESCRIPTION
            attributes[IN_FLIGHT] = True
        else:
            end_time, status = end[2], STATUS_NAMES.get(end[3], "UNSET")
            description = ""
            failure = self.failures.pop(seq, None)
            if failure is not None:
                description = f"{failure[2]}: {failure[3]}"
                events.append(("exception", end_time, {"exception.type": failure[2], "exception.message": failure[3]}))
        return RecoveredSpan(
            name=name, trace_id=(trace_high << 64) | trace_low, span_id=_BLACKBOX_SPAN_TAG | (seq & ((1 << 48) - 1)),
            parent_span_id=parent_id, parent_is_remote=False, kind=0, start_time=start_time, end_time=end_time,
            status_code=status, status_description=description, attributes=attributes, events=events, links=[],
            thread_id=thread, thread_name=self.threads.get(thread), scope_name=TRACER_NAME,
            scope_version="", trace_flags=1, in_flight=end is None,
        )


def _assemble(records: list[tuple]) -> "tuple[list[RecoveredSpan], int, Assembler]":
    """All spans of a file, ended and in flight, in start order; the newest
    time; the assembler (what it left out). Name symbols are learnt first
    (their numbers never change in a file, and a TABLE after a wrap names
    records older than it), and so are CUDA graphs; thread names as they come, since a thread's
    ident is reused by later threads, and spans are made as they end."""
    assembler = Assembler()
    for record in records:
        if record[0] == fmt.SYMBOL:
            assembler.symbols[record[1]] = record[2]
        elif record[0] == fmt.TABLE:
            assembler.symbols.update(record[1])
            assembler.graphs.update(record[4])
        elif record[0] == fmt.GRAPH:
            assembler.graphs[record[1]] = record[2]
    spans = [assembler.span(*pair) for pair in map(assembler.add, records) if pair is not None]
    spans += assembler.in_flight()
    for span in spans:
        if span.thread_name is None:  # its THREAD record overwritten: the newest table's name
            span.thread_name = assembler.threads.get(span.thread_id)
        late = assembler.late.get(span.span_id)
        if late is not None:
            span.attributes.update(late)
    spans.sort(key=_START)
    return spans, max([assembler.last_time] + [s.end_time or s.start_time for s in spans]), assembler


_START = operator.attrgetter("start_time")


def symbol_name(symbols: dict[int, Any], number: "int | str") -> str:
    """A span's name: written inline, or its symbol's. One the file does not
    hold (a full table when a black-box kernel was first seen, or damage) still shows."""
    if type(number) is str:
        return number
    value = symbols.get(number)
    if isinstance(value, str):
        return value
    return "<name not recorded: the name table was full>" if number == 0 else f"<name {number} not in the file>"


def _span(start: tuple, end: tuple | None, threads: dict[int, str], symbols: dict[int, Any]) -> RecoveredSpan:
    (_, trace_id, span_id, parent_id, name, kind, start_time, thread, scope_number,
     attributes, links, flags, parent_remote, parent_sampled, _) = start
    name = symbol_name(symbols, name)
    if scope_number == _KERNEL_SCOPE:
        scope, scope_version = KERNEL_SCOPE
        if end is None:  # the start stays open: a follower may make its span again
            attributes = dict(attributes)
        attributes[NAME] = name  # in the first place, which the start record kept for it
    else:
        scope = symbols.get(scope_number)
        if not (isinstance(scope, tuple) and len(scope) == 2):
            scope = ("", "")
        scope, scope_version = str(scope[0]), str(scope[1])
        attributes = dict(attributes)
    events: tuple = ()
    if end is None:
        end_time, status_name, description = None, "ERROR", IN_FLIGHT_DESCRIPTION
        attributes[IN_FLIGHT] = True
    elif end[0] == COMPACT_END_RECORD:
        end_time, status_name, description = end[2], STATUS_NAMES.get(end[3], "UNSET"), ""
    elif end[0] == fmt.CALL_END:
        _, _, end_time, status, description, events, added = end
        status_name = STATUS_NAMES.get(status, "UNSET")
        attributes.update(added)
    else:
        _, _, _, end_time, status, description, events, attributes = end
        status_name = STATUS_NAMES.get(status, "UNSET")
        attributes = dict(attributes)
    # Positional: this runs once per span of a file (RecoveredSpan's field order).
    return RecoveredSpan(name, trace_id, span_id, parent_id, bool(parent_remote), kind, start_time, end_time,
                         status_name, description, attributes, list(events), list(links), thread, threads.get(thread),
                         scope, scope_version, flags, end is None, parent_sampled)
