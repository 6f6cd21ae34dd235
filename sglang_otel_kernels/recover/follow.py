"""Following a live trace file and exporting its spans as they end
(`sglang-otel-kernels follow FILE`): OTLP export done by another process. In
sidecar mode (the default with an OTLP endpoint) the application starts one
per trace file, so encoding and sending spans costs the application nothing,
and when the application dies the sidecar exports the calls that were in
flight at once, marked as such.
"""

from __future__ import annotations

import os
import time
from typing import Callable

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult

from ..notices import warn
from ..record.export import ExportSampler
from .otlp_json import resource_attributes
from ..record import tracefile as fmt
from ..schema import NAME
from .reader import (GAP, Assembler, TraceFileError, map_trace_file, read_header, record_at, scan, with_gaps,
                     writer_alive)
from .replay import BATCH, FileResource, readable

# Spans kept for a back end that does not take them, then the oldest are dropped.
_MAX_PENDING = 50_000
_NAMES = (fmt.SYMBOL, fmt.TABLE, fmt.THREAD)


class RingFollower:
    """The records a live writer appends to a trace file, in sequence order,
    each once. A record half-written when polled is read on a later poll. A
    poll reads two record headers when there is nothing new: the one where the
    next record goes, and the ring's first, which tells whether the writer
    wrapped (the next record is there) or lapped the follower (a newer one is:
    the whole ring is scanned again, its names are passed on first, then a
    GAP, then what was not read yet; what was lost is counted)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._data = map_trace_file(path)
        self.metadata, self._base, self._end, _ = read_header(path, self._data, written_only=False)
        self._offset: int | None = None
        self._expected = 0  # the sequence number of the next record
        self.lost = 0  # records the writer overwrote before they were read

    def close(self) -> None:
        self._data.close()

    def poll(self) -> list[tuple]:
        if self._offset is None:
            return self._resync()
        records: list[tuple] = []
        while True:
            got = record_at(self._data, self._offset, self._end)
            if got is None or got[0] != self._expected:
                # The writer may have wrapped: the next record is then at the ring's start.
                first = record_at(self._data, self._base, self._end)
                if first is not None and first[0] == self._expected and self._offset != self._base:
                    self._offset = self._base
                    continue
                if (got is not None and got[0] > self._expected) or (first is not None and first[0] > self._expected):
                    records.extend(self._resync())
                break
            sequence, record, self._offset = got
            self._expected = sequence + 1
            records.append(record)
        return records

    def _resync(self) -> list[tuple]:
        """From a scan of the whole ring: its names first (so that records
        whose SYMBOL was overwritten are still named), then the records not
        read yet. After a loss, the starts read before it may have lost their
        ends: a GAP first tells the assembler so."""
        entries, _ = scan(self._data, self._base, self._end)
        fresh = [(sequence, after, record) for sequence, after, record in entries if sequence >= self._expected]
        if not fresh:
            return []
        records = [record for _, _, record in entries if record[0] in _NAMES] + with_gaps(fresh)
        if self._offset is not None and fresh[0][0] > self._expected:
            self.lost += fresh[-1][0] + 1 - self._expected - len(fresh)
            records.insert(0, GAP)
        self._expected = fresh[-1][0] + 1
        self._offset = fresh[-1][1]
        return records


def parent_watch(pid: int) -> Callable[[], bool]:
    """Whether the process that writes the file still runs. A process that
    ended but was not reaped yet (a zombie) counts as ended."""
    started_by_it = pid == os.getppid()

    def alive() -> bool:
        if started_by_it and os.getppid() != pid:
            return False
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            pass
        try:
            with open(f"/proc/{pid}/stat", "rb") as handle:
                state = handle.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            return True  # no /proc: the signal test is all there is
        return state not in (b"Z", b"X")

    return alive


def writer_watch(path: str) -> Callable[[], bool]:
    """Whether the file's writer still runs, by the lock it holds while it
    lives (exact, unlike a pid that the system may give to another process);
    true until the file exists."""
    return lambda: not os.path.exists(path) or writer_alive(path)


def follow(path: str, exporter: SpanExporter, *, alive: Callable[[], bool] | None = None,
           interval: float = 0.2, wait_s: float = 60.0, kernels_only: bool = False) -> tuple[int, int, int]:
    """Exports the spans of the file at `path` as they end until `alive()`
    (default: the file's writer holds its lock) turns false, then those still
    in flight (status ERROR, in flight), and
    returns (spans sent, of which in flight, spans dropped). OTEL_TRACES_SAMPLER
    chooses the spans that ended, as it does in the application; calls in
    flight when the process ended are the crash and always go. With
    `kernels_only` (or from a MODE record on: the application installed its
    own provider after this package's) the ended spans of the application,
    which exports them itself, are left out; its spans in flight at the end,
    never exported by it, still go."""
    alive = alive or writer_watch(path)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):  # the writer creates it on its first record
        if not alive():
            return 0, 0, 0  # it ended without writing one
        if time.monotonic() > deadline:
            raise TraceFileError(f"{path}: no such file (waited {wait_s:g} s for it)")
        time.sleep(interval)
    follower = RingFollower(path)
    resource = FileResource(resource_attributes(follower.metadata))
    assembler = Assembler()
    sampler = ExportSampler()
    pending: list = []
    sent = dropped = 0
    failed_once = False
    try:
        while True:
            running = alive()  # asked before the poll, so that the last poll sees the last records
            for record in follower.poll():
                if record[0] == fmt.MODE:
                    kernels_only = kernels_only or record[1] == fmt.MODE_KERNELS_ONLY
                    continue
                pair = assembler.add(record)
                if pair is not None:
                    recovered = assembler.span(*pair)
                    if kernels_only and NAME not in recovered.attributes:
                        continue
                    span = readable(recovered, resource, assembler.last_time)
                    if sampler.keep(span):
                        pending.append(span)
            in_flight = []
            if not running:
                in_flight = [readable(span, resource, assembler.last_time) for span in assembler.in_flight()]
                pending.extend(in_flight)
            while pending:
                batch = pending[:BATCH]
                if exporter.export(batch) is not SpanExportResult.SUCCESS:
                    if not failed_once:
                        warn(f"follow {path}: the back end did not take {len(batch)} spans; retrying")
                        failed_once = True
                    break
                del pending[:BATCH]
                sent += len(batch)
            if len(pending) > _MAX_PENDING:
                dropped += len(pending) - _MAX_PENDING
                del pending[: len(pending) - _MAX_PENDING]
            if not running:
                dropped += len(pending)
                return sent, len(in_flight), dropped
            time.sleep(interval)
    finally:
        if follower.lost:
            warn(f"follow {path}: {follower.lost} records were overwritten before they were read, and "
                 f"{len(assembler.unsure)} spans whose end may have been among them were not exported "
                 "(a larger SGLANG_KERNEL_API_TRACEFILE_SIZE keeps more)")
        follower.close()
