"""What happened to the processes a report read, decided once.

`build_report` gathers the facts (calls in flight, failed calls and batches,
the cross-rank suspects, uncaught exceptions, device faults, the first
NaN/Inf); `decide` reads them in one order of precedence and says what
happened as plain data: its kind, one headline sentence and the exit
status. The text report's first line, the page's banner, `report --json`'s
`verdict` and `report`'s exit status render it; none decides again.

Kinds: `crashed` (a process died in a kernel call, in a batch, or with a
device fault), `hung` (a rank in a collective, or alone in a call or frozen,
past the threshold; a process with no rank in a call that long), `mismatch`
(ranks disagree on a collective), `failed` (a batch, a call or a thread
raised), `died` (a process died with nothing running, or after a CUDA graph
replay), `nonfinite` (a call made NaN/Inf from finite inputs), `waiting` (a
live job slow, not a hang yet), `clean`. The first that applies, in this
order: a job's suspect (its kind by its reason), then crashed, failed,
died, nonfinite, hung, waiting, clean. Torch-free.
"""

from __future__ import annotations

from typing import Any

from .batch_failures import at_death_words, culprit_text, failure_sentence, requests_text, uncaught_sentence
from .ranks import ending_text, killed_text
from ..record.reader import where_written

# `report`'s exit status of each kind (its --help says them).
EXIT_STATUS = {"crashed": 1, "hung": 1, "mismatch": 1, "died": 1, "failed": 1, "nonfinite": 3, "waiting": 0,
               "clean": 0}
# What the cross-rank analysis calls its suspects, as a kind.
_SUSPECT_KINDS = {"crashed": "crashed", "killed_while_stuck": "crashed", "died": "crashed", "died_idle": "died",
                  "raised": "failed", "mismatch": "mismatch", "missing": "hung", "stuck in collective": "hung",
                  "deadlock": "hung", "hung": "hung", "no_file": "hung"}


def decide(report: dict[str, Any]) -> dict[str, Any]:
    """`{"kind", "headline", "exit_status", "file"}` of a report
    (`build_report`'s facts): `file`, the trace file the headline is about
    (None when it is about none or several)."""
    kind, headline, path = _first(report)
    live = [info for info in report["files"] if info.get("running")]
    if path is not None and kind not in ("waiting", "clean") and live and all(info["path"] != path for info in live) \
            and not _same_job_live(report, path):
        # A server restarted over a crashed one's directory, or two sharing it: the live one first, the
        # finding dated (its process is gone).
        pids = ", ".join(str(info["pid"]) for info in live[:4]) + (" and more" if len(live) > 4 else "")
        ended = next((info.get("ended_at") for info in report["files"] if info["path"] == path), None)
        headline = (f"pid {pids} {'is' if len(live) == 1 else 'are'} running; another process, gone"
                    + (f" since {ended}" if ended else "") + f": {headline}")
    return {"kind": kind, "headline": headline, "exit_status": EXIT_STATUS[kind], "file": path}


def ending(info: dict[str, Any]) -> dict[str, Any]:
    """How one process ended, from its entry of the report's `files`:
    `kind` (running, frozen; exited; stopped on purpose; raised: exited right
    after a failure it did not go on from, or after an exception no code
    caught; killed: died with no fatal signal recorded, as SIGKILL and the
    OOM killer leave it; crashed: died of one), its `signal`, `died_in` (the
    kernel call in flight at its death), `why` (the failure's exception
    type, else the signal, else "killed"), `call` (the kernel call that
    failed, else its last one) and whether it `pages`: a death in or after
    kernel calls, or an end by a failure; a process that made no kernel
    call and raised nothing (a server's front end) pages for nothing. The
    sidecar's crash gauges render it (live/metrics.py)."""
    state, after, uncaught = info["state"], info.get("after_failure"), info.get("uncaught") or ()
    ended_by = after if after and not after.get("went_on") else None  # a failure it never went on from
    if state in ("running", "frozen", "stopped") or (state == "ended" and not ended_by and not uncaught):
        return {"kind": "exited" if state == "ended" else state, "signal": None, "died_in": None, "why": None,
                "call": None, "pages": False}
    call = (ended_by and ended_by.get("call")) or info.get("last_call")
    if state == "ended":
        why = ended_by["exception"] if ended_by else uncaught[-1]["exception"]["type"] or "an exception"
        return {"kind": "raised", "signal": None, "died_in": None, "why": why, "call": call, "pages": True}
    signal = info.get("fatal_signal") or None
    died_in = info.get("died_in")
    return {"kind": "crashed" if signal else "killed", "signal": signal, "died_in": died_in,
            "why": ended_by["exception"] if ended_by else signal or "killed", "call": call,
            "pages": bool(died_in or call or uncaught)}


def _same_job_live(report: dict[str, Any], path: str) -> bool:
    """Whether a live rank shares the job of the rank that wrote `path`."""
    for job in report.get("cross_rank_jobs") or ():
        files = {rank["file"] for rank in job["ranks"]}
        if path in files:
            return any(rank["state"] in ("running", "frozen") for rank in job["ranks"])
    return False


def _first(report: dict[str, Any]) -> "tuple[str, str, str | None]":
    """(kind, headline, file) of the most serious finding."""
    jobs = report.get("cross_rank_jobs") or ()
    stopped = {info["path"] for info in report["files"] if info.get("state") == "stopped"}
    for job in jobs:  # the jobs with a suspect come first
        if job["suspects"]:
            suspect = job["suspects"][0]
            path = next((rank["file"] for rank in job["ranks"] if rank["rank"] == suspect["rank"]), None)
            return _SUSPECT_KINDS.get(suspect["reason"], "hung"), job["verdict"], path
    dead = [call for call in report["in_flight"] if call["in_flight_in_dead_process"] and call["file"] not in stopped]
    if dead:
        return "crashed", died_in_words(dead[0], _info(report, dead[0]["file"])), dead[0]["file"]
    for batch in report.get("batches_at_death") or ():
        info = _info(report, batch["file"])
        return ("crashed", f"the process died {at_death_words(batch['name'], batch['request_ids'], batch.get('stage'))}"
                           f" (running {batch['seconds']} s){_when(info)}{_how(info)}", batch["file"])
    for fault in report.get("device_faults") or ():
        if fault["exception"]:
            where = f" in kernel {fault['kernel']}" if fault["kernel"] else ""
            return "crashed", f"a device fault: {fault['exception']}{where} ({fault['placed']})", \
                (fault["call"] or {}).get("file")
    if report.get("failed_batches"):
        batch = report["failed_batches"][0]
        return "failed", "the " + failure_sentence(batch), batch["file"]
    if report["failed"]:
        call, more = report["failed"][0], len(report["failed"]) - 1
        exception = call["exception"]
        said = f"{exception['type']}: {exception['message']}" if exception else call["description"] or "an error"
        also = f" (and {more} more failed call{'s' if more > 1 else ''})" if more else ""
        return ("failed", f"{call['name']} raised {said}{culprit_text(call.get('culprit'))}{also} ({process_text(call)})",
                call["file"])
    errors = [(info, error) for info in report["files"] for error in info.get("uncaught") or ()]
    if errors:
        info, error = errors[-1]
        return "failed", uncaught_sentence(error), info["path"]
    for call in report.get("graph_replay_at_death") or ():
        # Not a crash for certain: a server killed after its last decode step looks the same.
        info = _info(report, call["file"])
        graph = call.get("graph") or {}
        return ("died", f"the process died after a CUDA graph replay (replay {graph.get('replay')} of graph "
                        f"{graph.get('id')}, {call['seconds_before_death']} s before the end){_when(info)}"
                        f"{_how(info)}: its kernels may have been running on the GPU", call["file"])
    for info in report["files"]:
        if info.get("state") == "died":
            return ("died", f"the process died with no kernel call or batch running{_when(info)}{_how(info)}",
                    info["path"])
    if report["first_nonfinite_output"]:
        call = report["first_nonfinite_output"]
        return "nonfinite", nonfinite_sentence(call), call["file"]
    if report.get("nonfinite_logits"):  # no recorded call's flags went first: the NaN came from outside them
        marks = report["nonfinite_logits"]
        ids = list(dict.fromkeys(mark["request_id"] for mark in marks))
        return ("nonfinite", f"{requests_text(ids)} {'were' if len(ids) > 1 else 'was'} sampled from logits holding "
                             f"NaN/Inf, and no recorded call's NaN flags saw it first ({process_text(marks[0])})",
                marks[0]["file"])
    slow = [call for call in report["in_flight"] if not call["in_flight_in_dead_process"] and call["rank"] is None
            and (call.get("seconds") or 0) >= report.get("hang_seconds", float("inf"))]
    if slow:  # a process with no rank (a rank's is its job's suspect), in a call past the threshold
        call = slow[0]
        return ("hung", f"{call['name']} has been running {call['seconds']} s in pid {call['pid']}, past the "
                        f"{report['hang_seconds']:g} s that makes a hang", call["file"])
    for job in jobs:
        if job.get("waiting_for") or job.get("slow"):
            return "waiting", job["verdict"], None
    if jobs:
        return "clean", jobs[0]["verdict"], None
    live = [info for info in report["files"] if info.get("running")]
    if live:
        frozen = [info for info in live if info.get("state") == "frozen"]
        if frozen:
            return "waiting", f"pid {frozen[0]['pid']} is frozen: its heartbeat stopped (a thread holds the GIL)", \
                frozen[0]["path"]
        return "clean", f"{len(live)} process{'es' if len(live) > 1 else ''} running, nothing failed so far", None
    stopped = [info for info in report["files"] if info.get("state") == "stopped"]
    if stopped:
        info = stopped[0]
        said = ending_text(info.get("fatal_signal"), info.get("stop_reason"))
        return "clean", f"the process was stopped on purpose{said}{_when(info)}; nothing failed", None
    return "clean", "no crash, no failure", None


def process_text(call: dict[str, Any]) -> str:
    """`rank 2, pid 4242, trace_4242.sgltrace`: where a call ran."""
    rank = f"rank {call['rank']}, " if call.get("rank") is not None else ""
    return rank + where_written(call.get("pid"), call.get("file"))


def layer_text(call: dict[str, Any]) -> str:
    """`module model.layers.1.mlp.down_proj, op RMSNorm`: which layer and op a call was, where known."""
    return ", ".join(f"{label} {call[key]}" for label, key in (("module", "module"), ("op", "op_class"))
                     if call.get(key))


def nonfinite_sentence(call: dict[str, Any]) -> str:
    """`the first NaN/Inf from finite inputs came out of <call>, module m, in
    the rows of request nan-1 (rank 0, ...)`; with the NaN flags, `... saw
    the first NaN/Inf come out of <call>` (`... from finite inputs` where its
    inputs were flagged, `... go into <call> through input.cache, from before
    it` where one held it)."""
    fed = call.get("nonfinite_inputs")
    first = "the first NaN/Inf from finite inputs came out of"
    if call.get("nonfinite_seen_by") == "flags":
        first = "the NaN flags saw the first NaN/Inf " + ("go into" if fed else "come out of")
    what = call["name"]
    graph = call.get("graph") or {}
    if isinstance(graph.get("first_nonfinite"), str):  # a replay: the captured call its flags name
        position, _, name = graph["first_nonfinite"].partition(": ")
        what = f"{name} (captured call {position}) in replay {graph.get('replay')} of CUDA graph {graph.get('id')}"
    if call.get("nonfinite_seen_by") == "flags" and fed is not None:
        what += f" through {', '.join(fed)}, from before it" if fed else " from finite inputs"
    parts = [f"{first} {what}", layer_text(call)]
    requests = call.get("requests") or {}
    if ids := requests.get("request_ids"):
        parts.append(f"in the rows of {requests_text(ids)}" if requests.get("nonfinite_rows") else
                     f"in a batch serving {requests_text(ids)}")
    return ", ".join(filter(None, parts)) + f" ({process_text(call)})"


def died_in_words(call: dict[str, Any], info: dict[str, Any]) -> str:
    """`the process died in sglang.custom_op.embedding (SIGABRT recorded) at
    ..., in flight for 0.2 s, while its batch sglang.forward_batch served
    requests r1, r2`."""
    requests = call.get("requests") or {}
    serving = ""
    if requests.get("request_ids") and "batch" in requests:
        serving = f", while its batch {requests['batch']} served {requests_text(requests['request_ids'])}"
    elif requests.get("request"):
        serving = f", in request {requests['request']}"
    running = f", in flight for {call['seconds']} s" if call.get("seconds") is not None else ""
    return f"the process died in {call['name']}{_how(info)}{_when(info)}{running}{serving}"


def _info(report: dict[str, Any], path: str) -> dict[str, Any]:
    return next((info for info in report["files"] if info["path"] == path), {})


def _when(info: dict[str, Any]) -> str:
    return f" at {info['ended_at']}" if info.get("ended_at") else ""


def _how(info: dict[str, Any]) -> str:
    return killed_text(info.get("fatal_signal"))
