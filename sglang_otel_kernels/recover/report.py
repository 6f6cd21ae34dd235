"""The crash report: what a trace file (or one per rank) says about how the
process ended, readable at a glance or as one JSON document."""

from __future__ import annotations

import os
import textwrap
import time
from typing import Any

from ..config import DEFAULT_HANG_SECONDS
from ..record.tracefile import traceback_path
from ..schema import COLLECTIVE_OP, NAME, NONFINITE_LOGITS, REQUEST_ID
from .batch_failures import (after_failure, after_failure_text, batch_summary, frames_text, is_batch, requests_text,
                             uncaught, uncaught_sentence)
from .calls import TENSOR_FIELDS, call_summary, process_of, replay_at_death
from .device_faults import join
from .digest import Digest, add_counts, digest, produced_nonfinite
from .ranks import cross_rank, ending_text, state_of, stop_reason, timestamp
from .ranks import render as render_verdict
from ..record.reader import TraceFileContents, innermost_call, read_text
from .stacks import tidy_stacks
from .verdict import decide, ending, layer_text, process_text

def _shown(value: Any) -> str:
    """Statistics to 6 significant digits (a float32 mean holds no more);
    text (a non-finite statistic, a dtype) as it is."""
    if isinstance(value, float):
        return f"{value:.6g}"
    return str(value)


def _render_value(value: Any) -> str:
    if isinstance(value, dict):
        parts = [f"{field}={_shown(value[field])}" for field in TENSOR_FIELDS if field in value]
        return "Tensor(" + ", ".join(parts) + ")"
    if isinstance(value, float):
        return _shown(value)
    return repr(value)


GRAPH_LINES = 64  # captured kernels the text report lists under a call (JSON and the page: all)


# The version of `report --json`'s document (docs/report-json.md): raised
# with each change a reader of the JSON must know of, with the package's.
REPORT_SCHEMA = 10


def build_report(files: "list[TraceFileContents | Digest]", last: int = 10,
                 hang_seconds: float = DEFAULT_HANG_SECONDS, now: int | None = None,
                 dumps: "list | None" = None, skipped: int = 0) -> dict[str, Any]:
    """The report of the files of one or several processes (`render_text`,
    or JSON), from their contents or their digests (recover/digest.py, what
    `report` reads in parallel), with the device faults of CUDA core `dumps`
    read beside them placed in their calls. With ranked files, `cross_rank`
    is the verdict of a job's ranks (`recover/ranks.py`; the job with a
    suspect first) and `cross_rank_jobs` every job's, when the files hold
    several. `verdict` is what happened, decided once (recover/verdict.py):
    every output renders it."""
    now = time.time_ns() if now is None else now
    digests = [item if isinstance(item, Digest) else digest(item, last) for item in files]
    contents = [item.contents for item in digests]
    by_id = {span.span_id: span for content in contents for span in content.spans}
    # Only what is shown is sorted across files.
    in_flight_spans, failed_spans, ended, other_in_flight, nonfinite, failed_batches = [], [], [], [], [], []
    logits: list[dict] = []  # requests sampled from non-finite logits (the NaN flags' marks), first first
    summary: dict[str, list] = {}  # name -> [calls, errors, in flight, total ns]
    for item in digests:
        content = item.contents
        add_counts(summary, item.summary)
        tail: list = []
        for span in content.spans:
            if NAME not in span.attributes:
                if span.in_flight:
                    other_in_flight.append((span, content))
                elif span.status_code == "ERROR" and is_batch(span):
                    failed_batches.append((span, content))
                elif span.attributes.get(NONFINITE_LOGITS) is True:
                    logits.append(dict(request_id=str(span.attributes.get(REQUEST_ID)), **process_of(content),
                                       time=timestamp(span.start_time), time_unix_nano=span.start_time,
                                       trace_id=f"{span.trace_id:032x}"))
            elif span.in_flight:
                in_flight_spans.append((span, content))
            else:
                tail.append(span)
                if span.status_code == "ERROR":
                    failed_spans.append((span, content))
                if produced_nonfinite(span):
                    nonfinite.append((span, content))
        ended.extend((span, content) for span in tail[-last:] if last > 0)
    by_start = lambda item: item[0].start_time  # noqa: E731
    ended.sort(key=by_start)
    first_bad = min(nonfinite, key=by_start, default=None)
    in_flight = [dict(call_summary(s, by_id, f, now), in_flight_in_dead_process=not f.live)
                 for s, f in sorted(in_flight_spans, key=by_start)]
    states = [state_of(c, now) for c in contents]
    state_of_file = {id(c): state for c, state in zip(contents, states)}  # several processes may share a path
    # A process stopped on purpose (the SIGTERM it recorded) left its calls in flight: no crash.
    crashed = any(not f.live and state_of_file[id(f)] != "stopped" for _, f in in_flight_spans)
    at_death = [dict(call_summary(s, by_id, c, now), seconds_before_death=round((c.last_alive - s.end_time) / 1e9, 1))
                for c in contents if (s := replay_at_death(c)) is not None]
    failed = [call_summary(s, by_id, f, now) for s, f in sorted(failed_spans, key=by_start)]
    batches_failed = [batch_summary(s, c, process_of(c), timestamp(s.start_time))
                      for s, c in sorted(failed_batches, key=by_start)]
    # A batch still running when its process died: the requests it served, whether a kernel ran or not.
    batches_at_death = [dict(batch_summary(s, c, process_of(c), timestamp(s.start_time)),
                             seconds=round(max(c.last_alive - s.start_time, 0) / 1e9, 1),
                             kernel_in_flight=any(k.in_flight and NAME in k.attributes for k in c.spans))
                        for s, c in sorted(other_in_flight, key=by_start)
                        if is_batch(s) and state_of_file[id(c)] == "died"]
    tracebacks = {}
    for content in contents:
        text = read_text(traceback_path(content.path)).strip()
        if text:
            tracebacks[content.path] = text
    jobs = cross_rank(contents, hang_seconds, now)
    faults = join(dumps, contents) if dumps else []
    report = {
        "schema": REPORT_SCHEMA,
        "cross_rank": jobs[0] if jobs else None,
        "cross_rank_jobs": jobs,
        "files": [process_entry(c, state, item.spans) for item, c, state in zip(digests, contents, states)],
        "crashed": crashed or bool(batches_at_death),
        "running": any(c.live for c in contents),
        "in_flight": in_flight,
        "graph_replay_at_death": at_death,
        "failed": failed,
        "failed_batches": batches_failed,
        "batches_at_death": batches_at_death,
        "last_calls": [call_summary(s, by_id, f, now) for s, f in ended[-last:]] if last > 0 else [],
        "first_nonfinite_output": None if first_bad is None else call_summary(first_bad[0], by_id, first_bad[1], now),
        "nonfinite_logits": sorted(logits, key=lambda mark: mark["time_unix_nano"]),
        "tracebacks": tracebacks,
        "summary": {name: {"calls": calls, "errors": errors, "in_flight": running, "total_us": round(total / 1000, 1)}
                    for name, (calls, errors, running, total) in sorted(summary.items())},
        "in_flight_other_spans": [
            {"name": s.name, **process_of(f), "start": timestamp(s.start_time), "trace_id": f"{s.trace_id:032x}"}
            for s, f in sorted(other_in_flight, key=by_start)
        ],
        "device_faults": faults,  # from CUDA core dumps given beside the files (recover/device_faults.py)
        "skipped_processes": skipped,
        "hang_seconds": hang_seconds,
    }
    report["verdict"] = decide(report)
    return report


def process_entry(c: TraceFileContents, state: str, spans: int) -> dict[str, Any]:
    """A process's entry of the report's `files`, of its file's contents (or
    digest) in `state` (`state_of`), with how it ended (`ending`, decided in
    recover/verdict.py), which the sidecar's crash gauges read too."""
    entry = {
        "path": c.path, "format_version": c.format_version, "pid": c.metadata.get("pid"),
        "host": c.metadata.get("host"), "running": c.live, "state": state,
        "fatal_signal": c.fatal_signal if state in ("died", "stopped") else None,
        "ended_at": None if c.live else timestamp(c.last_alive),
        "stop_reason": stop_reason(c) if state == "stopped" else None,
        "after_failure": after_failure(c),
        "uncaught": uncaught(c),
        "died_in": _died_in(c) if state == "died" else None,
        "last_call": _last_call(c),
        "ranks": _ranks(c.metadata.get("ranks")), "argv": c.metadata.get("argv"),
        "spans": spans, "problems": c.problems}
    entry["ending"] = ending(entry)
    return entry


def _died_in(contents: TraceFileContents) -> "dict[str, Any] | None":
    """The kernel call a dead process was in (its innermost in flight): its
    name, and whether it is a collective (where a rank waits for another)."""
    call = innermost_call(span for span in contents.spans if span.in_flight and NAME in span.attributes)
    return None if call is None else {"name": call.name, "collective": COLLECTIVE_OP in call.attributes}


def _last_call(contents: TraceFileContents) -> "str | None":
    """The kernel call that ended last in the process (ended well or not)."""
    call = max((span for span in contents.spans if NAME in span.attributes and not span.in_flight),
               key=lambda span: span.end_time, default=None)
    return None if call is None else call.name


def uncaught_in(report: dict[str, Any]) -> list[dict[str, Any]]:
    """The exceptions no code caught, of every process the report read."""
    return [error for info in report["files"] for error in info.get("uncaught") or ()]


def batch_lines(batch: dict[str, Any], indent: str = "  ") -> list[str]:
    """A failed or cut-short batch: where, its requests, its exception and innermost frames."""
    lines = [f"{indent}{batch['name']}  ({process_text(batch)}; started {batch['start']})",
             f"{indent}  the engine's {batch['stage']} stage" if batch.get("stage") else
             f"{indent}  serving {requests_text(batch['request_ids'])}"]
    if batch.get("seconds") is not None:
        lines.append(f"{indent}  running for {batch['seconds']} s when the process was last alive, no kernel call in "
                     "flight (the engine's own Python)")
    if batch["exception"]:
        lines.append(f"{indent}  raised {batch['exception']['type']}: {batch['exception']['message']}")
    if batch["failed_call"]:
        lines.append(f"{indent}  in the kernel call {batch['where']}")
    lines.extend(culprit_lines(batch.get("culprit"), indent))
    if batch["frames"]:
        lines.append(f"{indent}  innermost frames: {frames_text(batch['frames'], len(batch['frames']))}")
    lines.append(f"{indent}  trace {batch['trace_id']}")
    return lines


def culprit_lines(culprit: "dict[str, Any] | None", indent: str) -> list[str]:
    """What a failure was traced to: `caused by request bad-7: id 99999 ...`."""
    if not culprit:
        return []
    who = f"caused by {requests_text(culprit['request_ids'])}: " if culprit["request_ids"] else "its input: "
    return [f"{indent}  {who}{culprit['why']}"]


def _ranks(value: Any) -> dict[str, str]:
    return {str(key): str(rank) for key, rank in value.items()} if isinstance(value, dict) else {}


def call_lines(call: dict[str, Any], indent: str = "  ") -> list[str]:
    seq = f", seq {call['seq']}" if call["seq"] is not None else ""
    lines = [f"{indent}{call['name']}  ({process_text(call)}; thread {call['thread']}, started {call['start']}{seq})"]
    layer = layer_text(call)
    if layer:
        lines.append(f"{indent}  {layer}")
    if call.get("seconds") is not None:
        lines.append(f"{indent}  running for {call['seconds']} s" if not call.get("in_flight_in_dead_process")
                     else f"{indent}  in flight for {call['seconds']} s when the process was last alive")
    if call["exception"]:
        lines.append(f"{indent}  raised {call['exception']['type']}: {call['exception']['message']}")
    lines.extend(culprit_lines(call.get("culprit"), indent))
    for path, value in call["inputs"].items():
        lines.append(f"{indent}  {path} = {_render_value(value)}")
    for path, value in call["outputs"].items():  # the proof of a NaN/Inf it produced
        lines.append(f"{indent}  -> {path} = {_render_value(value)}")
    if call.get("nonfinite_seen_by") == "flags":
        fed = call.get("nonfinite_inputs")
        if fed:
            lines.append(f"{indent}  its inputs' NaN flags: NaN/Inf in {', '.join(fed)}: it came in from before this "
                         "call (weights, a cache, or work no recorded call covers)")
        elif fed is not None:
            lines.append(f"{indent}  its inputs' NaN flags: all finite: the NaN/Inf starts in this call")
        lines.append(f"{indent}  -> its outputs' NaN flags: NaN/Inf (the first flagged call of its step)"
                     if any(path.startswith("output") for path in call.get("nonfinite") or ()) else
                     f"{indent}  -> its outputs' NaN flags: none set, or none landed (it died in it, raised, or "
                     "masked them)")
    if call["dump_dir"]:
        lines.append(f"{indent}  inputs dumped to {call['dump_dir']}  (sglang-otel-kernels rerun DIR)")
    graph = call.get("graph")
    if graph is not None:
        count = len(graph["calls"]) + graph["left_out"]
        where = (f"replay {graph['replay']} of CUDA graph {graph['id']}" if graph["role"] == "replayed" else
                 f"first seen after replay {graph['replay']} of CUDA graph {graph['id']}")
        batch = [str(graph[key]) for key in ("forward_mode",) if graph.get(key)]
        batch += [f"batch of {graph['batch_size']}"] if graph.get("batch_size") is not None else []
        where += f" ({', '.join(batch)})" if batch else ""
        lines.append(f"{indent}  {where}: one of these {count} captured kernels" +
                     (":" if count else " (its capture was not recorded)"))
        if graph.get("first_nonfinite"):
            lines.append(f"{indent}  the first captured call that made NaN/Inf in this replay (or was fed it, where "
                         "its arguments were flagged; the NaN check): "
                         f"{graph['first_nonfinite']}")
        for number, kernel in enumerate(graph["calls"][:GRAPH_LINES], 1):
            shapes = ", ".join(kernel["shapes"])
            lines.append(f"{indent}    {number}. {kernel['name']}" + (f"  {shapes}" if shapes else "") +
                         (f"  {', '.join(kernel['dtypes'])}" if kernel["dtypes"] else ""))
        if count > GRAPH_LINES:
            lines.append(f"{indent}    ... and {count - GRAPH_LINES} more (report --json lists them all)")
    requests = call["requests"]
    if requests:
        if requests.get("nonfinite_rows"):
            ids = ", ".join(requests["request_ids"]) or "none of its requests"
            linked = len(requests["request_traces"])
            lines.append(f"{indent}  batch {requests['batch']}: NaN/Inf in the rows of {ids} "
                         f"({len(requests['request_ids'])} of its {len(requests['batch_request_ids'])} requests" +
                         (f"; {linked} trace{'s' if linked > 1 else ''} linked)" if linked else ")"))
        elif "batch" in requests:
            ids = ", ".join(requests["request_ids"]) or "no ids"
            linked = len(requests["request_traces"])
            lines.append(f"{indent}  batch {requests['batch']}: requests {ids}" +
                         (f" ({linked} traces linked)" if linked else ""))
        else:
            lines.append(f"{indent}  request {requests['request']} (trace {requests['trace_id']})")
    return lines


def fault_lines(fault: dict[str, Any]) -> list[str]:
    """A CUDA core dump's fault, and the call or replay it is placed in."""
    where = os.path.basename(fault["dump"])
    if fault["exception"] is None:
        return [f"Device fault: CUDA core dump {where}: no faulting lane recorded"] + \
            [f"  warning: {note}" for note in fault["notes"]]
    device = f"device {fault['device']}" + (f" ({fault['device_name']})" if fault["device_name"] else "")
    place = ", ".join(f"{label} {fault[key]}" for label, key in (("SM", "sm"), ("warp", "warp"), ("lane", "lane"))
                      if fault[key] is not None)
    lines = [f"Device fault (CUDA core dump {where}): {fault['exception']} in "
             + (f"kernel {fault['kernel']}" if fault["kernel"] else "a kernel the dump does not name")
             + f" on {device}" + (f", {place}" if place else "")]
    launch = [f"{label} {tuple(fault[key])}" for label, key in (("grid", "grid"), ("block", "block"),
              ("block index", "block_index"), ("thread", "thread_index")) if fault[key] is not None]
    launch += [f"{label} {fault[key]}" for label, key in (("error PC", "error_pc"), ("PC", "pc")) if fault[key]]
    if launch:
        lines.append("  " + ", ".join(launch))
    lines.extend(f"  warning: {note}" for note in fault["notes"])
    call = fault["call"]
    if call is None:
        lines.append(f"  not placed: {fault['placed']}")
        return lines
    lines.append(f"  {fault['placed']}:")
    lines.extend(call_lines(call, indent="    "))
    marked = [f"{number}. {kernel['name']}" for number, kernel in enumerate((call.get("graph") or {}).get("calls", ()), 1)
              if kernel.get("matches_kernel")]
    if marked:
        lines.append(f"    captured calls whose name matches the kernel: {', '.join(marked)}")
    return lines


def render_text(report: dict[str, Any]) -> str:
    headline = report["verdict"]["headline"]
    out: list[str] = [headline, ""]
    for number, verdict in enumerate(report.get("cross_rank_jobs") or ()):
        lines = render_verdict(verdict)
        out.extend(lines[1:] if number == 0 and lines[0] == headline else lines)  # the headline is said once
        out.append("")
    for info in report["files"]:
        ranks = ", ".join(f"{k}={v}" for k, v in info["ranks"].items()) or "no rank"
        after = after_failure_text(info.get("after_failure"))
        state = ", still running" if info["running"] else \
            f", {info['state']}{after}{ending_text(info['fatal_signal'], info.get('stop_reason'))}" \
            if info.get("state") in ("died", "stopped") else \
            f", ended{after}" if after else ""
        out.append(f"{info['path']}: pid {info['pid']} on {info['host']}, {ranks}, {info['spans']} spans{state}")
        out.extend(f"  warning: {problem}" for problem in info["problems"])
    if report.get("skipped_processes"):
        out.append(f"(skipped {report['skipped_processes']} process(es) of OTLP JSON files without kernel calls: "
                   "another service's spans, such as Jaeger's own)")
    out.append("")
    stopped = {info["path"] for info in report["files"] if info.get("state") == "stopped"}
    dead = [call for call in report["in_flight"] if call["in_flight_in_dead_process"] and call["file"] not in stopped]
    halted = [call for call in report["in_flight"] if call["in_flight_in_dead_process"] and call["file"] in stopped]
    running = [call for call in report["in_flight"] if not call["in_flight_in_dead_process"]]
    if dead:
        out.append(f"CRASHED: {len(dead)} kernel call(s) were running when the process died:")
        for call in dead:
            out.extend(call_lines(call))
    if halted:
        out.append(f"STOPPED: {len(halted)} kernel call(s) were running when the process was stopped (SIGTERM):")
        for call in halted:
            out.extend(call_lines(call))
    if running:
        writers = len({call["file"] for call in running})
        alive = "the writing process is alive" if writers == 1 else f"the {writers} writing processes are alive"
        out.append(f"RUNNING: {alive}; {len(running)} kernel call(s) running now:")
        for call in running:
            out.extend(call_lines(call))
    at_death = report.get("graph_replay_at_death") or []
    if not report["in_flight"] and report["files"]:
        out.append("No kernel call was running when the file was last written" +
                   (" (no crash inside a kernel)." if not at_death else ", but a CUDA graph's kernels may have been:"))
    for batch in report.get("batches_at_death") or ():
        if not batch["kernel_in_flight"]:  # else its call in flight, above, names it
            out.append("Batch running when the process died, between kernel calls:")
            out.extend(batch_lines(batch))
    for call in at_death:
        out.append(f"  the process died {call['seconds_before_death']} s after this CUDA graph replay returned (a "
                   "replay only launches the graph: its kernels run on the GPU after it returns):")
        out.extend(call_lines(call, indent="    "))
    for fault in report.get("device_faults") or ():
        out.extend(fault_lines(fault))
    for info in report["files"]:
        for error in info.get("uncaught") or ():
            out += ["", f"Uncaught exception ({os.path.basename(info['path'])}, pid {info['pid']}, "
                        f"{timestamp(error['time_unix_nano'])}):", "  " + uncaught_sentence(error)]
            if error["frames"]:
                out.append(f"  innermost frames: {frames_text(error['frames'])}")
            if error["device_error"]:
                out.append("  a device error is raised by the next synchronisation, not by the kernel that caused "
                           "it: that kernel was launched earlier, most likely by the last calls below")
    by_process: dict[str, dict[str, list]] = {}
    shown = {(batch["file"], batch["name"], batch["trace_id"]) for batch in report.get("batches_at_death") or ()}
    for span in report["in_flight_other_spans"]:  # the spans around the calls, per process, by name
        if (span["file"], span["name"], span["trace_id"]) not in shown:  # a batch at death is shown above
            by_process.setdefault(process_text(span), {}).setdefault(span["name"], []).append(span["trace_id"])
    for process, names in by_process.items():
        out.append(f"Also unfinished ({process}):")
        for name, traces in names.items():
            head = f"  {name} ({len(traces)}): trace{'s' if len(traces) > 1 else ''} "
            out.extend(textwrap.wrap(head + ", ".join(traces), 110, subsequent_indent=" " * 6,
                                     break_long_words=False, break_on_hyphens=False))
    if report.get("failed_batches"):
        out += ["", f"Failed batches ({len(report['failed_batches'])}):"]
        for batch in report["failed_batches"]:
            out.extend(batch_lines(batch))
    if report["failed"]:
        out += ["", f"Failed calls ({len(report['failed'])}):"]
        for call in report["failed"]:
            out.extend(call_lines(call))
    if report["first_nonfinite_output"]:
        first = report["first_nonfinite_output"]
        out += ["", "First call whose NaN flags saw NaN/Inf:" if first.get("nonfinite_seen_by") == "flags" else
                "First call that produced NaN/Inf from finite inputs:"]
        out.extend(call_lines(report["first_nonfinite_output"]))
    if report["nonfinite_logits"]:
        marks = report["nonfinite_logits"]
        out += ["", f"Requests sampled from logits holding NaN/Inf ({len(marks)}; SGLang's sampler, the NaN flags; "
                    "with SGLANG_SANITIZE_NAN_LOGITS served as if healthy):"]
        out += [f"  {mark['time']}  request {mark['request_id']}  ({process_text(mark)}; trace {mark['trace_id']})"
                for mark in marks]
    if report["last_calls"]:
        out += ["", f"Last {len(report['last_calls'])} completed calls:"]
        several = len(report["files"]) > 1
        for call in report["last_calls"]:
            where = f"  ({process_text(call)})" if several else ""
            out.append(f"  {call['start']}  {call['name']}  {call['duration_us']} us  {call['state']}{where}")
    for path, text in report["tracebacks"].items():
        name = f"{os.path.basename(path)}.traceback"
        # The compiled core's SIGTERM writes one line, no stacks.
        out += ["", f"Python traceback ({name}, the crashed thread first):" if "most recent call first" in text
                else f"{name}:"]
        out.extend(("  " + line).rstrip() for line in tidy_stacks(text))
    if report["summary"]:
        out += ["", f"{'kernel':50s} {'calls':>7s} {'errors':>7s} {'running':>8s} {'total us':>11s}"]
        for name, row in report["summary"].items():
            out.append(f"{name:50s} {row['calls']:7d} {row['errors']:7d} {row['in_flight']:8d} {row['total_us']:11.1f}")
    return "\n".join(out) + "\n"

