"""The cross-rank verdict: the trace files of one job's ranks lined up by
their collectives, as PyTorch's Flight Recorder analyzer lines up its
per-rank rings, with the kernels beside them, so that one sentence names the
rank and the kernel at fault.

A job's ranks are the files whose process knew its global rank (from
torch.distributed, else `RANK`); files of one job share its rendezvous and
overlap in time, so two jobs in one directory (or one job restarted) are
never mixed. For each group (a process group, SGLang's GroupCoordinator) the
ranks are compared at the newest sequence number any of them entered: who
waits in it, who failed in it, who never entered it and what that rank does
instead. Point-to-point ops pair the n-th send from a to b with the n-th
recv on b from a. Every sequence number two ranks both hold is checked for
another op, shapes or dtypes. A wait counts as a hang once it lasted
`hang_seconds` (in a live process) or its process is dead.

Suspects, most likely first: a rank that died in a kernel or raised first
(by time); a rank missing from a collective the others wait in, which is not
itself waiting for another (a victim is not a culprit); a rank whose
collective disagrees with the others'; a rank waiting in a collective every
member entered; ranks waiting for each other (a deadlock); a rank that died
or raised inside a collective nothing else explains. Torch-free.
"""

from __future__ import annotations

import os
import time
from collections import Counter, defaultdict
from typing import Any

from ..schema import (COLLECTIVE_GROUP as GROUP, COLLECTIVE_GROUP_RANKS as GROUP_RANKS,
                      COLLECTIVE_INPUT_DTYPES as INPUT_DTYPES, COLLECTIVE_INPUT_SHAPES as INPUT_SHAPES,
                      COLLECTIVE_OP as OP, COLLECTIVE_OUTPUT_DTYPES as OUTPUT_DTYPES,
                      COLLECTIVE_OUTPUT_SHAPES as OUTPUT_SHAPES, COLLECTIVE_PEER as PEER, COLLECTIVE_REDUCE_OP as REDUCE_OP,
                      COLLECTIVE_ROOT as ROOT, COLLECTIVE_SEQ as SEQ, COLLECTIVE_TAG as TAG, NAME, RECVS, SENDS, STOP_REASON,
                      STOP_SPAN)
from .batch_failures import (after_failure, after_failure_text, at_death_words, batch_words, culprit_of, culprit_text,
                             failure_of, is_batch, request_ids, stage_of)
from ..record.reader import RecoveredSpan, TraceFileContents, where_written
# Ops whose tensors may differ in size from rank to rank (uneven splits).
_UNEVEN = ("all_to_all", "all_to_all_single", "all_gatherv", "reduce_scatterv")
MAX_MISMATCHES = 20
STACK_LINES = 12  # frames of a suspect's stack the text lists


def rank_of(contents: TraceFileContents) -> int | None:
    """The global rank a file's process had, if it knew one."""
    return rank_of_metadata(contents.metadata)


def rank_of_metadata(metadata: dict) -> int | None:
    """The global rank a file's header (and the IDENTITY records after it) says."""
    ranks = metadata.get("ranks")
    value = ranks.get("rank") if isinstance(ranks, dict) else None
    if isinstance(value, str) and value.isdigit():
        value = int(value)
    return value if type(value) is int and value >= 0 else None


_MAX_WORLD = 1 << 16  # a world size past this is a damaged (or crafted) file's


def _world_size(files: list[TraceFileContents]) -> int | None:
    """The job's world size, as its ranks' files say most often."""
    sizes = Counter()
    for content in files:
        ranks = content.metadata.get("ranks")
        value = ranks.get("world_size") if isinstance(ranks, dict) else None
        if isinstance(value, str) and value.isdigit():
            value = int(value)
        if type(value) is int and 0 < value <= _MAX_WORLD:
            sizes[value] += 1
    return sizes.most_common(1)[0][0] if sizes else None


def _job_key(contents: TraceFileContents) -> str:
    ranks = contents.metadata.get("ranks") or {}
    job = ranks.get("job")
    world = ranks.get("world_size")
    return str(job) if job else f"world size {world}" if world is not None else "unknown job"


# A live process whose heartbeat (once a second) is older than this is
# frozen: a thread holds the GIL (in C code) and no Python runs.
FROZEN_NS = int(5e9)


def state_of(contents: TraceFileContents, now: int) -> str:
    """running, frozen (alive, its heartbeat stopped), ended (exited
    normally), stopped (on purpose: ended by the SIGTERM it recorded, or told
    to stop, then exited or was killed while stopping; `stop_reason`) or died."""
    if contents.live:
        return "frozen" if contents.heartbeat and now - contents.heartbeat > FROZEN_NS else "running"
    if stop_reason(contents) is not None:
        return "stopped"
    return "ended" if contents.exited else "stopped" if contents.fatal_signal == "SIGTERM" else "died"


def stop_reason(contents: TraceFileContents) -> "str | None":
    """Why the process was told to stop (its last STOP_SPAN: "SIGTERM", an
    engine's shutdown request), or None: never told."""
    for span in reversed(contents.spans):
        if span.name == STOP_SPAN:
            reason = span.attributes.get(STOP_REASON)
            return reason[:200] if isinstance(reason, str) and reason else "stop requested"
    return None


def silent_stack(contents: TraceFileContents, kernels: list[RecoveredSpan]) -> "tuple | None":
    """(frames, silent since) of the thread that made the newest kernel
    call, where it waited after its last record, if the heartbeat wrote it."""
    if not kernels or not contents.stacks:
        return None
    thread = max(kernels, key=lambda span: span.end_time or span.start_time).thread_id
    found = contents.stacks.get(thread)
    if found is None:
        return None
    written, since, frames = found
    active = max((span.end_time or span.start_time) for span in kernels if span.thread_id == thread)
    # A stack written before the thread's newest record is out of date: it did something since.
    return (frames, max(since, active)) if written >= active and frames else None


def stack_text(frames: tuple, shown: int = 3) -> str:
    """`wait_for_nothing (job.py:41) <- step (job.py:60)`: the innermost frames."""
    return " <- ".join(f"{function} ({os.path.basename(file)}:{line})" for file, line, function in frames[:shown])


class RankFile:
    """One rank's file, with what the verdict needs of it."""

    def __init__(self, contents: TraceFileContents, rank: int, now: int) -> None:
        self.contents = contents
        self.rank = rank
        self.pid = contents.metadata.get("pid")
        self.path = contents.path
        # Running times end now for a live process, else at its last sign of life.
        self.now = now if contents.live else contents.last_alive
        self.state = state_of(contents, now)
        self.kernels = [span for span in contents.spans if NAME in span.attributes]
        self.stack = silent_stack(contents, self.kernels)
        self.in_flight = [span for span in self.kernels if span.in_flight]
        self.failed = [span for span in self.kernels if not span.in_flight and span.status_code == "ERROR"]
        batches = [span for span in contents.spans if NAME not in span.attributes and is_batch(span)]
        self.failed_batches = [span for span in batches if not span.in_flight and span.status_code == "ERROR"]
        self.batches_in_flight = [span for span in batches if span.in_flight]
        # (group, ranks) or ("p2p", group, ranks, src, dst, tag) -> {seq: span}
        self.collectives: dict[tuple, dict[int, RecoveredSpan]] = defaultdict(dict)
        for span in self.kernels:
            if OP in span.attributes:
                key = collective_key(span, rank)
                if key is not None:
                    self.collectives[key][span.attributes[SEQ]] = span

    def seconds(self, span: RecoveredSpan) -> float:
        end = span.end_time if span.end_time is not None else max(self.now, span.start_time)
        return (end - span.start_time) / 1e9

    def innermost(self, spans: list[RecoveredSpan]) -> RecoveredSpan | None:
        return max(spans, key=lambda span: span.start_time, default=None)


def collective_key(span: RecoveredSpan, rank: int) -> tuple | None:
    """Where a collective span is counted: its group, or for a point-to-point
    op its group, sender, receiver and tag; None for any other span or one
    whose attributes are malformed (a file is hostile input)."""
    attributes = span.attributes
    op, group, seq = attributes.get(OP), attributes.get(GROUP), attributes.get(SEQ)
    members = attributes.get(GROUP_RANKS, ())
    if type(op) is not str or type(group) is not str or type(seq) is not int or not isinstance(members, tuple):
        return None
    members = tuple(member for member in members if type(member) is int)
    if op in SENDS or op in RECVS:
        peer = attributes.get(PEER)
        if type(peer) is not int:
            peer = -1  # a recv from any source
        source, destination = (rank, peer) if op in SENDS else (peer, rank)
        return ("p2p", group, members, source, destination, attributes.get(TAG, 0))
    return (group, members)


def _signature(span: RecoveredSpan) -> dict[str, Any]:
    """What must agree across ranks at one sequence number."""
    attributes = span.attributes
    op = attributes.get(OP)
    fields = {"op": op, "input dtypes": attributes.get(INPUT_DTYPES), "output dtypes": attributes.get(OUTPUT_DTYPES),
              "reduce op": attributes.get(REDUCE_OP), "root": attributes.get(ROOT)}
    if op not in _UNEVEN:
        fields["input shapes"] = attributes.get(INPUT_SHAPES)
        fields["output shapes"] = attributes.get(OUTPUT_SHAPES)
    return fields


def _p2p_signature(span: RecoveredSpan) -> dict[str, Any]:
    attributes = span.attributes
    return {"shapes": attributes.get(INPUT_SHAPES), "dtypes": attributes.get(INPUT_DTYPES)}


def _shown(value: Any) -> str:
    if isinstance(value, tuple):
        return ", ".join(str(item) for item in value) if value else "none"
    return str(value)


def _ranks_text(ranks) -> str:
    ranks = sorted(ranks)
    return f"rank {ranks[0]}" if len(ranks) == 1 else "ranks " + ", ".join(str(rank) for rank in ranks)


def _seconds_text(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"


def timestamp(ns: int, date: bool = True) -> str:
    """Local time to the microsecond: `2026-12-01 14:03:05.123456`, or without the date."""
    seconds, rest = divmod(ns, 1_000_000_000)
    return time.strftime("%Y-%m-%d %H:%M:%S" if date else "%H:%M:%S", time.localtime(seconds)) + f".{rest // 1000:06d}"


def _op_text(span: RecoveredSpan) -> str:
    attributes = span.attributes
    op, seq = attributes.get(OP), attributes.get(SEQ)
    if op in SENDS:
        return f"{op} #{seq} to rank {attributes.get(PEER)}"
    if op in RECVS:
        return f"{op} #{seq} from rank {attributes.get(PEER)}"
    return f"{op} #{seq} of group {attributes.get(GROUP)}"


def group_jobs(contents: list[TraceFileContents]) -> list[list[TraceFileContents]]:
    """The ranked files of each job: the same rendezvous and overlapping in
    time, each rank once (a rank seen again starts another run of the job).
    Forked children, which inherit their parent's rank, are no ranks."""
    by_key: dict[str, list[TraceFileContents]] = defaultdict(list)
    for content in contents:
        if rank_of(content) is not None and "forked_from" not in content.metadata:
            by_key[_job_key(content)].append(content)
    jobs: list[list[TraceFileContents]] = []
    for files in by_key.values():
        first = {id(c): c.spans[0].start_time if c.spans else c.last_alive for c in files}  # spans in start order
        files.sort(key=lambda c: first[id(c)])
        runs: list[tuple[int, set, list]] = []  # (end of the run so far, its ranks, its files)
        for content in files:
            start = first[id(content)]
            rank = rank_of(content)
            for index, (end, ranks, members) in enumerate(runs):
                if start <= end and rank not in ranks:
                    ranks.add(rank)
                    members.append(content)
                    runs[index] = (max(end, content.last_alive if not content.live else time.time_ns()), ranks, members)
                    break
            else:
                runs.append((content.last_alive if not content.live else time.time_ns(), {rank}, [content]))
        jobs.extend(members for _, _, members in runs)
    return jobs


class _Verdict:
    """The analysis of one job's ranks (see the module's docstring)."""

    def __init__(self, files: list[TraceFileContents], hang_seconds: float, now: int) -> None:
        self.hang_seconds = hang_seconds
        self.ranks = {rank_of(c): RankFile(c, rank_of(c), now) for c in files}
        self.world = _world_size(files)
        self.collectives: list[dict] = []  # the newest state of each group and pair, where not all is done
        self.waits: dict[int, list[tuple]] = defaultdict(list)  # rank -> (span, missing ranks, entry)
        self.mismatches: list[dict] = []
        self._analyse_groups()
        self._analyse_pairs()
        # Ranks of the job (its world size, its groups' members) that no file given is of.
        known = set(range(self.world or 0)).union(*(entry["members"] for entry in self.collectives))
        self.missing_ranks = sorted(known - set(self.ranks))
        self.suspects = self._suspects()

    # -- facts ------------------------------------------------------------

    def _hang(self, rank: RankFile, span: RecoveredSpan) -> bool:
        return not rank.contents.live or rank.seconds(span) >= self.hang_seconds

    def _analyse_groups(self) -> None:
        keys = {key for rank in self.ranks.values() for key in rank.collectives if key[0] != "p2p"}
        for key in sorted(keys, key=str):
            group, members = key
            members = members or tuple(r for r, f in self.ranks.items() if key in f.collectives)
            present = [self.ranks[m] for m in members if m in self.ranks]
            entered = {r.rank: max(r.collectives[key], default=0) if key in r.collectives else 0 for r in present}
            self._check_mismatches(group, key, present)
            newest = max(entered.values(), default=0)
            if not newest:
                continue
            waiting, failed, done, missing = [], [], [], []
            for rank in present:
                span = rank.collectives.get(key, {}).get(newest)
                if span is None:
                    missing.append(rank.rank)
                elif span.in_flight:
                    waiting.append((rank, span))
                elif span.status_code == "ERROR":
                    failed.append((rank, span))
                else:
                    done.append(rank.rank)
            if not waiting and not failed and not missing:
                continue  # done on every rank with a file
            sample = (waiting or failed)[0][1] if waiting or failed else None
            op = sample.attributes.get(OP) if sample is not None else self._op_at(present, key, newest)
            entry = {"group": group, "seq": newest, "op": op, "members": list(members),
                     "waiting": sorted(r.rank for r, _ in waiting), "missing": sorted(missing),
                     "failed": sorted(r.rank for r, _ in failed), "done": sorted(done),
                     "no_file": sorted(m for m in members if m not in self.ranks),
                     "seconds": round(max((r.seconds(s) for r, s in waiting), default=0.0), 1)}
            entry["hang"] = any(self._hang(r, s) for r, s in waiting)
            self.collectives.append(entry)
            for rank, span in waiting:
                self.waits[rank.rank].append((span, missing + entry["no_file"], entry))

    @staticmethod
    def _op_at(present: list[RankFile], key: tuple, seq: int) -> str | None:
        for rank in present:
            span = rank.collectives.get(key, {}).get(seq)
            if span is not None:
                return span.attributes.get(OP)
        return None

    def _check_mismatches(self, group: str, key: tuple, present: list[RankFile]) -> None:
        """Every sequence number two or more ranks hold: op, shapes, dtypes agree?"""
        seqs = set()
        for rank in present:
            seqs.update(rank.collectives.get(key, ()))
        for seq in sorted(seqs):
            spans = {r.rank: r.collectives[key][seq] for r in present if seq in r.collectives.get(key, {})}
            if len(spans) > 1:
                self._compare(group, seq, spans, _signature)

    def _compare(self, group: str, seq: int, spans: dict[int, RecoveredSpan], signature) -> None:
        signatures = {rank: signature(span) for rank, span in spans.items()}
        fields = next(iter(signatures.values())).keys()
        for field in fields:
            values = {rank: sig.get(field) for rank, sig in signatures.items()}
            if len({repr(value) for value in values.values()}) < 2:
                continue
            counts = Counter(repr(value) for value in values.values())
            top, top_count = counts.most_common(1)[0]
            tie = list(counts.values()).count(top_count) > 1
            odd = sorted(rank for rank, value in values.items() if tie or repr(value) != top)
            first = min(spans.values(), key=lambda span: span.start_time)
            if len(self.mismatches) < MAX_MISMATCHES:
                self.mismatches.append({
                    "group": group, "seq": seq, "op": first.attributes.get(OP), "field": field,
                    "values": {str(rank): _shown(value) for rank, value in sorted(values.items())},
                    "odd": odd, "time": first.start_time})
            return  # one field is enough to tell the collective apart

    def _analyse_pairs(self) -> None:
        keys = {key for rank in self.ranks.values() for key in rank.collectives if key[0] == "p2p"}
        for key in sorted(keys, key=str):
            _, group, members, source, destination, _ = key
            sender, receiver = self.ranks.get(source), self.ranks.get(destination)
            sends = sender.collectives.get(key, {}) if sender else {}
            recvs = receiver.collectives.get(key, {}) if receiver else {}
            for seq in sorted(set(sends) & set(recvs)):
                self._compare(group, seq, {source: sends[seq], destination: recvs[seq]}, _p2p_signature)
            newest_send, newest_recv = max(sends, default=0), max(recvs, default=0)
            if newest_send == newest_recv:
                continue
            # One side is ahead: its newest op has no partner.
            ahead, span, behind, seq = ((sender, sends[newest_send], destination, newest_send)
                                        if newest_send > newest_recv else
                                        (receiver, recvs[newest_recv], source, newest_recv))
            if ahead is None or (not span.in_flight and span.status_code != "ERROR"):
                continue  # an async op that completed (isend into a buffer): nothing waits
            waiting = [(ahead, span)] if span.in_flight else []
            entry = {"group": group, "seq": seq, "op": span.attributes.get(OP), "members": [source, destination],
                     "source": source, "destination": destination,
                     "waiting": [ahead.rank] if waiting else [], "missing": [behind] if behind in self.ranks else [],
                     "failed": [] if waiting else [ahead.rank], "done": [],
                     "no_file": [] if behind in self.ranks else [behind],
                     "seconds": round(ahead.seconds(span), 1) if waiting else 0.0}
            entry["hang"] = bool(waiting) and self._hang(ahead, span)
            self.collectives.append(entry)
            if waiting:
                self.waits[ahead.rank].append((span, [behind], entry))

    # -- suspects ------------------------------------------------------------

    def _hung_waits(self, rank: int) -> list[tuple]:
        return [wait for wait in self.waits.get(rank, ()) if wait[2]["hang"]]

    @staticmethod
    def _frozen(rank: RankFile) -> str:
        beat = rank.contents.heartbeat
        return (f"frozen: its heartbeat stopped at {timestamp(beat, date=False)}, "
                f"{_seconds_text((rank.now - beat) / 1e9)} ago (a thread holds the GIL)")

    def _death(self, rank: RankFile, call: RecoveredSpan, what: str) -> tuple[str, str]:
        """(reason, words) for a rank that died in `call` (`what`: its name
        as shown): it crashed (a fatal signal recorded), was killed while
        stuck (none recorded, the call past the hang threshold), or died."""
        running, signal = _seconds_text(rank.seconds(call)), rank.contents.fatal_signal
        if signal:
            return "crashed", f"crashed in {what} ({signal}, running {running} when it was last alive)"
        if signal == "" and rank.seconds(call) >= self.hang_seconds:
            return ("killed_while_stuck",
                    f"was stuck in {what} for {running} when it was killed from outside (no fatal signal recorded)")
        unsaid = "; no fatal signal recorded" if signal == "" else ""
        return "died", f"died in {what} (running {running} when it was last alive{unsaid})"

    def _doing(self, rank: RankFile) -> str:
        """What a rank does instead of joining: its call in flight, where it
        waits silently (the heartbeat's stack), or its state."""
        alive = rank.state in ("running", "frozen")
        frozen = f"; {self._frozen(rank)}" if rank.state == "frozen" else ""
        call = rank.innermost([s for s in rank.in_flight if OP not in s.attributes])
        if call is not None:
            running = _seconds_text(rank.seconds(call))
            if alive:
                return f"is stuck in {call.name} (running {running}{frozen})"
            if rank.state == "died":
                return self._death(rank, call, call.name)[1]
            return f"was in {call.name} when it exited (running {running})"
        collective = rank.innermost([s for s in rank.in_flight if OP in s.attributes])
        if collective is not None:
            return f"waits in {_op_text(collective)} (running {_seconds_text(rank.seconds(collective))}{frozen})"
        if rank.stack is not None:
            frames, since = rank.stack
            silent = _seconds_text(max(rank.now - since, 0) / 1e9)
            if alive:
                return f"is in {stack_text(frames)}, silent for {silent}{frozen}"
            return f"was in {stack_text(frames)} when it {'died' if rank.state == 'died' else 'exited'}, " \
                   f"silent for {silent}"
        if rank.state == "frozen":
            return f"is {self._frozen(rank)}"
        if rank.state == "died":
            return (f"died with no call in flight (last alive at {timestamp(rank.contents.last_alive, date=False)})"
                    f"{ending_text(rank.contents.fatal_signal)}")
        if rank.state == "ended":
            return f"ended normally (at {timestamp(rank.contents.last_alive, date=False)})"
        if rank.state == "stopped":
            return (f"was stopped on purpose (at {timestamp(rank.contents.last_alive, date=False)})"
                    f"{ending_text(rank.contents.fatal_signal, stop_reason(rank.contents))}")
        last = max((s.end_time or 0 for s in rank.kernels), default=0)
        since = f"; its last call ended {_seconds_text((rank.now - last) / 1e9)} ago" if last else ""
        return f"is idle (no call in flight{since})"

    def _missing_text(self, entry: dict, waiters: list[int]) -> str:
        """`never entered all_reduce #5 of group tp, which ranks 0, 1, 3 wait in`."""
        live = any(self.ranks[rank].contents.live for rank in waiters if rank in self.ranks)
        verb = ("wait in" if len(waiters) > 1 else "waits in") if live else "waited in"
        if "source" in entry:
            if entry["op"] in SENDS:
                return (f"never posted recv #{entry['seq']} from rank {entry['source']}, which {verb} "
                        f"{entry['op']} #{entry['seq']} to it")
            return (f"never sent #{entry['seq']} to rank {entry['destination']}, which {verb} "
                    f"{entry['op']} #{entry['seq']} from it")
        return f"never entered {entry['op']} #{entry['seq']} of group {entry['group']}, which {_ranks_text(waiters)} {verb}"

    def _no_file_text(self, entries: list[dict]) -> str:
        """`no file for ranks 2, 3 of 4 (the likely culprits); ranks 0, 1 wait in all_reduce #5 of group tp for them`."""
        missing = self.missing_ranks
        several = len(missing) > 1
        of = f" of {self.world}" if self.world else ""
        text = f"no file for {_ranks_text(missing)}{of} (the likely culprit{'s' if several else ''})"
        if entries:
            entry = max(entries, key=lambda e: (bool(e["waiting"]), e["seconds"]))
            waiters = entry["waiting"] or entry["failed"]
            live = any(self.ranks[r].contents.live for r in waiters if r in self.ranks)
            verb = ("failed in" if not entry["waiting"] else
                    ("wait in" if len(waiters) > 1 else "waits in") if live else "waited in")
            where = (f"{entry['op']} #{entry['seq']}" + (f" of group {entry['group']}" if "source" not in entry else ""))
            text += f"; {_ranks_text(waiters)} {verb} {where} for {'them' if several else 'it'}"
        return text

    @staticmethod
    def _mismatch_text(mismatch: dict, rank: int) -> str:
        """`rank 3's all_reduce #5 of group tp has input shapes (8,), ranks 0, 1, 2 have (4,)`."""
        values = mismatch["values"]
        own = values[str(rank)]
        others = sorted(int(r) for r in values if values[r] != own)
        other_value = values[str(others[0])] if others else "?"
        return (f"rank {rank}'s {mismatch['op']} #{mismatch['seq']} of group {mismatch['group']} has "
                f"{mismatch['field']} {own}, {_ranks_text(others)} {'has' if len(others) == 1 else 'have'} "
                f"{other_value}")

    def _suspects(self) -> list[dict]:
        found: list[tuple[tuple, dict]] = []  # (order, suspect)

        def add(order: tuple, rank: RankFile, reason: str, call: RecoveredSpan | None, detail: str,
                batch: "str | None" = None) -> None:
            suspect = {"rank": rank.rank, "reason": reason, "call": call.name if call else None,
                       "seconds": round(rank.seconds(call), 1) if call else None, "detail": detail}
            if batch is not None:  # the failed batch the call was in
                suspect["batch"] = batch
            if rank.stack is not None:  # where its thread waited once it recorded nothing more
                suspect["stack"] = [{"function": function, "file": file, "line": line}
                                    for file, line, function in rank.stack[0]]
            found.append((order, suspect))

        missing_from = defaultdict(list)  # rank -> hung entries it never entered
        for waiter, waits in self.waits.items():
            for span, missing, entry in waits:
                if entry["hang"]:
                    for rank in missing:
                        if rank in self.ranks and entry not in missing_from[rank]:
                            missing_from[rank].append(entry)
        failed_entries = defaultdict(list)  # rank -> entries others failed in that it never entered
        for entry in self.collectives:
            if entry["failed"]:
                for rank in entry["missing"]:
                    failed_entries[rank].append(entry)

        def also(rank: RankFile) -> str:
            parts = []
            for entry in missing_from.get(rank.rank, []) + failed_entries.get(rank.rank, []):
                waiters = entry["waiting"] or entry["failed"]
                if entry["waiting"]:
                    parts.append(self._missing_text(entry, waiters))
                else:
                    parts.append(f"never entered {entry['op']} #{entry['seq']} of group {entry['group']}, "
                                 f"which {_ranks_text(waiters)} entered and failed in")
            return "; it " + "; it ".join(parts[:3]) if parts else ""

        # 1. Died in, or raised from, a kernel that is no collective, or in a batch: first by time.
        for rank in self.ranks.values():
            kernels = [s for s in rank.in_flight if OP not in s.attributes]
            call = rank.innermost(kernels)
            if call is not None and rank.state == "died":
                reason, words = self._death(rank, call, call.name)
                add((1, call.start_time), rank, reason, call,
                    f"rank {rank.rank} {words}{self._serving(rank)}{also(rank)}")
                continue
            failed = min(rank.failed_batches, key=lambda s: s.end_time or 0, default=None)
            inside, _, where = failure_of(failed, rank.contents.spans) if failed is not None else (None, [], "")
            if failed is not None and (inside is None or OP not in inside.attributes):  # a collective's: a victim
                add((1, failed.end_time or failed.start_time), rank, "raised", inside or failed,
                    f"rank {rank.rank}'s {batch_words(failed.name, request_ids(failed), stage_of(failed))} failed in "
                    f"{where}: {failed.status_description}{culprit_text(culprit_of(inside))}{also(rank)}", failed.name)
                continue
            raised = min((s for s in rank.failed if OP not in s.attributes), key=lambda s: s.end_time or 0, default=None)
            if raised is not None:
                add((1, raised.end_time or raised.start_time), rank, "raised", raised,
                    f"rank {rank.rank} raised in {raised.name}: {raised.status_description}"
                    f"{culprit_text(culprit_of(raised))}{also(rank)}")
        # 1b. Ranks with no file, when ranks with one wait for them or something went wrong: what they did
        # is unknown, and those that wait are victims, never the culprit.
        unexplained = [e for e in self.collectives if e["no_file"] and (e["waiting"] or e["failed"])]
        if self.missing_ranks and (unexplained or any(r.state == "died" or r.failed for r in self.ranks.values())):
            detail = self._no_file_text(unexplained)
            for number in self.missing_ranks:
                found.append(((1.5, number), {"rank": number, "reason": "no_file", "call": None, "seconds": None,
                                              "detail": detail}))
        mismatched_ranks = {(m["group"], m["seq"], rank): m for m in self.mismatches for rank in m["odd"]}
        # 2. Missing from a collective others have waited in too long, not waiting for another itself.
        for rank_number, entries in missing_from.items():
            rank = self.ranks[rank_number]
            if self._hung_waits(rank_number):
                continue  # a victim: it waits in a collective of its own
            # Collectives first, then sends it never received: what a reader looks for first.
            entries = sorted(entries, key=lambda e: ("source" in e, e["op"] not in SENDS, -e["seconds"]))
            entry = entries[0]
            missing = "; it ".join(self._missing_text(e, e["waiting"]) for e in entries[:3])
            behind = rank.innermost([s for s in rank.in_flight if s.attributes.get(GROUP) == entry["group"]
                                     and s.attributes.get(OP) not in SENDS + RECVS])
            mismatch = behind is not None and mismatched_ranks.get((entry["group"], behind.attributes.get(SEQ), rank.rank))
            if mismatch:  # it is still in an earlier collective the others left: the one it got wrong
                add((2, -entry["seconds"]), rank, "mismatch", behind,
                    f"{self._mismatch_text(mismatch, rank.rank)}; it still waits in it (running "
                    f"{_seconds_text(rank.seconds(behind))}) and {missing}")
                continue
            call = rank.innermost([s for s in rank.in_flight if OP not in s.attributes]) or behind
            add((2, -entry["seconds"]), rank, "missing", call, f"rank {rank.rank} {self._doing(rank)} and {missing}")
        # 3. A collective that disagrees with the others' at the same number.
        for mismatch in self.mismatches:
            for rank_number in mismatch["odd"]:
                add((3, mismatch["time"]), self.ranks[rank_number], "mismatch", None,
                    self._mismatch_text(mismatch, rank_number))
        mismatched = {(m["group"], m["seq"]) for m in self.mismatches}
        # 4. Waiting in a collective every member entered (and no mismatch explains it).
        for rank_number, waits in self.waits.items():
            for span, missing, entry in waits:
                if entry["hang"] and not missing and (entry["group"], entry["seq"]) not in mismatched:
                    rank = self.ranks[rank_number]
                    add((4, span.start_time), rank, "stuck in collective", span,
                        f"rank {rank_number} waits in {_op_text(span)} (running {_seconds_text(rank.seconds(span))}), "
                        f"which every member entered")
        # 5. Everyone waits for someone who waits: a deadlock.
        if not found:
            cycle = [r for r in self.ranks if self._hung_waits(r) and r in missing_from]
            for rank_number in cycle:
                span, missing, entry = self._hung_waits(rank_number)[0]
                rank = self.ranks[rank_number]
                add((5, span.start_time), rank, "deadlock", span,
                    f"rank {rank_number} waits in {_op_text(span)} for {_ranks_text(missing)}, "
                    f"which {'waits' if len(missing) == 1 else 'wait'} in turn (a deadlock)")
        # 4b. Hung on its own: a live rank in a call past the threshold, or frozen that long (a
        # single-rank server has no collective to wait in; its hang is a call or a stopped heartbeat).
        for rank in self.ranks.values():
            hung = self._hung_alone(rank)
            if hung is not None:
                call, words = hung
                add((4.5, call.start_time if call is not None else rank.contents.heartbeat), rank, "hung", call,
                    f"rank {rank.rank} {words}")
        # 6. Died or raised inside a collective that nothing else explains; died
        # while a batch ran, between kernel calls (the engine's own Python).
        if not found:
            for rank in self.ranks.values():
                collective = rank.innermost([s for s in rank.in_flight if OP in s.attributes])
                if collective is not None and rank.state == "died" and self._hang(rank, collective):
                    reason, words = self._death(rank, collective, _op_text(collective))
                    add((6, collective.start_time), rank, reason, collective, f"rank {rank.rank} {words}")
                failed = min((s for s in rank.failed if OP in s.attributes), key=lambda s: s.end_time or 0,
                             default=None)
                if failed is not None:
                    add((6, failed.end_time or 0), rank, "raised", failed,
                        f"rank {rank.rank} raised in {_op_text(failed)}: {failed.status_description}")
                batch = rank.innermost(rank.batches_in_flight)
                if batch is not None and rank.state == "died" and not rank.in_flight:
                    add((6, batch.start_time), rank, "died", batch,
                        f"rank {rank.rank} died{ending_text(rank.contents.fatal_signal)} "
                        f"{at_death_words(batch.name, request_ids(batch), stage_of(batch))} "
                        f"(running {_seconds_text(rank.seconds(batch))}, between kernel calls)")
                elif rank.state == "died" and not rank.in_flight:
                    # Killed idle (the OOM killer, a kill -9): a death all the same, of no request.
                    add((7, rank.contents.last_alive), rank, "died_idle", None,
                        f"rank {rank.rank} {idle_death_words(rank)}")
        suspects, seen = [], set()
        for _, suspect in sorted(found, key=lambda item: item[0]):
            if suspect["rank"] not in seen:
                seen.add(suspect["rank"])
                suspects.append(suspect)
        return suspects

    def _alone(self, rank: RankFile) -> "tuple[RecoveredSpan | None, float] | None":
        """(its call in flight that is no collective, or None; for how long it
        has run or the rank been frozen, the longer) of a live rank waiting in
        no collective (one that does is judged with its group: a victim, or
        the one the others wait for); None for any other rank."""
        if not rank.contents.live or any(OP in s.attributes for s in rank.in_flight):
            return None
        call = rank.innermost(rank.in_flight)
        silent = (rank.now - rank.contents.heartbeat) / 1e9 if rank.state == "frozen" else 0.0
        return call, max(rank.seconds(call) if call is not None else 0.0, silent)

    def _hung_alone(self, rank: RankFile) -> "tuple[RecoveredSpan | None, str] | None":
        """(its call in flight or None, words) for a live rank hung on its own:
        in a call that is no collective past the threshold, or frozen that
        long; None otherwise."""
        alone = self._alone(rank)
        if alone is None or alone[1] < self.hang_seconds:
            return None
        call, seconds = alone
        if call is None:
            return None, (f"is {self._frozen(rank)}, past the {self.hang_seconds:g} s that makes a hang"
                          f"{self._serving(rank)}")
        return call, (f"is stuck in {call.name} (running {_seconds_text(rank.seconds(call))}, past the "
                      f"{self.hang_seconds:g} s that makes a hang{self._frozen_words(rank)}){self._serving(rank)}")

    def _frozen_words(self, rank: RankFile) -> str:
        return f"; {self._frozen(rank)}" if rank.state == "frozen" else ""

    @staticmethod
    def _serving(rank: RankFile) -> str:
        """`, while its batch sglang.forward_batch served request c-long`, or nothing."""
        batch = rank.innermost(rank.batches_in_flight)
        return f", {at_death_words(batch.name, request_ids(batch), stage_of(batch))}" if batch is not None else ""

    def slow(self) -> dict | None:
        """Under the threshold of a hang, in a live job: the rank longest in
        a call that is no collective, or frozen, for at least a twentieth of
        the threshold (a second at least); None when none is. What a hang
        looks like before it is one: never "no suspect"."""
        least = max(1.0, self.hang_seconds / 20)
        found = None
        for rank in self.ranks.values():
            alone = self._alone(rank)
            if alone is None or not least <= alone[1] < self.hang_seconds:
                continue
            call, seconds = alone
            if found is None or seconds > found["seconds"]:
                found = {"rank": rank.rank, "seconds": round(seconds, 1), "call": call.name if call else None,
                         "frozen": rank.state == "frozen", "hang_at": self.hang_seconds,
                         "words": (f"rank {rank.rank} " + (f"has been in {call.name} for {_seconds_text(seconds)}"
                                                           f"{self._frozen_words(rank)}" if call is not None else
                                                           f"is {self._frozen(rank)}")
                                   + f"{self._serving(rank)}; a hang at {self.hang_seconds:g} s")}
        return found

    # -- the verdict -------------------------------------------------------

    def waiting_for(self) -> dict | None:
        """Under the threshold of a hang, in a live job: the longest wait in
        a collective that a rank with a file has not entered yet, and what
        that rank does meanwhile; None when no collective waits on a rank
        for long: a twentieth of the threshold, at least a second (a healthy
        job's collectives wait milliseconds)."""
        least = max(1.0, self.hang_seconds / 20)
        entries = [e for e in self.collectives if e["waiting"] and e["missing"] and not e["hang"]
                   and e["seconds"] >= least]
        if not entries:
            return None
        entry = max(entries, key=lambda e: e["seconds"])
        return {"ranks": entry["missing"], "waiting": entry["waiting"], "op": entry["op"], "seq": entry["seq"],
                "group": entry["group"] if "source" not in entry else None, "seconds": entry["seconds"],
                "where": self._where(self.ranks[entry["missing"][0]]), "hang_at": self.hang_seconds}

    def _where(self, rank: RankFile) -> str:
        """Where a rank is, in a few words: `in layer.stuck for 39 s`, `waiting in all_reduce #4 of group tp`."""
        call = rank.innermost([s for s in rank.in_flight if OP not in s.attributes])
        if call is not None:
            return f"in {call.name} for {_seconds_text(rank.seconds(call))}"
        collective = rank.innermost([s for s in rank.in_flight if OP in s.attributes])
        if collective is not None:
            return f"waiting in {_op_text(collective)}"
        return "in no recorded call"

    def sentence(self) -> str:
        if self.suspects:
            return self.suspects[0]["detail"]
        states = Counter(rank.state for rank in self.ranks.values())
        shown = ", ".join(f"{count} {state}" for state, count in sorted(states.items()))
        absent = f"; no file for {_ranks_text(self.missing_ranks)}" if self.missing_ranks else ""
        laggard = self.waiting_for()
        slow = self.slow() if laggard is None else None
        if slow is not None:
            return slow["words"] + absent
        if laggard is not None:
            waiters = laggard["waiting"]
            where = f"{laggard['op']} #{laggard['seq']}" + (f" of group {laggard['group']}" if laggard["group"] else "")
            return (f"{_ranks_text(waiters)} {'have' if len(waiters) > 1 else 'has'} waited "
                    f"{_seconds_text(laggard['seconds'])} in {where} for {_ranks_text(laggard['ranks'])} "
                    f"({laggard['where']}); a hang at {self.hang_seconds:g} s{absent}")
        waiting = [entry for entry in self.collectives if entry["waiting"]]
        if waiting:
            longest = max(entry["seconds"] for entry in waiting)
            return (f"no suspect: {len(self.ranks)} ranks ({shown}); collectives in progress, the longest "
                    f"wait {_seconds_text(longest)}, under the {self.hang_seconds:g} s that makes a hang{absent}")
        return f"no suspect: {len(self.ranks)} ranks ({shown}), no collective waiting, none failed{absent}"

    def as_dict(self, job: str) -> dict[str, Any]:
        ranks = []
        for number in sorted(self.ranks):
            rank = self.ranks[number]
            last: dict[str, dict] = {}
            for key, by_seq in rank.collectives.items():
                if key[0] == "p2p" or not by_seq:
                    continue
                seq = max(by_seq)
                span = by_seq[seq]
                last[key[0]] = {"op": span.attributes.get(OP), "seq": seq,
                                "state": "waiting" if span.in_flight else "failed" if span.status_code == "ERROR"
                                else "done"}
            ranks.append({
                "rank": number, "pid": rank.pid, "host": rank.contents.metadata.get("host"),
                "file": rank.path, "state": rank.state,
                "fatal_signal": rank.contents.fatal_signal if rank.state in ("died", "stopped") else None,
                "stop_reason": stop_reason(rank.contents) if rank.state == "stopped" else None,
                "after_failure": after_failure(rank.contents),
                "ranks": {k: v for k, v in (rank.contents.metadata.get("ranks") or {}).items() if k != "job"},
                "in_flight": [{"name": s.name, "seconds": round(rank.seconds(s), 1),
                               "collective": _op_text(s) if OP in s.attributes else None}
                              for s in sorted(rank.in_flight, key=lambda s: s.start_time)],
                "failed": len(rank.failed), "last_collectives": last,
            })
        return {"job": job, "verdict": self.sentence(), "hang_seconds": self.hang_seconds, "ranks": ranks,
                "world_size": self.world, "missing_ranks": self.missing_ranks, "waiting_for": self.waiting_for(),
                "slow": self.slow(),
                "collectives": self.collectives,
                "mismatches": [{k: v for k, v in m.items() if k != "time"} for m in self.mismatches],
                "suspects": self.suspects}


def cross_rank(contents: list[TraceFileContents], hang_seconds: float, now: int | None = None) -> list[dict]:
    """One verdict per job among the files, jobs with a suspect first."""
    now = time.time_ns() if now is None else now
    verdicts = []
    for files in group_jobs(contents):
        verdicts.append(_Verdict(files, hang_seconds, now).as_dict(_job_key(files[0])))
    verdicts.sort(key=lambda v: not v["suspects"])
    return verdicts


def idle_death_words(rank: "RankFile") -> str:
    """`died at 12:00:03.120000 with no kernel call or batch running (no fatal
    signal recorded: killed from outside), 20 s after its last call ended`."""
    contents = rank.contents
    last = max((s.end_time or 0 for s in rank.kernels), default=0)
    since = _seconds_text(max(contents.last_alive - last, 0) / 1e9)
    after = f", {since} after its last kernel call ended" if last else ""
    return (f"died at {timestamp(contents.last_alive, date=False)} with no kernel call or batch running"
            f"{killed_text(contents.fatal_signal)}{after}")


def killed_text(signal: "str | None") -> str:
    """`ending_text` of a process that died with nothing running, where no
    signal recorded means it was killed from outside."""
    return " (no fatal signal recorded: killed from outside)" if signal == "" else ending_text(signal)


def ending_text(signal: str | None, stop: str | None = None) -> str:
    """` (told to stop: SGLang's ShutdownReq)`, ` (SIGSEGV recorded)`, ` (no
    fatal signal recorded)`, or nothing when not known: how a process that is
    gone ended."""
    if stop:
        return f" (told to stop: {stop})"
    return f" ({signal} recorded)" if signal else " (no fatal signal recorded)" if signal == "" else ""


def render(verdict: dict) -> list[str]:
    """The verdict as text: its sentence first, then the ranks, groups, suspects."""
    lines = [verdict["verdict"], f"  job {verdict['job']}: {len(verdict['ranks'])} rank(s)"]
    for rank in verdict["ranks"]:
        doing = "; ".join(f"in {c['collective'] or c['name']} for {c['seconds']} s" for c in rank["in_flight"][-2:])
        last = ", ".join(f"{v['op']} #{v['seq']} of {g} ({v['state']})" for g, v in rank["last_collectives"].items())
        lines.append(f"  rank {rank['rank']}: {rank['state']}{after_failure_text(rank.get('after_failure'))}"
                     f"{ending_text(rank.get('fatal_signal'), rank.get('stop_reason'))}, "
                     f"{where_written(rank['pid'], rank['file'])}"
                     + (f"; {doing}" if doing else "") + (f"; last collective {last}" if last else ""))
    for entry in verdict["collectives"]:
        if entry["waiting"] or entry["failed"]:
            parts = []
            if entry["waiting"]:
                parts.append(f"{_ranks_text(entry['waiting'])} waiting ({entry['seconds']} s"
                             + ("" if entry["hang"] else ", not a hang yet") + ")")
            if entry["failed"]:
                parts.append(f"{_ranks_text(entry['failed'])} failed")
            if entry["missing"]:
                parts.append(f"never entered: {_ranks_text(entry['missing'])}")
            if entry["no_file"]:
                parts.append(f"no file for {_ranks_text(entry['no_file'])}")
            where = (f"{entry['op']} #{entry['seq']} rank {entry['source']} -> {entry['destination']}"
                     if "source" in entry else f"{entry['op']} #{entry['seq']} of group {entry['group']}")
            lines.append(f"  {where}: " + "; ".join(parts))
    for mismatch in verdict["mismatches"]:
        values = ", ".join(f"rank {rank} {value}" for rank, value in mismatch["values"].items())
        lines.append(f"  mismatch at {mismatch['op']} #{mismatch['seq']} of group {mismatch['group']}: "
                     f"{mismatch['field']}: {values}")
    if verdict["suspects"]:
        lines.append("  suspects, most likely first:")
        for number, suspect in enumerate(verdict["suspects"], 1):
            lines.append(f"    {number}. rank {suspect['rank']} ({suspect['reason']}): {suspect['detail']}")
            stack = suspect.get("stack") or []
            if stack:
                lines.append("       its thread's stack when it went silent (innermost first):")
            lines.extend(f"         {frame['function']} ({frame['file']}:{frame['line']})" for frame in stack[:STACK_LINES])
            if len(stack) > STACK_LINES:
                lines.append(f"         ... and {len(stack) - STACK_LINES} more frames (report --json has them all)")
    return lines
