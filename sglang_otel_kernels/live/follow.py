"""Following a live trace file and exporting its spans as they end
(`sglang-otel-kernels follow FILE`): OTLP export done by another process. In
sidecar mode (the default with an OTLP endpoint) the application starts one
per trace file, so encoding and sending spans costs the application nothing,
and when the application dies the sidecar exports the calls that were in
flight at once, marked as such.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import random
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from opentelemetry.sdk.metrics.export import MetricExporter
from opentelemetry.sdk.trace.export import SpanExporter

from ..notices import warn
from ..record.export import ExportSampler
from ..record.export_errors import export_batch
from ..recover.otlp_json import resource_attributes
from ..record import tracefile as fmt
from .._version import __version__
from ..schema import DEATH_SPAN, FATAL_SIGNAL, HUNG, IN_FLIGHT, IN_FLIGHT_SECONDS, NAME, TRACER_NAME
from ..recover.device_faults import mark_in_flight
from .ending_spans import EndingSpans
from ..record.ledger import Ledger
from .metrics import KernelMetrics, labels_of
from ..record.reader import (GAP, Assembler, RecoveredSpan, TraceFileError, death, map_trace_file, read_header,
                     payload_record, read_heartbeat, record_at, scan, with_gaps, writer_alive)
from ..recover.resend import BATCH, FileResource, readable
from ..recover.request_copies import RequestTraces
from .wire import KernelWire

# Spans kept for a back end that does not take them, then the oldest are dropped.
_MAX_PENDING = 50_000
_NAMES = (fmt.SYMBOL, fmt.TABLE, fmt.THREAD, fmt.IDENTITY, fmt.GRAPH)
_MAX_HUNG = 4096  # calls exported early and still running, remembered so each goes once
_PUMP_EVERY = 128  # queued spans between looks at the sends, while a poll's records are read
_RANK_RECORDS = (fmt.IDENTITY, fmt.TABLE)


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
        self.data = map_trace_file(path)
        self.metadata, self.base, self.end, _ = read_header(path, self.data, written_only=False)
        self._offset: int | None = None
        self._expected = 0  # the sequence number of the next record
        self.lost = 0  # records the writer overwrote before they were read

    def close(self) -> None:
        self.data.close()

    def poll(self) -> list[tuple]:
        if self._offset is None:
            return self._resync()
        records: list[tuple] = []
        while True:
            self._read_on(records)
            got = record_at(self.data, self._offset, self.end)
            if got is None or got[0] != self._expected:
                # The writer may have wrapped: the next record is then at the ring's start.
                first = record_at(self.data, self.base, self.end)
                if first is not None and first[0] == self._expected and self._offset != self.base:
                    self._offset = self.base
                    continue
                if (got is not None and got[0] > self._expected) or (first is not None and first[0] > self._expected):
                    records.extend(self._resync())
                break
            sequence, record, self._offset = got
            self._expected = sequence + 1
            records.append(record)
        return records

    def _read_on(self, records: list, _header=fmt.RECORD_HEADER, _magic=fmt.RECORD_MAGIC, _align=fmt.ALIGN) -> None:
        """The records that follow one another from where the last one read
        ended, as `record_at` would read them one by one, into `records`;
        it stops at the first that is not the next (`poll` looks why). Once
        per record a writer appends: the loop holds what it needs as locals."""
        data, end, offset, expected = self.data, self.end, self._offset, self._expected
        unpack, size, append = _header.unpack_from, _header.size, records.append
        while offset + size <= end:
            magic, length, sequence, crc, encoding = unpack(data, offset)
            start = offset + size
            if magic != _magic or sequence != expected or not length or start + length > end:
                break
            payload = data[start : start + length]  # copied, then checked: the writer may overwrite it
            record = payload_record(payload, payload, 0, length, crc, encoding)
            if record is None:
                break
            append(record)
            expected += 1
            offset = start + length + (-(size + length)) % _align
        self._offset, self._expected = offset, expected

    def _resync(self) -> list[tuple]:
        """From a scan of the whole ring: its names first (so that records
        whose SYMBOL was overwritten are still named), then the records not
        read yet. After a loss, the starts read before it may have lost their
        ends: a GAP first tells the assembler so."""
        entries, _ = scan(self.data, self.base, self.end)
        fresh = entries if not entries or entries[0][0] >= self._expected else [
            entry for entry in entries if entry[0] >= self._expected]
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


def hung_snapshot(span: RecoveredSpan, now: int) -> RecoveredSpan:
    """The early export of a kernel call still running at `now`: a span of
    its own whose parent is the call, with the call's name and attributes
    and `sglang.kernel.hung`, `in_flight`, `in_flight_seconds`. The call's
    own span, exported when it ends or its process dies, has the call's id:
    a back end then shows the snapshot inside the call, never beside it."""
    seconds = round(max(now - span.start_time, 0) / 1e9, 1)
    return dataclasses.replace(
        span, span_id=random.getrandbits(64) or 1, parent_span_id=span.span_id, parent_is_remote=False,
        parent_sampled=bool(span.trace_flags & 1), end_time=max(now, span.start_time), in_flight=False,
        status_code="UNSET", status_description="",
        attributes={**span.attributes, IN_FLIGHT: True, HUNG: True, IN_FLIGHT_SECONDS: seconds})


def death_span(when: int, signal: str) -> RecoveredSpan:
    """A death that left nothing in flight, as a span of its own (DEATH_SPAN)."""
    return RecoveredSpan(
        name=DEATH_SPAN, trace_id=random.getrandbits(128) or 1, span_id=random.getrandbits(64) or 1,
        parent_span_id=0, parent_is_remote=False, kind=0, start_time=when, end_time=when, status_code="ERROR",
        status_description="the process died with no kernel call or batch running",
        attributes={FATAL_SIGNAL: signal or "none"}, events=[], links=[], thread_id=0, thread_name=None,
        scope_name=TRACER_NAME, scope_version=__version__, trace_flags=1, in_flight=False)


def _still_running(assembler: Assembler, hung: set, now: int, hang_ns: int) -> list[RecoveredSpan]:
    """Kernel calls in flight for `hang_ns` or more at `now` not exported early yet."""
    hung.intersection_update(assembler.starts)  # ended calls are forgotten
    late = [start for start in assembler.kernel_calls_started_before(now - hang_ns + 1)
            if start[2] not in hung][: max(_MAX_HUNG - len(hung), 0)]
    hung.update(start[2] for start in late)
    return [hung_snapshot(assembler.span(start, None), now) for start in late]


class _Outbox:
    """Spans waiting for the back end, in order, with the trace file's span
    each one finishes delivering: the last span queued for a file span (its
    copies come after it) carries that span's id, which goes into the list
    of delivered spans once the back end took it (record/ledger.py)."""

    def __init__(self, ledger: "Ledger | None") -> None:
        self.spans: list = []
        self.finishing: list[int] = []  # per queued span: the file span it finishes, or 0
        self.ledger = ledger
        self._left: list[int] = []  # file spans the application's own exporter sends, not listed yet

    def queue(self, span, original: int) -> None:
        """One span; it finishes delivering `original` (0: none)."""
        self.spans.append(span)
        self.finishing.append(original)

    def leave(self, original: int) -> None:
        """A file span the application's own exporter sends: listed as
        delivered, a batch at a time, whatever the back end does."""
        if self.ledger is not None:
            self._left.append(original)
            if len(self._left) >= BATCH:
                self.delivered(0)

    def delivered(self, count: int, at: int = 0) -> None:
        """The `count` spans from `at` (0: the oldest) were taken by the back end."""
        done = [span_id for span_id in self.finishing[at : at + count] if span_id] + self._left
        self._left = []
        del self.spans[at : at + count], self.finishing[at : at + count]
        if self.ledger is not None:
            self.ledger.add(done)

    def drop_oldest(self, count: int, after: int = 0) -> None:
        """Drops `count` spans, the oldest past the first `after`."""
        del self.spans[after : after + count], self.finishing[after : after + count]


class _Sender:
    """The outbox's spans to the back end, a batch at a time, oldest first,
    on threads of their own, four batches on their way at most: the follower
    reads and encodes the next batches while the back end takes these (a
    send mostly waits on the network and the back end, without the GIL;
    several let a back end parse one while the next arrive: with two, a
    local receiver sharing 2 cores kept 35 000 to 40 000 level-3 spans a
    second, with four 48 000, bench/sidecar_rate.py --live). Their answers are
    settled in order, on the follower's thread, where what the back end took
    is listed delivered; a batch it did not take stays first in the outbox,
    and nothing more is started until `retry` (at each poll)."""

    _FLYING = 4

    def __init__(self, exporter: SpanExporter, outbox: _Outbox, path: str) -> None:
        self.exporter, self.outbox, self.path = exporter, outbox, path
        self.sent = 0
        self.running = True  # whether the writer still ran at the last poll (a refusal is retried)
        self._refused = False  # a batch the back end did not take: nothing more is started until `retry`
        self._causes: set = set()  # why batches were not taken, each said once
        self._flights: collections.deque = collections.deque()  # (the send's future, its span count), oldest first
        self._flying = 0  # spans on their way: the outbox's, after those `_kept`
        self._kept = 0  # spans first in the outbox that the back end did not take, to send again
        self._pool = ThreadPoolExecutor(self._FLYING, thread_name_prefix="sok-follow-send")

    def pump(self, partial: bool = False) -> None:
        """Without waiting: settles the batches the back end answered, and
        starts the next while a whole one is queued (or, `partial`, any)."""
        while self._flights and self._flights[0][0].done():
            self._settle()
        while not self._refused and len(self._flights) < self._FLYING:
            waiting = len(self.outbox.spans) - self._kept - self._flying
            if waiting < BATCH and not (partial and waiting > 0):
                return
            self._start()

    def retry(self) -> None:
        """Sends again, once the batches on their way are answered, what the back end did not take."""
        if self._refused and not self._flights:
            self._refused, self._kept = False, 0

    def drain(self) -> None:
        """Sends all that is queued, waiting for each batch; stops at a batch
        the back end did not take."""
        while self._flights:
            self._settle()
        self.retry()
        while True:
            self.pump(partial=True)
            if not self._flights:
                return
            self._settle()

    def trim(self, limit: int) -> int:
        """Drops the oldest queued spans beyond `limit`, not those on their
        way; how many it dropped."""
        excess = len(self.outbox.spans) - limit
        if excess <= 0:
            return 0
        first = min(excess, self._kept)  # those not taken, then those never sent
        self.outbox.drop_oldest(first)
        self._kept -= first
        rest = min(excess - first, len(self.outbox.spans) - self._kept - self._flying)
        self.outbox.drop_oldest(rest, after=self._kept + self._flying)
        return first + rest

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def _start(self) -> None:
        begin = self._kept + self._flying
        batch = self.outbox.spans[begin : begin + BATCH]
        self._flights.append((self._pool.submit(export_batch, self.exporter, batch), len(batch)))
        self._flying += len(batch)

    def _settle(self) -> None:
        """The oldest batch on its way, once answered (waiting for it)."""
        future, count = self._flights.popleft()
        why = future.result()
        self._flying -= count
        if why is None:
            self.outbox.delivered(count, at=self._kept)
            self.sent += count
            return
        self._refused = True
        self._kept += count
        if why not in self._causes:  # once per cause: a back end down for an hour is one line, not thousands
            self._causes.add(why)
            warn(f"follow {self.path}: the back end did not take {count} spans: {why}"
                 + ("; retrying" if self.running else ""))


def follow(path: str, exporter: SpanExporter, *, alive: Callable[[], bool] | None = None,
           interval: float = 0.2, wait_s: float = 60.0, kernels_only: bool = False,
           hang_seconds: float = 0.0, delivered_to: str | None = None,
           metrics: "MetricExporter | None" = None, ending_only: bool = False) -> tuple[int, int, int]:
    """Exports the spans of the file at `path` as they end until `alive()`
    (default: the file's writer holds its lock) turns false, then those still
    in flight (status ERROR, in flight, ending at the process's last sign of
    life), and returns (spans sent, of which in flight, spans dropped).
    OTEL_TRACES_SAMPLER chooses the spans that ended, as it does in the
    application; calls in flight when the process ended are the crash and
    always go, and so does the early export of a kernel call running for
    `hang_seconds` or more while the process lives (`hung_snapshot`; 0:
    none). A batched call that matters goes with its copies into the request
    traces of its batch (recover/request_copies.py). With `kernels_only` (or
    from a MODE record on: the application installed its own provider after
    this package's) the ended spans of the application, which exports them
    itself, are left out; its spans in flight at the end, never exported by
    it, still go. With `delivered_to` (the exporter's endpoint), what the
    back end took is listed beside the file (`FILE.delivered`), so that a
    later `replay` there sends only the rest. With `metrics`, the process's
    kernel calls are counted for alerts (live/metrics.py). With
    `ending_only` (an application whose own provider exports every span it
    ended, kernel calls included, from its process) nothing is read while
    the process lives: once it has ended, the file is read once and only
    what its exporter never had goes, the spans in flight at its end, with
    the gauges of how it ended: a crash pages, and while the process runs the
    follower only looks whether it still does, every `interval`."""
    alive = alive or writer_watch(path)
    deadline = time.monotonic() + wait_s
    while not os.path.exists(path):  # the writer creates it on its first record
        if not alive():
            return 0, 0, 0  # it ended without writing one
        if time.monotonic() > deadline:
            raise TraceFileError(f"{path}: no such file (waited {wait_s:g} s for it)")
        time.sleep(interval)
    follower = RingFollower(path)
    metadata = follower.metadata
    resource = FileResource(resource_attributes(metadata))
    assembler = Assembler()
    requests = RequestTraces(assembler.parent_of, assembler.linking_to)
    counted = None if metrics is None else KernelMetrics(metrics, resource, counting=not ending_only)
    ending_spans = None  # what the crash gauges' verdict needs, kept when there are gauges
    if counted is not None:
        counted.labels = labels_of(metadata)
        ending_spans = EndingSpans(assembler)
    sampler = ExportSampler()
    # The ring holds fewer spans than one per 48 bytes (a start and an end record each).
    outbox = _Outbox(None if delivered_to is None else
                     Ledger(path, metadata, delivered_to, (follower.end - follower.base) // 48))
    hung: set = set()
    hang_ns = int(hang_seconds * 1e9)
    dropped = 0
    sender = _Sender(exporter, outbox, path)
    seen_alive = 0  # when this follower last saw the process alive: a sign of life the file does not hold

    # Plain kernel calls go straight to OTLP's wire form, where the exporter takes it.
    wire = (KernelWire(assembler, resource, sampler, outbox.queue, counted)
            if getattr(exporter, "takes_encoded", False) and not ending_only else None)

    def queue(span: RecoveredSpan, now: int, always: bool = False) -> None:
        """A span of the file (or a hung call's early export) and its copies,
        the last of those queued finishing the span's delivery."""
        original = readable(span, resource, now)
        kept = always or sampler.keep(original)
        copies = [copy for copy in (readable(c, resource, now) for c in requests.copies(span))
                  if always or sampler.keep(copy)]
        last = span.span_id if kept and not (always and span.attributes.get(HUNG)) else 0
        if kept:
            outbox.queue(original, 0 if copies else last)
        for number, copy in enumerate(copies, 1):
            outbox.queue(copy, last if number == len(copies) else 0)

    add, take, queued, mode = assembler.add, None if wire is None else wire.take, outbox.spans, fmt.MODE
    try:
        while ending_only:  # its exporter has every span it ends: the file is read once it has ended
            asked = time.time_ns()
            if not alive():
                break
            seen_alive = asked
            time.sleep(interval)
        while True:
            asked, began = time.time_ns(), time.monotonic()
            running = alive()  # asked before the poll, so that the last poll sees the last records
            if running:
                seen_alive = asked
            sender.running = running
            sender.retry()
            records = follower.poll()
            for record in records:  # once per record: what it needs is bound to locals
                if record[0] == mode:
                    kernels_only = kernels_only or record[1] == fmt.MODE_KERNELS_ONLY
                    continue
                pair = add(record)
                if pair is not None:
                    if not len(queued) % _PUMP_EVERY:
                        sender.pump()
                    if take is not None and take(*pair):
                        if ending_spans is not None:
                            ending_spans.plain = pair
                        continue
                    recovered = assembler.span(*pair)
                    if counted is not None:
                        counted.count(recovered)
                        ending_spans.keep(recovered)
                    if ending_only or (kernels_only and NAME not in recovered.attributes):
                        outbox.leave(recovered.span_id)
                        continue
                    queue(recovered, assembler.last_time)
                elif record[0] in _RANK_RECORDS and assembler.identity != metadata.get("ranks"):
                    # Ranks learnt after start-up: on the resource of the spans from now on.
                    metadata = dict(metadata, ranks={**(metadata.get("ranks") or {}), **assembler.identity})
                    resource = FileResource(resource_attributes(metadata))
                    if wire is not None:
                        wire.resource = resource
                    if counted is not None:
                        counted.labels = labels_of(metadata)
            in_flight = 0
            if counted is not None and running:
                counted.flush()
                now = time.time_ns()
                counted.in_flight([assembler.span(start, None) for start in assembler.kernel_calls_started_before(now)],
                                  now)
            if running and hang_ns:
                now = time.time_ns()
                for span in _still_running(assembler, hung, now, hang_ns):
                    queue(span, now, always=True)
            if not running:
                last_alive = max(assembler.last_time, read_heartbeat(follower.data), seen_alive)
                left = assembler.in_flight()
                if counted is not None:
                    counted.in_flight([], last_alive)
                signal, died = "", 0
                if not assembler.exited:  # how it died, on each call it left in flight: a hang killed is no crash
                    died, signal = death(path, last_alive, left)
                    last_alive = died or last_alive
                    mark_in_flight(left, path, metadata)  # a CUDA core dump's fault, where one was written
                if counted is not None:
                    counted.ended(ending_spans.ending(path, metadata, left, last_alive, assembler.exited, died, signal))
                for span in left:
                    queue(span, last_alive, always=True)
                    in_flight += 1
                if not assembler.exited and not left and signal != "SIGTERM":
                    queue(death_span(last_alive, signal), last_alive, always=True)
            if running:  # what is left is sent while the next poll is read
                sender.pump(partial=True)
            else:
                sender.drain()
            dropped += sender.trim(_MAX_PENDING)
            if not running:
                dropped += len(outbox.spans)
                outbox.delivered(0)  # what was left to the application's exporter
                return sender.sent, in_flight, dropped
            if len(records) < BATCH:  # a busy writer is read again at once: a ring laps in a fraction of a second
                time.sleep(max(interval - (time.monotonic() - began), 0.0))
    finally:
        sender.close()
        if follower.lost:
            warn(f"follow {path}: {follower.lost} records were overwritten before they were read, and "
                 f"{len(assembler.unsure)} spans whose end may have been among them were not exported "
                 "(a larger SGLANG_KERNEL_API_TRACEFILE_SIZE keeps more)")
        follower.close()
        if outbox.ledger is not None:
            outbox.ledger.close()
        if counted is not None:
            counted.close()
