"""What a report needs of one file, made where the file is read.

A full 16 MiB trace file holds about ninety thousand spans; a report shows a
few of them (the calls in flight, the failed ones, the newest, the first to
make NaN/Inf, their batches and requests), counts them all per kernel, and
lines the ranks up by their newest collectives. A digest is that: the
file's metadata and the spans a report shows, with the per-kernel counts of
all of them. It is small, so the files of a job's ranks are read and
digested in parallel processes (`read_digests`) and only the digests cross
over: reading is what takes the time.
"""

from __future__ import annotations

import collections
import dataclasses
import multiprocessing
import os
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

from ..schema import (COLLECTIVE_GROUP, COLLECTIVE_OP, COLLECTIVE_PEER, COPY_OF, EXCEPTION_SPAN, GRAPH_REPLAY, NAME,
                      NONFINITE_FLAG, NONFINITE_LOGITS, STOP_SPAN)
from .batch_failures import is_batch
from .otlp_json import exported_ending, without_answered_snapshots
from ..record.reader import RecoveredSpan, TraceFileContents, TraceFileError

NEWEST_PER_THREAD = 200  # kernel calls of each thread (and of each process) a timeline draws
NEWEST_COLLECTIVES = 4096  # of each group (and point-to-point pair): enough to line ranks up and compare them
FIRST_LOGITS_MARKS = 64  # the NaN flags' marks of requests sampled from non-finite logits kept, the first
_ANCESTRY = 64  # parent hops kept above a shown call (its batch, its request)

# The process's own spans a report reads: why it was told to stop, the exceptions no code caught.
PROCESS_SPANS = frozenset({STOP_SPAN, EXCEPTION_SPAN})


@dataclasses.dataclass
class Digest:
    contents: TraceFileContents  # the file's metadata and the spans a report shows, in start order
    summary: dict[str, list]  # kernel name -> [calls, failed, in flight, total ns of the ended ones]
    spans: int  # spans in the file


def produced_nonfinite(span: RecoveredSpan) -> bool:
    """The call's output holds NaN/Inf and none of its inputs did (level 5),
    or its flags said NaN/Inf first in its step (the NaN flags)."""
    return span.attributes.get(NONFINITE_FLAG) is True or any(event[0] == "nonfinite_output" for event in span.events)


def digest(contents: TraceFileContents, last: int = 10) -> Digest:
    """The digest of one file's contents; `last`: how many of its newest ended calls a report lists."""
    keep: set[int] = set()
    shown: list[RecoveredSpan] = []  # calls a report describes, with their batch and request
    summary: dict[str, list] = {}
    newest = collections.deque(maxlen=max(last, NEWEST_PER_THREAD))
    by_thread: dict = {}
    by_group: dict = {}
    first_bad = newest_replay = None
    logits = 0
    # A copy in a request trace (an archive holds them) repeats a call: each call counts once.
    contents = dataclasses.replace(contents, spans=[span for span in contents.spans if COPY_OF not in span.attributes])
    for span in contents.spans:
        attributes = span.attributes
        if NAME not in attributes:
            if span.in_flight or (span.status_code == "ERROR" and is_batch(span)) or span.name in PROCESS_SPANS:
                keep.add(span.span_id)
            elif attributes.get(NONFINITE_LOGITS) is True and logits < FIRST_LOGITS_MARKS:
                keep.add(span.span_id)
                logits += 1
            continue
        row = summary.get(span.name)
        if row is None:
            row = summary[span.name] = [0, 0, 0, 0]
        row[0] += 1
        newest.append(span)
        thread = by_thread.get(span.thread_id)
        if thread is None:
            thread = by_thread[span.thread_id] = collections.deque(maxlen=NEWEST_PER_THREAD)
        thread.append(span)
        if COLLECTIVE_OP in attributes:
            key = (attributes.get(COLLECTIVE_GROUP), attributes[COLLECTIVE_OP], attributes.get(COLLECTIVE_PEER))
            group = by_group.get(key)
            if group is None:
                group = by_group[key] = collections.deque(maxlen=NEWEST_COLLECTIVES)
            group.append(span)
        elif GRAPH_REPLAY in attributes:
            newest_replay = span
        if span.in_flight:
            row[2] += 1
            shown.append(span)
            continue
        row[3] += span.end_time - span.start_time
        if span.status_code == "ERROR":
            row[1] += 1
            shown.append(span)
        if first_bad is None and produced_nonfinite(span):
            first_bad = span
            shown.append(span)
    shown.extend(newest)
    if newest_replay is not None:  # a dead process's newest replay may still have been running on the GPU
        shown.append(newest_replay)
    for thread in by_thread.values():
        shown.extend(thread)
    for group in by_group.values():
        keep.update(span.span_id for span in group)
    by_id = {span.span_id: span for span in contents.spans}
    for span in shown:
        hops = 0
        while span is not None and span.span_id not in keep and hops < _ANCESTRY:
            keep.add(span.span_id)
            span = by_id.get(span.parent_span_id)
            hops += 1
    kept = [span for span in contents.spans if span.span_id in keep]
    return Digest(dataclasses.replace(contents, spans=kept), summary, len(contents.spans))


def _read_and_digest(load: Callable, path: str, last: int) -> "list[Digest] | TraceFileError":
    try:
        return [digest(contents, last) for contents in load(path)]
    except TraceFileError as exc:  # the caller says it, in the order of the files
        return exc


def read_digests(load: Callable, paths: list[str], last: int) -> "list[list[Digest] | TraceFileError]":
    """Each file read by `load(path)` (a list of contents) and digested, in
    as many processes as there are cores (one file: here); per file its
    digests, or the TraceFileError that reading it raised."""
    workers = min(len(paths), os.cpu_count() or 1)
    if workers > 1:
        try:
            # fork: the workers have this process's modules already; nothing else runs here.
            context = multiprocessing.get_context("fork")
            with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
                return list(pool.map(_read_and_digest, [load] * len(paths), paths, [last] * len(paths)))
        except (OSError, ValueError, ImportError, RuntimeError):
            pass  # no process pool here (no semaphores, no fork, a worker killed): one file after the other
    return [_read_and_digest(load, path, last) for path in paths]


def add_counts(total: dict[str, list], summary: dict[str, list]) -> None:
    """Adds a digest's per-kernel counts to `total` (same shape)."""
    for name, row in summary.items():
        into = total.setdefault(name, [0, 0, 0, 0])
        for index, value in enumerate(row):
            into[index] += value


def _process_key(contents: TraceFileContents) -> "tuple | None":
    """Who wrote the spans of an OTLP JSON file's process, to find it in other
    files; None for a trace file (one process's alone) or an unknown pid."""
    metadata = contents.metadata
    if metadata.get("format") != "OTLP JSON" or metadata.get("pid") is None:
        return None
    return (str(metadata.get("host")), str(metadata.get("pid")), repr(sorted((metadata.get("ranks") or {}).items())))


def merge_processes(digests: list[Digest], last: int = 10) -> list[Digest]:
    """The digests of one process that several OTLP JSON files hold part of
    (each gateway of a two-tier layout archives the traces routed to it) made
    one, in the order first seen: its kept spans together (a span archived
    twice, by a retry, once) and digested again, its counts summed."""
    groups: dict = {}
    for item in digests:
        key = _process_key(item.contents)
        groups.setdefault(id(item) if key is None else key, []).append(item)
    merged = []
    for group in groups.values():
        if len(group) == 1:
            merged.append(group[0])
            continue
        by_id: dict[int, RecoveredSpan] = {}
        for item in group:
            for span in item.contents.spans:
                if span.span_id not in by_id or by_id[span.span_id].in_flight:  # an ended copy says more
                    by_id[span.span_id] = span
        first = group[0].contents
        spans = sorted(without_answered_snapshots(list(by_id.values())), key=lambda span: span.start_time)
        # How it ended, from all its spans: the calls its sidecar sent in flight at its death may all be in a
        # file other than the first (routed by their traces), which alone reads as a process that ended.
        contents = dataclasses.replace(
            first, path=f"{first.path} (and {len(group) - 1} more file(s))", spans=spans,
            records=sum(item.contents.records for item in group), skipped=sum(item.contents.skipped for item in group),
            problems=list(dict.fromkeys(p for item in group for p in item.contents.problems)),
            last_time=max(item.contents.last_time for item in group), **exported_ending(spans))
        summary: dict[str, list] = {}
        for item in group:
            add_counts(summary, item.summary)
        merged.append(Digest(digest(contents, last).contents, summary, sum(item.spans for item in group)))
    return merged
