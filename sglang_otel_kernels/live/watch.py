"""`sglang-otel-kernels watch PATH...`: the cross-rank verdict of a live job,
kept up to date where a team looks.

Each live trace file under the paths (one node's files, or a directory all
nodes write to) is followed as it is written (live/follow.py's
RingFollower): the calls the verdict needs are kept, bounded (the calls in
flight, the newest ended ones, each group's newest collectives, the failed
ones), and every `interval` the verdict of each job (recover/ranks.py) is
made again. A verdict that changed (its suspects, who everyone waits for,
the ranks without a file) is printed as one line and exported through OTLP
as a span `sglang.verdict` (ERROR when it names a suspect) with the suspect,
why, its call, for how long and the sentence, linked to the suspect's call
in flight, so the verdict sits in Jaeger beside the hung spans it explains.
Files that no live process writes when found are left alone: the watch is
about a job that runs (a job that dies while watched gets its last verdict).
"""

from __future__ import annotations

import collections
import glob
import os
import random
import threading
import time
from typing import Callable

from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from .._version import __version__
from ..record.export_errors import export_batch
from ..schema import COLLECTIVE_GROUP, COLLECTIVE_OP, COLLECTIVE_PEER, NAME, TRACER_NAME
from ..recover.batch_failures import is_batch
from ..recover.digest import PROCESS_SPANS
from .follow import RingFollower
from ..recover.ranks import cross_rank, timestamp
from ..record.reader import Assembler, TraceFileContents, TraceFileError, note_death, read_heartbeat, writer_alive

VERDICT = "sglang.verdict"
NEWEST_CALLS = 200  # ended kernel calls a file keeps for the verdict (it reads the newest)
NEWEST_PER_GROUP = 64  # ended collectives of each group and pair
NEWEST_FAILED = 256  # failed calls and batches, stops and uncaught exceptions
_SCOPE = InstrumentationScope(TRACER_NAME, __version__)


class LiveFile:
    """One rank's trace file followed as it is written, with what the
    verdict needs of it (bounded whatever the file holds)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.follower = RingFollower(path)
        self.assembler = Assembler()
        self.calls: collections.deque = collections.deque(maxlen=NEWEST_CALLS)
        self.failed: collections.deque = collections.deque(maxlen=NEWEST_FAILED)
        self.groups: dict[tuple, collections.deque] = {}

    def poll(self) -> None:
        for record in self.follower.poll():
            pair = self.assembler.add(record)
            if pair is None:
                continue
            span = self.assembler.span(*pair)
            attributes = span.attributes
            if NAME not in attributes:
                # As `report` reads them: a failed batch, why the process was told to stop, an uncaught exception.
                if span.name in PROCESS_SPANS or (span.status_code == "ERROR" and is_batch(span)):
                    self.failed.append(span)
                continue
            if COLLECTIVE_OP in attributes:
                key = (attributes.get(COLLECTIVE_GROUP), attributes[COLLECTIVE_OP], attributes.get(COLLECTIVE_PEER))
                group = self.groups.get(key)
                if group is None:
                    group = self.groups[key] = collections.deque(maxlen=NEWEST_PER_GROUP)
                group.append(span)
            else:
                self.calls.append(span)
            if span.status_code == "ERROR":
                self.failed.append(span)

    def contents(self) -> TraceFileContents:
        """What the file holds for the verdict now: the kept calls and those in flight."""
        assembler = self.assembler
        kept = {span.span_id: span for span in (*self.calls, *self.failed,
                                                 *(span for group in self.groups.values() for span in group))}
        # The calls in flight, and the batches: a death between kernel calls is one in a batch.
        kept.update((span.span_id, span) for span in assembler.in_flight() if NAME in span.attributes or is_batch(span))
        metadata = dict(self.follower.metadata)
        if assembler.identity:
            metadata["ranks"] = {**(metadata.get("ranks") if isinstance(metadata.get("ranks"), dict) else {}),
                                 **assembler.identity}
        contents = TraceFileContents(
            self.path, metadata, sorted(kept.values(), key=lambda span: span.start_time), records=0, skipped=0,
            problems=[], last_time=assembler.last_time, live=writer_alive(self.path),
            heartbeat=read_heartbeat(self.follower.data), exited=assembler.exited, stacks=dict(assembler.stacks))
        if not contents.live and not contents.exited:
            note_death(contents)
        return contents

    def close(self) -> None:
        self.follower.close()


def trace_files(paths: list[str]) -> list[str]:
    """The trace files a watch looks at: those named, and every `*.sgltrace` of a directory named."""
    found = []
    for path in paths:
        if os.path.isdir(path):
            found.extend(sorted(glob.glob(os.path.join(glob.escape(path), "*.sgltrace"))))
        else:
            found.append(path)
    return found


def _key(verdict: dict) -> tuple:
    """What makes a verdict new: its suspects (a call that raised, then its
    batch failing, are two), who the others wait for, which ranks have no file."""
    waiting, slow = verdict.get("waiting_for"), verdict.get("slow")
    return (tuple((s["rank"], s["reason"], s["call"], s.get("batch")) for s in verdict["suspects"]),
            tuple(waiting["ranks"]) if waiting else (), tuple(verdict.get("missing_ranks") or ()),
            (slow["rank"], slow["call"], slow["frozen"]) if slow else ())


def verdict_span(verdict: dict, contents: list[TraceFileContents], now: int, resource: Resource,
                 since: "int | None" = None) -> ReadableSpan:
    """The span `sglang.verdict` of a new verdict: ERROR with its first
    suspect (its rank, host and pid), linked to that rank's call in flight.
    It lasts from the first sign of what it says (the suspect's call or wait
    began that many seconds ago) or else from `since` (the evaluation
    before, when the verdict was still the old one) to `now`."""
    attributes = {"sglang.job": str(verdict["job"]), "sglang.verdict.detail": verdict["verdict"]}
    links = []
    status = Status(StatusCode.UNSET)
    suspect = verdict["suspects"][0] if verdict["suspects"] else None
    waiting = verdict.get("waiting_for")
    seconds = None
    if suspect is not None:
        status = Status(StatusCode.ERROR, verdict["verdict"][:1000])
        attributes.update({"sglang.verdict.rank": suspect["rank"], "sglang.verdict.reason": suspect["reason"],
                           "sglang.verdict.suspects": len(verdict["suspects"])})
        for rank in verdict["ranks"]:
            if rank["rank"] == suspect["rank"]:
                attributes.update({key: value for key, value in (("sglang.verdict.host", rank.get("host")),
                                                                 ("sglang.verdict.pid", rank.get("pid")))
                                   if type(value) in (str, int)})
                break
        if suspect["call"] is not None:
            attributes["sglang.verdict.call"] = suspect["call"]
        if suspect["seconds"] is not None:
            seconds = attributes["sglang.verdict.seconds"] = float(suspect["seconds"])
        files = {rank["file"] for rank in verdict["ranks"] if rank["rank"] == suspect["rank"]}
        for content in contents:
            if content.path in files:
                links += [Link(SpanContext(span.trace_id, span.span_id, True, TraceFlags(1)),
                               {"sglang.rank": suspect["rank"]})
                          for span in content.spans if span.in_flight and span.name == suspect["call"]][:8]
    elif waiting is not None:
        seconds = float(waiting["seconds"])
        attributes.update({"sglang.verdict.rank": waiting["ranks"][0], "sglang.verdict.reason": "waited_for",
                           "sglang.verdict.seconds": seconds})
    elif verdict.get("slow"):  # in a call, or frozen, for long: not a hang yet
        slow = verdict["slow"]
        seconds = float(slow["seconds"])
        attributes.update({"sglang.verdict.rank": slow["rank"], "sglang.verdict.reason": "slow",
                           "sglang.verdict.seconds": seconds})
        if slow["call"] is not None:
            attributes["sglang.verdict.call"] = slow["call"]
    else:
        attributes["sglang.verdict.reason"] = "none"
    start = now - int(seconds * 1e9) if seconds else since if since is not None and since < now else now - 1000
    context = SpanContext(random.getrandbits(128) or 1, random.getrandbits(64) or 1, False, TraceFlags(1))
    return ReadableSpan(VERDICT, context=context, parent=None, resource=resource, attributes=attributes, links=links,
                        kind=SpanKind.INTERNAL, status=status, start_time=min(start, now - 1000), end_time=now,
                        instrumentation_scope=_SCOPE)


IDLE_S = 8.0  # nothing live followed this long: said once (then again after something live is gone)


def _idle_words(paths: list[str], files: int) -> str:
    shown = " ".join(paths)
    if not files:
        return (f"no trace file in {shown} yet (*.sgltrace); still watching for new ones: start the job with "
                "SGLANG_KERNEL_API_TRACEFILE pointing there, or give the directory it writes to")
    return (f"nothing live in {shown}: {files} trace file(s), no process writing one now; still watching for new "
            f"ones. What ended is read with: sglang-otel-kernels report {shown}")


def watch(paths: list[str], *, interval: float, hang_seconds: float, stop: threading.Event,
          exporter: SpanExporter | None = None, resource: Resource | None = None,
          say: Callable[[str], None] = print, on_verdicts: Callable[[list[dict]], None] | None = None) -> int:
    """Watches until `stop` is set; returns how many new verdicts it saw.
    `on_verdicts` gets every evaluation's verdicts (the metrics)."""
    resource = resource or Resource.create({})
    followed: dict[str, LiveFile] = {}
    ignored: set[str] = set()  # files no live process wrote when found
    jobs_seen_live: set = set()
    said: dict = {}
    evaluated: dict = {}  # job -> when its verdict was last made
    new = 0
    causes: set = set()  # why verdicts were not taken, each said once
    idle_since, idle_said = time.monotonic(), False  # nothing live followed since then; said so
    try:
        while True:
            for path in trace_files(paths):
                if path in followed or path in ignored:
                    continue
                if not writer_alive(path):
                    ignored.add(path)
                    continue
                try:
                    followed[path] = LiveFile(path)
                except TraceFileError:
                    continue  # being created: the next round
            for live in followed.values():
                live.poll()
            contents = [live.contents() for live in followed.values()]
            now = time.time_ns()
            verdicts = cross_rank(contents, hang_seconds, now)
            for verdict in verdicts:
                job, since = verdict["job"], evaluated.get(verdict["job"])
                evaluated[job] = now
                if any(rank["state"] in ("running", "frozen") for rank in verdict["ranks"]):
                    jobs_seen_live.add(job)
                if job not in jobs_seen_live or said.get(job) == _key(verdict):
                    continue
                said[job] = _key(verdict)
                new += 1
                say(f"{timestamp(now, date=False)} job {job}: {verdict['verdict']}")
                why = None if exporter is None else export_batch(exporter, [verdict_span(verdict, contents, now,
                                                                                          resource, since)])
                if why is not None and why not in causes:
                    causes.add(why)
                    say(f"(the OTLP back end did not take the verdict: {why}; it is printed here, and tried again "
                        "with the next one)")
            if on_verdicts is not None:
                on_verdicts(verdicts)
            live, moment = any(content.live for content in contents), time.monotonic()
            if live:
                idle_since, idle_said = moment, False
            elif not idle_said and moment - idle_since >= IDLE_S:
                idle_said = True
                say(_idle_words(paths, len(followed) + len(ignored)))
            # Nothing live: new files are looked for every second, so a job that starts is followed at once.
            pause = interval if live else min(interval, 1.0)
            if stop.wait(pause):
                return new
    finally:
        for live in followed.values():
            live.close()
