"""A serving engine's batch span (SGLang's `sglang.forward_batch`) that
ended in an exception, or was still running when its process died: a
failure like a kernel call's, whatever op it failed in, recorded or not.
The op is the failed kernel call inside the batch where one was recorded,
and the innermost frames of the exception's stack trace (the batch span's
`exception` event) either way. Torch-free."""

from __future__ import annotations

import os
import re
from typing import Any

from ..schema import BATCH_REQUEST_IDS, BATCH_SIZE, CULPRIT, CULPRIT_REQUESTS, EXCEPTION_SPAN, MODULE, NAME, STAGE, THREAD_NAME
from ..record.reader import RecoveredSpan, TraceFileContents

FRAMES = 6  # innermost frames kept of a batch's exception
MAX_UNCAUGHT = 16  # exceptions no code caught shown of one process, the newest
_MAX_STACK = 1 << 16  # characters of a stack trace read (a file's text is untrusted)
_FRAME = re.compile(r'^\s*File "([^"\n]{1,4096})", line (\d{1,9}), in (\S{1,256})\s*$')
# Frames of this package (the decorator's wrapper) say nothing of where a batch failed.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def is_batch(span: RecoveredSpan) -> bool:
    """A batch span (no kernel call, but a batch's requests or size), or an
    engine's stage span (a scheduler's start), reported alike."""
    attributes = span.attributes
    return NAME not in attributes and (BATCH_REQUEST_IDS in attributes or BATCH_SIZE in attributes
                                       or STAGE in attributes)


def stage_of(span: RecoveredSpan) -> "str | None":
    """An engine stage span's stage (`init`), or None: a batch."""
    stage = span.attributes.get(STAGE)
    return stage[:64] if isinstance(stage, str) and stage else None


def batch_words(name: str, request_ids: list[str], stage: "str | None") -> str:
    """`batch sglang.forward_batch (request bad-req-1)`, or a stage's `engine init sglang.scheduler.init`."""
    return f"engine {stage} {name}" if stage else f"batch {name} ({requests_text(request_ids)})"


def at_death_words(name: str, request_ids: list[str], stage: "str | None") -> str:
    """`while its batch sglang.forward_batch served request long-1`, or `during its engine init sglang.scheduler.init`."""
    return f"during its {batch_words(name, request_ids, stage)}" if stage else \
        f"while its batch {name} served {requests_text(request_ids)}"


def request_ids(span: RecoveredSpan) -> list[str]:
    value = span.attributes.get(BATCH_REQUEST_IDS, ())
    return [str(item) for item in value] if isinstance(value, (tuple, list)) else [str(value)]


def exception_of(span: RecoveredSpan) -> "dict[str, Any] | None":
    """The `exception` event's type, message and stack trace, or None."""
    event = next((attrs for name, _, attrs in span.events if name == "exception"), None)
    if event is None:
        return None
    return {"type": str(event.get("exception.type", "")), "message": str(event.get("exception.message", "")),
            "stacktrace": str(event.get("exception.stacktrace", ""))[-_MAX_STACK:]}


def innermost_frames(stacktrace: str, count: int = FRAMES) -> list[dict[str, Any]]:
    """The innermost `count` frames of a Python stack trace (of its last
    exception where several are chained), innermost first, less this
    package's own."""
    last = stacktrace.rsplit("Traceback (most recent call last):", 1)[-1]
    frames = []
    for line in last.splitlines():
        found = _FRAME.match(line)
        if found and not os.path.abspath(found.group(1)).startswith(_OURS):
            frames.append({"function": found.group(3), "file": found.group(1), "line": int(found.group(2))})
    return frames[::-1][:count]


def frames_text(frames: list[dict[str, Any]], shown: int = 3) -> str:
    """`embedding (functional.py:2621) <- embedding (unquant.py:540) <- ...`"""
    return " <- ".join(f"{frame['function']} ({os.path.basename(frame['file'])}:{frame['line']})"
                       for frame in frames[:shown])


def failed_call_in(batch: RecoveredSpan, spans: list[RecoveredSpan]) -> "RecoveredSpan | None":
    """The kernel call that failed inside `batch` (the innermost, the last to
    end), or None: the batch failed outside every recorded call."""
    by_id = {span.span_id: span for span in spans}
    found = None
    for span in spans:
        if NAME not in span.attributes or span.in_flight or span.status_code != "ERROR":
            continue
        current, hops = by_id.get(span.parent_span_id), 0
        while current is not None and hops < 64 and current.span_id != batch.span_id:
            current, hops = by_id.get(current.parent_span_id), hops + 1
        if current is not None and current.span_id == batch.span_id and (
                found is None or (span.end_time or 0) >= (found.end_time or 0)):
            found = span
    return found


def where_text(call: "RecoveredSpan | None", frames: list[dict[str, Any]]) -> str:
    """Where a batch failed, in a few words: its failed call (and module), else its innermost frames."""
    if call is not None:
        module = call.attributes.get(MODULE)
        return call.name + (f" ({module})" if isinstance(module, str) else "")
    return frames_text(frames) if frames else "code no kernel call recorded"


def failure_of(batch: RecoveredSpan, spans: list[RecoveredSpan]) -> "tuple[RecoveredSpan | None, list, str]":
    """(the kernel call that failed inside `batch` or None, its exception's
    innermost frames, where it failed in words): what the report and the
    ranks' verdict both say of a failed batch."""
    exception = exception_of(batch)
    frames = innermost_frames(exception["stacktrace"]) if exception else []
    call = failed_call_in(batch, spans) if not batch.in_flight else None
    return call, frames, where_text(call, frames)


def culprit_of(call: "RecoveredSpan | None") -> "dict[str, Any] | None":
    """What a failed call's inputs were traced to (describe/culprits.py):
    `{"request_ids", "why"}`, or None where nothing was."""
    if call is None:
        return None
    why, ids = call.attributes.get(CULPRIT), call.attributes.get(CULPRIT_REQUESTS)
    if not isinstance(why, str):
        return None
    return {"request_ids": [str(item) for item in ids] if isinstance(ids, (tuple, list)) else [], "why": why[:512]}


def culprit_text(culprit: "dict[str, Any] | None") -> str:
    """`; request bad-7 caused it: id 99999 (row 1 of 3) is outside the 32000
    rows of the embedding`, to follow a failure's sentence; "" for none."""
    if not culprit:
        return ""
    if not culprit["request_ids"]:
        return f"; {culprit['why']}"
    return f"; {requests_text(culprit['request_ids'])} caused it: {culprit['why']}"


def requests_text(ids: list[str], shown: int = 8) -> str:
    """`request bad-req-1`, `requests r1, r2 and 3 more`, `no request ids`."""
    if not ids:
        return "no request ids"
    more = f" and {len(ids) - shown} more" if len(ids) > shown else ""
    return f"request{'s' if len(ids) > 1 else ''} {', '.join(ids[:shown])}{more}"


def batch_summary(span: RecoveredSpan, contents: TraceFileContents, process: dict[str, Any],
                  start: str) -> dict[str, Any]:
    """A failed (or cut short) batch as the report shows it."""
    exception = exception_of(span)
    call, frames, where = failure_of(span, contents.spans)
    ids = request_ids(span)
    return {
        "name": span.name, **process, "start": start,
        "state": "running" if span.in_flight else "error",
        "stage": stage_of(span),
        "request_ids": ids,
        "exception": None if exception is None else {"type": exception["type"], "message": exception["message"]},
        "description": span.status_description,
        "failed_call": None if call is None else call.name,
        "culprit": culprit_of(call),
        "module": None if call is None else call.attributes.get(MODULE),
        "frames": frames,
        "where": where,
        "trace_id": f"{span.trace_id:032x}",
        "span_id": f"{span.span_id:016x}",
    }


def failure_sentence(batch: dict[str, Any]) -> str:
    """`batch sglang.forward_batch (request bad-req-1) failed in <where>: IndexError: ...`, or a stage's;
    with the request it was traced to, where it was."""
    exception = batch["exception"]
    said = f"{exception['type']}: {exception['message']}" if exception else batch["description"] or "an error"
    return (f"{batch_words(batch['name'], batch['request_ids'], batch.get('stage'))} failed in {batch['where']}: {said}"
            f"{culprit_text(batch.get('culprit'))}")


def after_failure(contents: TraceFileContents) -> "dict[str, Any] | None":
    """For a process that is gone: its last failure (a failed batch or kernel
    call, or an exception no code caught), how long it lived on after it, as
    in "ended 0.1 s after it raised IndexError", the kernel call that failed
    (`call`: the failed batch's, or None) and whether a kernel call ended well
    after it (`went_on`: then the failure did not end the process); None when
    nothing failed."""
    if contents.live:
        return None
    last = max(filter(is_failure, contents.spans), key=lambda span: span.end_time, default=None)
    if last is None:
        return None
    call = last if NAME in last.attributes else failed_call_in(last, contents.spans) if is_batch(last) else None
    went_on = any(NAME in span.attributes and not span.in_flight and span.status_code != "ERROR"
                  and span.end_time > last.end_time for span in contents.spans)
    return {"exception": failure_kind(last), "seconds": round(max(contents.last_alive - last.end_time, 0) / 1e9, 1),
            "call": None if call is None else call.name, "went_on": went_on}


def is_failure(span: RecoveredSpan) -> bool:
    """A failure of the process's: a batch or kernel call that ended in an
    error, or an exception no code caught."""
    return (not span.in_flight and span.status_code == "ERROR"
            and (is_batch(span) or NAME in span.attributes or span.name == EXCEPTION_SPAN))


def failure_kind(span: RecoveredSpan) -> str:
    """The type of the exception a failed span ended in (`IndexError`): its
    `exception` event's, else the head of its status description."""
    exception = exception_of(span)
    return ((exception and exception["type"]) or (span.status_description or "an error").split(":", 1)[0])[:256]


def uncaught(contents: TraceFileContents) -> list[dict[str, Any]]:
    """The exceptions no code caught in this process (its EXCEPTION_SPAN
    spans), each with the kernel call that ended last before it: a device
    error raised there was caused by a kernel launched before, most likely by
    that call or one just before it."""
    calls = [span for span in contents.spans if NAME in span.attributes and not span.in_flight]
    found = []
    for span in contents.spans:
        if span.name != EXCEPTION_SPAN or span.in_flight:
            continue
        exception = exception_of(span) or {"type": "", "message": "", "stacktrace": ""}
        before = max((call for call in calls if call.end_time <= span.start_time), key=lambda call: call.end_time,
                     default=None)
        found.append({
            "thread": str(span.attributes.get(THREAD_NAME, "")), "time_unix_nano": span.start_time,
            "exception": {"type": exception["type"], "message": exception["message"]},
            "device_error": exception["type"] == "AcceleratorError"
            or exception["message"].startswith(("CUDA error", "XPU error")),
            "frames": innermost_frames(exception["stacktrace"]),
            "last_call": None if before is None else before.name,
            "seconds_after_last_call": None if before is None else round((span.start_time - before.end_time) / 1e9, 3),
            "trace_id": f"{span.trace_id:032x}",
            "span_id": f"{span.span_id:016x}",
        })
    return found[-MAX_UNCAUGHT:]


def uncaught_sentence(error: dict[str, Any]) -> str:
    """`MainThread raised AcceleratorError: CUDA error: ... and no code caught it, 0.0 s after its last kernel call ended (x)`"""
    exception = error["exception"]
    said = f"{exception['type']}: {exception['message'].splitlines()[0] if exception['message'] else ''}".rstrip(": ")
    after = (f", {error['seconds_after_last_call']} s after its last kernel call ended ({error['last_call']})"
             if error["last_call"] else ", before any kernel call ended")
    return f"{error['thread']} raised {said} and no code caught it{after}"


def after_failure_text(after: "dict[str, Any] | None") -> str:
    return f" {after['seconds']} s after it raised {after['exception']}" if after else ""
