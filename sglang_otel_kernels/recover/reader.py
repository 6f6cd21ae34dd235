"""Reads a trace file back: the spans that ended, and those still in flight
when the process died, in the order they started.

Never crashes on a damaged file: a missing, empty, foreign or truncated header
raises `TraceFileError` with what is wrong; torn or overwritten records are
skipped and counted.
"""

from __future__ import annotations

import dataclasses
import json
import marshal
import mmap
import os
import struct
import zlib
from typing import Any

from ..record import tracefile as fmt
from ..schema import BLACKBOX, IN_FLIGHT, NAME, SEQ

IN_FLIGHT_DESCRIPTION = "the process ended during this call (no end record)"
STATUS_NAMES = {0: "UNSET", 1: "OK", 2: "ERROR"}
_RECORD_MAGIC_BYTES = struct.pack("<I", fmt.RECORD_MAGIC)
_COMPACT_END = "e"
_KERNEL_START = "ks"
_KERNEL_END = "ke"
_SPAN_START = "s"
# Black-box calls have no span id of their own: theirs is made from the call
# number, with a high tag no random id of the SDK is likely to share.
_BLACKBOX_SPAN_TAG = 0xB1AC << 48
_END_FIELDS = 8


class TraceFileError(Exception):
    """The file cannot be read as a trace file; the message says why."""


@dataclasses.dataclass
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


def read_trace(path: str | os.PathLike) -> list[RecoveredSpan]:
    """The spans in the trace file at `path`, ended and in flight, in start order."""
    return read_trace_file(path).spans


def read_trace_file(path: str | os.PathLike) -> TraceFileContents:
    path = os.fspath(path)
    try:
        with open(path, "rb") as handle:
            size = os.fstat(handle.fileno()).st_size
            if size == 0:
                raise TraceFileError(f"{path}: empty file, not a trace file")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                return _parse(path, data)
    except FileNotFoundError:
        raise TraceFileError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise TraceFileError(f"{path}: is a directory, not a trace file") from None
    except PermissionError:
        raise TraceFileError(f"{path}: permission denied") from None
    except OSError as exc:
        raise TraceFileError(f"{path}: cannot read ({exc.strerror or exc})") from None


def read_header(path: str, data) -> tuple[dict, int, int, list[str]]:
    """(metadata, first ring byte, end of the ring, problems) of a mapped trace file."""
    problems: list[str] = []
    if len(data) < fmt.HEADER_PREFIX.size or bytes(data[:8]) != fmt.MAGIC:
        if bytes(data[:8]) == fmt.MAGIC[: min(8, len(data))]:
            raise TraceFileError(f"{path}: truncated inside its header ({len(data)} bytes)")
        raise TraceFileError(f"{path}: not a sglang-otel-kernels trace file (no {fmt.MAGIC.decode()} header)")
    _, version, header_size, capacity, meta_len = fmt.HEADER_PREFIX.unpack_from(data, 0)
    if version != fmt.FORMAT_VERSION:
        raise TraceFileError(f"{path}: trace file format {version}, this reader knows {fmt.FORMAT_VERSION}")
    if header_size < fmt.HEADER_PREFIX.size or meta_len > header_size - fmt.HEADER_PREFIX.size:
        raise TraceFileError(f"{path}: damaged header (header size {header_size}, metadata {meta_len} bytes)")
    metadata = _metadata(data, meta_len, problems)
    ring_end = header_size + capacity
    if len(data) < ring_end:
        problems.append(f"file truncated: {max(len(data) - header_size, 0)} of {capacity} record bytes present")
        ring_end = len(data)
    return metadata, header_size, ring_end, problems


def _parse(path: str, data) -> TraceFileContents:
    metadata, base, ring_end, problems = read_header(path, data)
    entries, skipped = scan(data, base, ring_end)
    records = [record for _, _, record in entries]
    if skipped:
        problems.append(f"{skipped} record(s) torn by a crash or partly overwritten were skipped")
    spans, last_time, orphans = _assemble(records)
    if orphans:
        problems.append(f"{orphans} span end(s) whose start was overwritten by newer records were left out")
    return TraceFileContents(path, metadata, spans, len(records), skipped, problems, last_time)


def _metadata(data, meta_len: int, problems: list[str]) -> dict:
    start = fmt.HEADER_PREFIX.size
    try:
        value = json.loads(bytes(data[start : start + meta_len]).decode("utf-8"))
        if isinstance(value, dict):
            return value
    except (UnicodeDecodeError, ValueError):
        pass
    problems.append("the header's metadata is damaged")
    return {}


def record_at(data, position: int, end: int) -> "tuple[int, tuple, int] | None":
    """(sequence, record, position after it) of a whole, valid record at
    `position`, else None (no record, torn, or not one this reader knows)."""
    header = fmt.RECORD_HEADER
    if position + header.size > end:
        return None
    magic, length, sequence, crc, encoding = header.unpack_from(data, position)
    payload_start = position + header.size
    if magic != fmt.RECORD_MAGIC or not length or payload_start + length > end:
        return None
    record = _decode(data[payload_start : payload_start + length], crc, encoding)
    if record is None:
        return None
    size = header.size + length
    return sequence, record, position + size + (-size) % fmt.ALIGN


def scan(data, base: int, end: int) -> tuple[list[tuple[int, int, tuple]], int]:
    """Every valid record in the ring as (sequence, position after it, record),
    oldest first, and how many torn or partly overwritten ones were skipped."""
    entries: list[tuple[int, int, tuple]] = []
    skipped = 0
    position = base
    while True:
        found = data.find(_RECORD_MAGIC_BYTES, position, end)
        if found < 0 or found + fmt.RECORD_HEADER.size > end:
            break
        if (found - base) % fmt.ALIGN:
            position = found + 1
            continue
        got = record_at(data, found, end)
        if got is None:
            skipped += 1
            position = found + fmt.ALIGN
            continue
        sequence, record, position = got
        entries.append((sequence, position, record))
    entries.sort(key=lambda entry: entry[0])
    return entries, skipped


def _decode(payload: bytes, crc: int, encoding: int):
    if zlib.crc32(payload) != crc:
        return None
    if encoding == fmt.ENCODING_COMPACT_END:
        if len(payload) != fmt.COMPACT_END.size:
            return None
        span_id, end_time, status = fmt.COMPACT_END.unpack(payload)
        return (_COMPACT_END, span_id, end_time, status)
    if encoding == fmt.ENCODING_KERNEL_START:
        if len(payload) != fmt.KERNEL_START.size:
            return None
        return (_KERNEL_START, *fmt.KERNEL_START.unpack(payload))
    if encoding == fmt.ENCODING_KERNEL_END:
        if len(payload) != fmt.KERNEL_END.size:
            return None
        return (_KERNEL_END, *fmt.KERNEL_END.unpack(payload))
    if encoding == fmt.ENCODING_SPAN_START:
        return _span_start(payload)
    if encoding != fmt.ENCODING_MARSHAL:
        return None
    record = _unmarshal(payload)
    if not isinstance(record, tuple) or not record:
        return None
    kind = record[0]
    if kind in (fmt.THREAD, fmt.SYMBOL) and len(record) == 3 and isinstance(record[1], int):
        return record
    if kind == fmt.TABLE and len(record) == 3 and isinstance(record[1], dict) and isinstance(record[2], dict):
        return record
    if kind == fmt.FAILURE and len(record) == 4 and isinstance(record[1], int):
        return record
    if kind == fmt.END and len(record) == _END_FIELDS and _well_formed_end(record):
        return record
    return None


def _unmarshal(payload):
    try:
        return marshal.loads(payload)
    except (ValueError, EOFError, TypeError):
        return None


def _span_start(payload: bytes):
    """(_SPAN_START, trace id, span id, parent id, name symbol, kind, start,
    thread, scope symbol, attributes, links, sampled flag, remote parent,
    parent sampled)."""
    fixed = fmt.SPAN_START
    if len(payload) < fixed.size:
        return None
    high, low, span_id, parent_id, start, thread, name, scope, kind, flags = fixed.unpack_from(payload)
    data = _unmarshal(payload[fixed.size :])
    if flags & fmt.FLAG_LINKS:
        if not (isinstance(data, tuple) and len(data) == 2 and isinstance(data[1], tuple)):
            return None
        data, links = data
    else:
        links = ()
    if not isinstance(data, dict):
        return None
    return (_SPAN_START, (high << 64) | low, span_id, parent_id, name, kind, start, thread, scope, data, links,
            flags & fmt.FLAG_SAMPLED, bool(flags & fmt.FLAG_REMOTE_PARENT), bool(flags & fmt.FLAG_PARENT_SAMPLED))


def _well_formed_end(record: tuple) -> bool:
    _, trace_id, span_id, end_time, status, description, events, attributes = record
    return (
        all(isinstance(value, int) for value in (trace_id, span_id, end_time, status))
        and isinstance(description, str)
        and isinstance(events, tuple)
        and isinstance(attributes, dict)
    )


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
        self.failures: dict[int, tuple] = {}
        self.last_time = 0
        self.orphans = 0  # ends whose start the ring had overwritten

    def add(self, record: tuple) -> "tuple | None":
        """Takes one record; returns (start, end) when it ends a span or call."""
        kind = record[0]
        if kind == _SPAN_START:
            self.starts[record[2]] = record
            self.last_time = max(self.last_time, record[6])
        elif kind in (fmt.END, _COMPACT_END):
            span_id, end_time = (record[2], record[3]) if kind == fmt.END else (record[1], record[2])
            self.last_time = max(self.last_time, end_time)
            start = self.starts.pop(span_id, None)
            if start is not None:
                return start, record
            self.orphans += 1
        elif kind == _KERNEL_START:
            self.calls[record[2]] = record
            self.last_time = max(self.last_time, record[3])
        elif kind == _KERNEL_END:
            self.last_time = max(self.last_time, record[2])
            start = self.calls.pop(record[1], None)
            if start is not None:
                return start, record
        elif kind == fmt.FAILURE:
            self.failures[record[1]] = record
        elif kind == fmt.THREAD:
            self.threads[record[1]] = str(record[2])
        elif kind == fmt.SYMBOL:
            self.symbols[record[1]] = record[2]
        elif kind == fmt.TABLE:
            self.symbols.update(record[1])
            self.threads.update((ident, str(name)) for ident, name in record[2].items())
        return None

    def span(self, start: tuple, end: "tuple | None") -> RecoveredSpan:
        """The span of a start record and its end (None: still in flight)."""
        if start[0] == _KERNEL_START:
            return self._call(start, end)
        return _span(start, end, self.threads, self.symbols)

    def in_flight(self) -> list[RecoveredSpan]:
        """The spans and calls started and not ended."""
        return [self.span(start, None) for start in (*self.starts.values(), *self.calls.values())]

    def _call(self, start: tuple, end: "tuple | None") -> RecoveredSpan:
        _, site, seq, start_time, thread, trace_high, trace_low, parent_id = start
        name = _name(self.symbols, site)
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
            thread_id=thread, thread_name=self.threads.get(thread), scope_name="sglang_otel_kernels",
            scope_version="", trace_flags=1, in_flight=end is None,
        )


def _assemble(records: list[tuple]) -> tuple[list[RecoveredSpan], int, int]:
    """All spans of a file, ended and in flight, in start order; the newest
    time; the ends whose start was overwritten (the oldest edge of the ring)."""
    assembler = Assembler()
    pairs = [pair for pair in map(assembler.add, records) if pair is not None]
    spans = [assembler.span(start, end) for start, end in pairs] + assembler.in_flight()
    spans.sort(key=lambda span: span.start_time)
    return spans, max([assembler.last_time] + [s.end_time or s.start_time for s in spans]), assembler.orphans


def _name(symbols: dict[int, Any], number: int) -> str:
    # A name the ring lost (it never should: see the TABLE record) still shows.
    value = symbols.get(number)
    return value if isinstance(value, str) else f"<name {number} not in the file>"


def _span(start: tuple, end: tuple | None, threads: dict[int, str], symbols: dict[int, Any]) -> RecoveredSpan:
    (_, trace_id, span_id, parent_id, name, kind, start_time, thread, scope_number,
     attributes, links, flags, parent_remote, parent_sampled) = start
    name = _name(symbols, name)
    scope = symbols.get(scope_number)
    if not (isinstance(scope, tuple) and len(scope) == 2):
        scope = ("", "")
    scope, scope_version = str(scope[0]), str(scope[1])
    attributes = dict(attributes)
    events: tuple = ()
    if end is None:
        end_time, status_name, description = None, "ERROR", IN_FLIGHT_DESCRIPTION
        attributes[IN_FLIGHT] = True
    elif end[0] == _COMPACT_END:
        end_time, status_name, description = end[2], STATUS_NAMES.get(end[3], "UNSET"), ""
    else:
        _, _, _, end_time, status, description, events, attributes = end
        status_name = STATUS_NAMES.get(status, "UNSET")
        attributes = dict(attributes)
    return RecoveredSpan(
        name=name,
        trace_id=trace_id,
        span_id=span_id,
        parent_span_id=parent_id,
        parent_is_remote=bool(parent_remote),
        kind=kind,
        start_time=start_time,
        end_time=end_time,
        status_code=status_name,
        status_description=description,
        attributes=attributes,
        events=[tuple(event) for event in events],
        links=[tuple(link) for link in links],
        thread_id=thread,
        thread_name=threads.get(thread),
        scope_name=scope,
        scope_version=scope_version,
        trace_flags=flags,
        in_flight=end is None,
        parent_sampled=parent_sampled,
    )
