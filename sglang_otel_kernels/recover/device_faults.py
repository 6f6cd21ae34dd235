"""CUDA core dumps joined to the trace files: which process a dump belongs
to, and which call or CUDA graph replay its faulting kernel ran in.

A dump is matched to a trace file by the host and pid in its name (the
driver's %h and %p, as record/coredumps.py and SGLang name dumps), else, for
a dump named otherwise, to the one process that died within a minute of the
dump's time. In that process the fault belongs to the kernel call in flight;
else to the CUDA graph replay in flight, or the newest one before death (a
graph's kernels run on after `replay()` returns), or the replay a later
synchronisation blamed; the replay's captured calls whose name matches the
kernel's (`rmsnorm` for `flashinfer::norm::RMSNormKernel<float>`) are marked.
With none of those, it belongs to the newest call whose name matches the
kernel: a kernel runs on after the call that launched it returns, so an
eager fault usually kills a process between calls (so seen on an H100).
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from typing import Any

from ..schema import CUDA_EXCEPTION, CUDA_KERNEL, GRAPH_REPLAY, GRAPH_SUSPECT
from .cuda_coredump import CoreDump, CoreDumpError, DeviceFault, read_cuda_coredump
from ..record.reader import RecoveredSpan, TraceFileContents
from .calls import call_summary, is_kernel, replay_at_death

_NO_FAULT = {field.name: None for field in dataclasses.fields(DeviceFault)}
_WITHIN_NS = 60 * 10**9  # a dump named otherwise joins the one process that died this close to its time
_MIN_TOKEN = 3  # a call's name token shorter than this matches too much to mark anything


def _token(text: str) -> str:
    return re.sub(r"[^0-9a-z]", "", text.lower())


def _kernel_name(kernel: str) -> str:
    """A demangled kernel's qualified name: no return type, template
    arguments or parameters (`float` there names nothing)."""
    name = kernel.split("(")[0]
    while True:
        shorter = re.sub(r"<[^<>]*>", "", name)
        if shorter == name:
            return name.rsplit(" ", 1)[-1]
        name = shorter


def matches(call_name: str, kernel: str | None) -> bool:
    """Whether a recorded call's name names the kernel: its last part
    (`sglang.custom_op.rmsnorm` -> `rmsnorm`) within the kernel's name,
    letters and digits only, case aside."""
    token = _token(call_name.rpartition(".")[2])
    return bool(kernel) and len(token) >= _MIN_TOKEN and token in _token(_kernel_name(kernel))


def _process(dump: CoreDump, contents: list[TraceFileContents]) -> tuple[TraceFileContents | None, str | None]:
    if dump.pid is not None:
        for content in contents:
            if content.metadata.get("pid") == dump.pid and (dump.host is None or content.metadata.get("host")
                                                              in (None, dump.host)):
                return content, "pid"
        return None, None
    dead = [c for c in contents if not c.live and not c.exited and dump.time is not None
            and abs(c.last_alive - dump.time * 10**9) <= _WITHIN_NS]
    return (dead[0], "time") if len(dead) == 1 else (None, None)


def _running(spans: list[RecoveredSpan]) -> tuple[RecoveredSpan | None, str]:
    """Of spans, the kernel call in flight a fault belongs to (else the replay in flight)."""
    running = [span for span in spans if span.in_flight and is_kernel(span)]
    calls = [span for span in running if GRAPH_REPLAY not in span.attributes]
    if calls:
        return max(calls, key=lambda span: span.start_time), "the call in flight"
    replays = [span for span in running if GRAPH_REPLAY in span.attributes]
    if replays:
        return max(replays, key=lambda span: span.start_time), "the CUDA graph replay in flight"
    return None, ""


def _where(content: TraceFileContents, kernel: str | None) -> tuple[RecoveredSpan | None, str]:
    """The span a fault of `kernel` in this process belongs to, and how it is known."""
    span, how = _running(content.spans)
    if span is not None:
        return span, how
    newest = replay_at_death(content)
    if newest is not None:
        return newest, "the newest CUDA graph replay before the process died"
    blamed = [span for span in content.spans if GRAPH_SUSPECT in span.attributes]
    if blamed:
        return min(blamed, key=lambda span: span.start_time), "the call that met the device error first"
    launched = [span for span in content.spans if is_kernel(span) and GRAPH_REPLAY not in span.attributes
                and matches(span.name, kernel)]
    if launched:
        return (max(launched, key=lambda span: span.start_time),
                "the newest call whose name matches the kernel (a kernel runs on after its call returns)")
    return None, "no call of this process was running"


def join(dumps: list[CoreDump], contents: list[TraceFileContents], now: int | None = None) -> list[dict[str, Any]]:
    """report --json's `device_faults`: each fault of each dump, with the
    process and call it belongs to (None where it joins none)."""
    by_id = {span.span_id: span for content in contents for span in content.spans}
    joined = []
    for dump in dumps:
        content, joined_by = _process(dump, contents)
        kernel = dump.faults[0].kernel if dump.faults else None
        span, how = _where(content, kernel) if content is not None else \
            (None, "no trace file of its process was given")
        call = None
        if span is not None:
            call = dict(call_summary(span, by_id, content, now), in_flight_in_dead_process=span.in_flight and not
                        content.live)
        for fault in dump.faults:
            entry = {"dump": dump.path, "host": dump.host, "pid": dump.pid, "time": dump.time, "driver": dump.driver,
                     **fault.as_dict(), "joined_by": joined_by, "placed": how, "call": call, "notes": dump.notes}
            if call is not None and call.get("graph") is not None:
                graph = dict(call["graph"])
                graph["calls"] = [dict(kernel, matches_kernel=matches(kernel["name"], fault.kernel))
                                  for kernel in graph["calls"]]
                entry["call"] = dict(call, graph=graph)
            joined.append(entry)
        if not dump.faults:
            joined.append({"dump": dump.path, "host": dump.host, "pid": dump.pid, "time": dump.time,
                           "driver": dump.driver, **_NO_FAULT, "joined_by": joined_by, "placed": how, "call": call,
                           "notes": dump.notes + ["the dump records no faulting lane or SM"]})
    return joined


def dumps_of(trace_path: str, metadata: dict) -> list[str]:
    """The CUDA core dumps of a trace file's process: named for its host and
    pid, beside the file or in SGLANG_CUDA_COREDUMP_DIR."""
    host, pid = metadata.get("host"), metadata.get("pid")
    if not isinstance(host, str) or type(pid) is not int:
        return []
    folders = {os.path.dirname(os.path.abspath(trace_path))}
    if os.environ.get("SGLANG_CUDA_COREDUMP_DIR", "").strip():
        folders.add(os.path.abspath(os.environ["SGLANG_CUDA_COREDUMP_DIR"].strip()))
    name = f"cuda_coredump_{glob.escape(host)}.{pid}.*"
    return sorted(path for folder in folders for path in glob.glob(os.path.join(glob.escape(folder), name)))


def mark_in_flight(spans: list[RecoveredSpan], trace_path: str, metadata: dict) -> RecoveredSpan | None:
    """The call (else the replay) in flight among a dead process's spans gets
    the fault its CUDA core dump records (`sglang.cuda.exception`,
    `sglang.cuda.kernel`): for the sidecar and `replay`, which export it.
    A dump that cannot be read is passed over (report says why)."""
    span, _ = _running(spans)
    if span is None:
        return None
    for path in dumps_of(trace_path, metadata):
        try:
            faults = read_cuda_coredump(path).faults
        except CoreDumpError:
            continue
        if faults:
            span.attributes[CUDA_EXCEPTION] = faults[0].exception
            if faults[0].kernel:
                span.attributes[CUDA_KERNEL] = faults[0].kernel
            return span
    return None
