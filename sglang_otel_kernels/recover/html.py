"""The crash report as one self-contained HTML page, for machines without a
back end or network: a timeline of the last kernel calls per thread (and per
process or rank when several files are given), all on one time axis, the
call in flight at the crash highlighted with its inputs, failed calls and
the first NaN/Inf producer marked, the requests of each call's batch on
hover and on click. The ranks of a job come first: their verdict, then one
lane per rank, collectives drawn apart, the suspects' lanes marked. No
external resource: styles, data and script are inline; every text from a
file is escaped (a file is hostile input). Text wraps, never scrolls
sideways; the script names each bar wide enough on the screen it is viewed on."""

from __future__ import annotations

import html
import json
import time
from typing import Any

from ..schema import COLLECTIVE_OP
from .ranks import ending_text
from ..record.reader import RecoveredSpan, TraceFileContents
from .calls import call_summary, is_kernel
from .digest import produced_nonfinite
from .report import batch_lines, build_report, call_lines, fault_lines, render_text

MAX_CALLS_PER_TRACK = 200  # the newest calls of each thread: what happened just before the end

_STYLE = """
body{font:14px system-ui,sans-serif;margin:16px;color:#222;overflow-wrap:anywhere}
h1{font-size:20px}h2{font-size:16px;margin-top:24px}
.verdict{padding:8px 12px;border-radius:4px;font-weight:600}
.verdict.crashed{background:#fdd;color:#900}.verdict.failed{background:#ffe6cc;color:#840}
.verdict.clean{background:#dfd;color:#060}.verdict.nonfinite{background:#f0e2f6;color:#5b2c6f}.verdict.waiting{background:#fff3c4;color:#735c00}
.track{margin:6px 0}.track-name{font-size:12px;color:#555}
svg{width:100%;height:28px;background:#f6f6f6;border-radius:3px;display:block}
rect.call{fill:#7aa6d8}rect.call.failed{fill:#e8912d}rect.call.nonfinite{fill:#9b59b6}
rect.call.in-flight{fill:#d62828}rect.call:hover{stroke:#000;stroke-width:1}
rect.call.collective{fill:#2a9d8f}rect.call.collective.in-flight{fill:#f4d35e}
text.label{font:11px system-ui,sans-serif;fill:#fff;pointer-events:none}
rect.collective.in-flight+text.label{fill:#333}
.lane{margin:4px 0;padding:2px 4px;border-left:6px solid transparent}
.lane.suspect{border-left-color:#d62828;background:#fff3f3}.lane-name{font-size:12px;color:#333}
.lane.suspect .lane-name{color:#900;font-weight:600}
#details{white-space:pre-wrap;font:12px ui-monospace,monospace;background:#f6f6f6;padding:8px;min-height:3em}
pre{font:12px ui-monospace,monospace;background:#f6f6f6;padding:8px;white-space:pre-wrap}
.in-flight-call{border-left:6px solid #d62828;background:#fdd;padding:6px 10px;white-space:pre-wrap;
font:12px ui-monospace,monospace}
.legend span{display:inline-block;width:12px;height:12px;margin:0 4px 0 12px;vertical-align:middle}
"""

_SCRIPT = """
const calls = JSON.parse(document.getElementById('calls').textContent);
const details = document.getElementById('details');
for (const rect of document.querySelectorAll('rect.call')) {
  rect.addEventListener('click', () => { details.textContent = calls[rect.dataset.call]; });
}
// A bar wide enough on this screen carries its kernel's name: whole, else its
// last part (embedding of sglang.custom_op.embedding), else cut short.
const CHAR_PX = 6.5;  // 11px sans-serif
function label() {
  for (const old of document.querySelectorAll('text.label')) old.remove();
  for (const rect of document.querySelectorAll('rect.call')) {
    const room = Math.floor((rect.getBoundingClientRect().width - 6) / CHAR_PX);
    const name = rect.dataset.name, last = name.split('.').pop();
    const shown = name.length <= room ? name : last.length <= room ? last :
      room >= 4 ? last.slice(0, room - 1) + '\u2026' : null;
    if (shown === null) continue;
    const text = document.createElementNS(rect.namespaceURI, 'text');
    text.setAttribute('class', 'label');
    text.setAttribute('x', rect.getAttribute('x'));
    text.setAttribute('dx', '3');
    text.setAttribute('y', '18');
    text.textContent = shown;
    rect.after(text);
  }
}
label();
window.addEventListener('resize', label);
"""


def _call_text(span: RecoveredSpan, by_id: dict[int, RecoveredSpan], contents: TraceFileContents) -> str:
    """What hovering or clicking a call shows: the report's lines for it, and its timing."""
    call = call_summary(span, by_id, contents)
    timing = ("still running at the end of the file" if span.in_flight
              else f"{call['duration_us']} us, {call['state']} {call['description']}".rstrip())
    return "\n".join([*call_lines(call, indent=""), "  " + timing])


def _track(spans: list[RecoveredSpan], start: int, end: int, first_bad: int | None,
           by_id: dict[int, RecoveredSpan], content: TraceFileContents, calls: list[str]) -> str:
    width = max(end - start, 1)
    rects = []
    for span in spans:
        stop = span.end_time if span.end_time is not None else _until(content)
        x = 100 * (span.start_time - start) / width
        # A call too short to see still shows; the call in flight stands out.
        w = max(100 * (stop - span.start_time) / width, 1.5 if span.in_flight else 0.3)
        kind = ("in-flight" if span.in_flight else "failed" if span.status_code == "ERROR"
                else "nonfinite" if span.span_id == first_bad else "")
        if COLLECTIVE_OP in span.attributes:
            kind += " collective"
        text = _call_text(span, by_id, content)
        calls.append(text)
        rects.append(f'<rect class="call {kind}" data-call="{len(calls) - 1}" data-name="{html.escape(span.name)}" '
                     f'x="{x:.3f}%" y="3" width="{w:.3f}%" height="22"><title>{html.escape(text)}</title></rect>')
    return f'<svg role="img">{"".join(rects)}</svg>'


def _until(content: TraceFileContents) -> int:
    """Where a call in flight is drawn to: now in a live process, else its last sign of life."""
    return time.time_ns() if content.live else content.last_alive


def _newest_by_thread(content: TraceFileContents) -> dict[Any, list[RecoveredSpan]]:
    tracks: dict[Any, list[RecoveredSpan]] = {}
    for span in content.spans:
        if is_kernel(span):
            tracks.setdefault(span.thread_name or span.thread_id, []).append(span)
    return {name: spans[-MAX_CALLS_PER_TRACK:] for name, spans in tracks.items()}


# The page's colour and word for each kind of verdict (recover/verdict.py).
_CLASSES = {"crashed": "crashed", "hung": "crashed", "mismatch": "crashed", "died": "failed", "failed": "failed",
            "nonfinite": "nonfinite", "waiting": "waiting", "clean": "clean"}
_LABELS = {"crashed": "CRASHED: ", "hung": "HUNG: ", "mismatch": "MISMATCH: ", "died": "DIED: ", "failed": "FAILED: ",
           "nonfinite": "NaN/Inf: "}


def _verdict_class(verdict: dict[str, Any]) -> str:
    if verdict["suspects"]:
        return "crashed"
    return "waiting" if verdict.get("waiting_for") or verdict.get("slow") else "clean"


def _rank_lanes(report: dict[str, Any], contents: list[TraceFileContents], axis: tuple[int, int], first_bad,
                by_id: dict[int, RecoveredSpan], calls: list[str]) -> str:
    """Each job's verdict, then one lane per rank (its newest calls, every
    thread of it together) on the page's time axis; a suspect's lane is marked."""
    by_path = {content.path: content for content in contents}
    out = []
    for verdict in report.get("cross_rank_jobs") or ():
        suspects = {s["rank"]: (number, s) for number, s in enumerate(verdict["suspects"], 1)}
        lanes = []
        for rank in verdict["ranks"]:
            content = by_path.get(rank["file"])
            if content is None:
                continue
            spans = sorted((s for s in content.spans if is_kernel(s)), key=lambda s: s.start_time)[-MAX_CALLS_PER_TRACK:]
            label = (f"rank {rank['rank']}: {rank['state']}{ending_text(rank.get('fatal_signal'), rank.get('stop_reason'))}"
                     f", pid {rank['pid']}")
            marked = suspects.get(rank["rank"])
            if marked is not None:
                label += f" (suspect {marked[0]}: {marked[1]['reason']})"
            lanes.append(f'<div class="lane{" suspect" if marked else ""}" data-rank="{rank["rank"]}">'
                         f'<div class="lane-name">{html.escape(label)}</div>'
                         f"{_track(spans, *axis, first_bad, by_id, content, calls)}</div>")
        out.append(f'<h2>Ranks of job {html.escape(str(verdict["job"]))}</h2>'
                   f'<p class="verdict {_verdict_class(verdict)}">'
                   f'{html.escape(verdict["verdict"])}</p>{"".join(lanes)}')
    return "".join(out)


def render_html(contents: list[TraceFileContents], report: dict[str, Any] | None = None) -> str:
    report = report if report is not None else build_report(contents, last=10)
    by_id = {span.span_id: span for c in contents for span in c.spans}
    # The first producer of NaN/Inf across the files, as the report finds it.
    first_bad = min(((s.start_time, s.span_id) for c in contents for s in c.spans
                     if is_kernel(s) and produced_nonfinite(s)), default=(0, None))[1]
    at_death = report.get("batches_at_death") or []
    decided = report["verdict"]
    verdict = (_CLASSES[decided["kind"]], _LABELS.get(decided["kind"], "") + decided["headline"])
    calls: list[str] = []
    sections = []
    newest_of = {content.path: _newest_by_thread(content) for content in contents}
    # One time axis for every process, so that calls of different processes line up.
    shown = [(s, content) for content in contents for spans in newest_of[content.path].values() for s in spans]
    start = min((s.start_time for s, _ in shown), default=0)
    end = max((s.end_time or _until(content) for s, content in shown), default=1)
    end += max((end - start) // 25, 1)  # room after the newest call: a call in flight starts at the very end
    for content in contents:
        newest = newest_of[content.path]
        if not newest:
            continue
        rank = (content.metadata.get("ranks") or {}).get("rank")
        title = f"{content.path} (pid {content.metadata.get('pid')}" + (f", rank {rank})" if rank is not None else ")")
        rows = "".join(
            f'<div class="track"><div class="track-name">thread {html.escape(str(name))}: '
            f"last {len(spans)} call(s)</div>{_track(spans, start, end, first_bad, by_id, content, calls)}</div>"
            for name, spans in newest.items())
        crashed = "".join(
            f'<div class="in-flight-call">In flight when the process ended:\n'
            f'{html.escape(chr(10).join(call_lines(call)))}</div>'
            for call in report["in_flight"] if call["file"] == content.path and call["in_flight_in_dead_process"])
        crashed += "".join(
            f'<div class="in-flight-call">The process died {call["seconds_before_death"]} s after this CUDA graph '
            f'replay returned; its kernels may still have been running on the GPU:\n'
            f'{html.escape(chr(10).join(call_lines(call)))}</div>'
            for call in report.get("graph_replay_at_death") or () if call["file"] == content.path)
        crashed += "".join(
            f'<div class="in-flight-call">{"Running when the process died" if batch["state"] == "running" else "Failed"}'
            f':\n{html.escape(chr(10).join(batch_lines(batch)))}</div>'
            for batch in [*at_death, *(report.get("failed_batches") or ())]
            if batch["file"] == content.path and not batch.get("kernel_in_flight"))
        crashed += "".join(
            f'<div class="in-flight-call device-fault">{html.escape(chr(10).join(fault_lines(fault)))}</div>'
            for fault in report.get("device_faults") or () if (fault["call"] or {}).get("file") == content.path)
        sections.append(f"<h2>{html.escape(title)}</h2>{rows}{crashed}")
    data = json.dumps(calls).replace("<", "\\u003c")  # no tag of any kind inside the script element
    return f"""<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>Kernel crash report</title>
<meta http-equiv="Content-Security-Policy" content="default-src 'none'; style-src 'unsafe-inline'; script-src 'unsafe-inline'">
<style>{_STYLE}</style></head><body>
<h1>Kernel calls before the end</h1>
<p class="verdict {verdict[0]}">{html.escape(verdict[1])}</p>
<p class="legend"><span style="background:#d62828"></span>in flight (at the crash, or running now)
<span style="background:#f4d35e"></span>waiting in a collective
<span style="background:#e8912d"></span>failed<span style="background:#9b59b6"></span>first NaN/Inf producer
<span style="background:#2a9d8f"></span>collective<span style="background:#7aa6d8"></span>completed.
Hover a call for its inputs and requests; click to keep them below.</p>
{_rank_lanes(report, contents, (start, end), first_bad, by_id, calls)}
{"".join(sections) or "<p>No kernel calls in these files.</p>"}
<h2>Selected call</h2><div id="details">(click a call)</div>
<h2>Report</h2><pre>{html.escape(render_text(report))}</pre>
<script type="application/json" id="calls">{data}</script>
<script>{_SCRIPT}</script>
</body></html>
"""
