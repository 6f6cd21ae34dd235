"""CUDA graphs: what each capture recorded, and each replay as one span.

SGLang (like vLLM) runs decode through CUDA graphs: the decorated Python runs
once, at capture, and never again while the graph replays, so a crash inside
a replayed step leaves no kernel call in flight. Here, while a graph is
captured (`CUDAGraph.capture_begin` ... `capture_end`, which `torch.cuda.graph`
calls), each recorded call is marked with the graph's id and its place in it
(`sglang.cuda_graph.id`, `.position`) and its name, input shapes and dtypes
join the graph's call list, which the trace file keeps (a GRAPH record, then
in the table every lap starts with). Each `CUDAGraph.replay()` is then a span
`cuda_graph.replay` with the graph's id and its replay number (packed in the
record's call number: it costs what a level-1 kernel call costs), so a crash
during a replay is a replay in flight whose graph's kernels are the suspects.

A device error is asynchronous: one a replayed kernel caused surfaces at a
later synchronisation, in whatever call makes it. The newest replay since the
recorder last saw the device healthy is kept, and the call that meets the
error first names it (`sglang.cuda_graph.suspect`). At level 5, with
SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK=1, one reduction over a graph's output
tensors (given by `watch_graph_outputs`; the SGLang integration gives its
runners') after each replay flags the replay's span `has_nan` / `has_inf`.

`record_graph_class(cls)` is the seam: torch's `torch.cuda.CUDAGraph` by
default, any class with the same `capture_begin` / `capture_end` / `replay`
in tests.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import sys
import threading
import weakref
from typing import Any, Callable

import torch

from .. import config as _config
from ..describe.statistics import is_device_error
from ..describe.tensors import tensors_of
from ..notices import warn_failed_once
from ..record import batches
from ..record.processor import current_writer
from ..record.spans import CALL_SEQ, captured_calls
from ..record.tracefile import FLAG_GRAPH_REPLAY, MAX_GRAPH_CALLS, REPLAY_SHIFT, replay_fields
from ..schema import (GRAPH_FIRST_NONFINITE, GRAPH_ID, GRAPH_POSITION, GRAPH_REPLAY, GRAPH_SUSPECT, HAS_INF, HAS_NAN,
                      MODULE, REPLAY_NAME)
from ..record.flag_file import DIGIT, REPLAY_DIGITS, REPLAY_HEAD, REPLAY_INPUTS, Flagged, argument_names
from . import decorator, nan_flags
from .nan_flags import WIDTH
from .collectives import MAX_TENSORS, tensor_fields
from .patches import Instrumentation, Patch

_ATTRIBUTE = "_sglang_otel_kernels_graph"  # where a graph object keeps its Graph
_RECORDED = "_sglang_otel_kernels_recorded"  # on our wrappers of a graph class's methods
MAX_OUTPUTS = 64  # tensors of a graph's outputs checked after each replay
# The NaN check's device buffer, per graph: a flag each captured call's outputs, one each whether its
# arguments (where flagged) held NaN/Inf, then ROW_SLOTS for its first output's rows and its arguments, one each.
FED = MAX_GRAPH_CALLS
ROWS_AT = 2 * MAX_GRAPH_CALLS
ROW_SLOTS = 1 << 16


@dataclasses.dataclass
class Capture:
    """A graph being captured on this thread."""

    graph_id: int
    calls: list = dataclasses.field(default_factory=list)  # (name, input shapes, input dtypes)
    left_out: int = 0  # calls past MAX_GRAPH_CALLS
    flags: "torch.Tensor | None" = None  # the NaN check's device buffer (FED, ROWS_AT)
    rows: dict = dataclasses.field(default_factory=dict)  # position -> (where its rows' slots start, how many)
    # position -> (where its arguments' slots start, how many, how many positional, 1 where the first is its self)
    inputs: dict = dataclasses.field(default_factory=dict)
    keywords: dict = dataclasses.field(default_factory=dict)  # position -> its keyword arguments' names
    rows_used: int = 0
    modules: dict = dataclasses.field(default_factory=dict)  # position -> its call's module path, where known
    nan_failed: bool = False  # a captured reduction could not be made: no NaN check for this graph


class NanCheck:
    """A graph's NaN flags (SGLANG_KERNEL_API_GRAPH_NAN_CHECK at level 5, and
    the NaN flags at any level: capture/nan_flags.py). Its captured
    reductions write, on each replay, a flag a captured call into a device
    buffer, then the flags of its first output's rows, and where
    SGLANG_KERNEL_API_NAN_FLAGS_INPUTS names it, before it runs, a flag each
    of its arguments and whether one held NaN/Inf; kernels captured at the
    capture's end reduce those to a summary in the layout of the flag
    ring's REPLAY slots (record/flag_file.py: whether a call made or was fed
    NaN/Inf, the first one's position and rows count, its outputs' and
    arguments' flags, a flag a row). After each replay the summary is copied
    into the ring (one device copy, nothing read), which lands it in the
    crash-safe flags file with the step's other flags and reads it once
    landed, from host memory; the first flagged call names the captured
    call on the replay's span, with the requests of its flagged rows where
    the replay's batch maps rows to requests, and the arguments that held
    NaN/Inf (`flagged`). Made while the graph is captured: it launches
    nothing but the summary's kernels (captured); the tables they read are
    filled once the capture has ended (`fill`)."""

    __slots__ = ("flags", "names", "modules", "keywords", "rows", "inputs", "summary", "_table", "_offsets",
                 "_powers")

    def __init__(self, flags: "torch.Tensor", names: list, modules: dict, keywords: dict) -> None:
        self.flags = flags
        self.names = names  # by position - 1
        self.modules = modules  # by position
        self.keywords = keywords  # by position: its keyword arguments' names, where its arguments are flagged
        self.rows: dict = {}  # position -> (where its rows' flags start, how many), once filled
        self.inputs: dict = {}  # position -> (where its arguments' flags start, how many, ...), once filled
        device = flags.device
        # No host-to-device copy here (none is allowed while a graph is captured): the constants are made by
        # kernels, which the graph then runs on each replay too (cheap), and the table is filled later; a
        # capture launches nothing, so the summary never reads it unfilled but on the CPU (a stand-in graph).
        make = torch.empty if flags.is_cuda else torch.zeros
        # position - 1 -> its rows' start and count, its arguments' start, count, positional count, self first
        self._table = make(len(names), 6, dtype=torch.int64, device=device)
        self._offsets = torch.arange(WIDTH - REPLAY_HEAD, device=device)
        self._powers = torch.pow(DIGIT, self._offsets[:REPLAY_DIGITS])  # 1, DIGIT, DIGIT ** 2
        self.summary = torch.empty(WIDTH, dtype=torch.uint8, device=device)
        self.summarise()

    def summarise(self) -> None:
        """This replay's flags into `summary` (captured: run on each replay)."""
        count = len(self.names)
        every = self.flags.view(torch.uint8)
        made_here = every[:count]
        # The first captured call that made NaN/Inf or was fed it, if one did.
        made, first = torch.maximum(made_here, every[FED:FED + count]).max(0)
        start, rows, fed_at, fed, positional, self_first = self._table.index_select(0, first.view(1)).unbind(1)
        rows = rows * made
        numbers = torch.cat([(first.view(1) + 1) * made, rows]).view(2, 1)
        digits = numbers.div(self._powers, rounding_mode="floor").remainder_(DIGIT).add_(1).view(-1)
        counts = torch.cat([fed, positional, self_first]) * made + 1
        arguments = self._offsets[:REPLAY_INPUTS]
        fed_flags = every.index_select(0, fed_at + arguments) * (arguments < fed) * made
        flagged = every.index_select(0, start + self._offsets) * (self._offsets < rows)
        self.summary.copy_(torch.cat([(1 - made).view(1), digits, 1 - made_here.index_select(0, first.view(1)) * made,
                                      counts, 1 - fed_flags, 1 - flagged]))

    def fill(self, rows: dict, inputs: dict) -> None:
        """Its calls' rows (position -> (where their flags start, how many))
        and arguments (position -> (where theirs start, how many, how many
        positional, self first)), once the capture has ended."""
        self.rows, self.inputs = rows, inputs
        table = [(*rows.get(position, (0, 0)), *inputs.get(position, (0, 0, 0, 0)))
                 for position in range(1, len(self.names) + 1)]
        self._table.copy_(torch.tensor(table, dtype=torch.int64).view(-1, 6))

    def flagged(self, call: tuple, batch: "batches.Batch | None", replay: Flagged) -> None:
        """The replay `call` whose summary (`replay`) said captured call
        `replay.position` made or was fed NaN/Inf: marked."""
        position = replay.position
        name = self.names[position - 1] if position <= len(self.names) else "?"
        fed = None if replay.inputs is None else argument_names(replay, self.keywords.get(position, ()))
        nan_flags.flagged(call, name, self.modules.get(position), batch, replay.rows, list(replay.bad_rows), fed=fed,
                          output=replay.output, **{GRAPH_FIRST_NONFINITE: f"{position}: {name}"})


class Graph:
    """A graph recorded here: the call number of its next replay
    (`next_replay()`: its id and the replay's number packed), the outputs to check."""

    __slots__ = ("numbers", "next_replay", "outputs", "nan")

    def __init__(self, graph_id: int) -> None:
        self.numbers = itertools.count((graph_id << REPLAY_SHIFT) + 1)  # the compiled core takes its next
        self.next_replay = self.numbers.__next__
        self.outputs: tuple = ()
        self.nan: "NanCheck | None" = None


_ids = itertools.count(1)
_local = threading.local()  # .captures: this thread's graphs being captured, innermost last
_fallback: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graphs without a __dict__
# [the newest replay since the device was last seen healthy (its call number:
# graph id and replay number packed) or None, whether a replay's after-hook
# has work beyond that (the output or the NaN check)]: a list, which the
# compiled core's replays update too, and leave to the hooks when [1].
_replays: list = [None, False]
_checks = {"outputs": False, "nan": False}  # level 5 and SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK, _NAN_CHECK


class _Context(threading.local):
    attributes: "dict | None" = None  # what an integration says of the replays this thread makes (batch, mode)


_context = _Context()


def _graph_of(graph) -> "Graph | None":
    info = getattr(graph, _ATTRIBUTE, None)
    if info is None:
        try:
            info = _fallback.get(graph)
        except TypeError:
            return None
    return info


def _keep(graph, info: Graph) -> None:
    try:
        setattr(graph, _ATTRIBUTE, info)
    except (AttributeError, TypeError):
        try:
            _fallback[graph] = info
        except TypeError:
            pass  # neither: each replay counts as a graph of its own


def captured(name: str, args: tuple, kwargs: dict, extra: "dict | None") -> "dict | None":
    """A recorded call made while this thread captures a graph: its place in
    the graph's call list, as attributes added to `extra`."""
    captures = getattr(_local, "captures", None)
    if not captures:
        return extra
    capture = captures[-1]
    position = len(capture.calls) + capture.left_out + 1
    if len(capture.calls) < MAX_GRAPH_CALLS:
        shapes: list = []
        dtypes: list = []
        for value in (*args, *kwargs.values()):
            tensor_fields(value, shapes, dtypes)  # metadata only: nothing touches a tensor's data
        capture.calls.append((name, tuple(shapes[:MAX_TENSORS]), tuple(dtypes[:MAX_TENSORS])))
        if extra and extra.get(MODULE):
            capture.modules[position] = extra[MODULE]
    else:
        capture.left_out += 1
    marks = {GRAPH_ID: capture.graph_id, GRAPH_POSITION: position}
    return {**extra, **marks} if extra else marks


def _checked(marks: "dict | None") -> "tuple[Capture, int] | None":
    """The graph this thread captures and the place `marks` give a call in
    it, where the NaN check flags its calls; else None."""
    captures = getattr(_local, "captures", None)
    position = marks.get(GRAPH_POSITION) if marks else None
    if not _checks["nan"] or not captures or captures[-1].nan_failed or not position or position > MAX_GRAPH_CALLS:
        return None
    return captures[-1], position


def _flags_on(capture: Capture, device: torch.device) -> torch.Tensor:
    if capture.flags is None:
        # Padded: the summary reads a slot's worth of rows from where the first flagged call's start.
        capture.flags = torch.zeros(ROWS_AT + ROW_SLOTS + WIDTH, dtype=torch.bool, device=device)
    return capture.flags


def _room(capture: Capture, count: int) -> "int | None":
    """Where `count` flags of a call's rows or arguments start, while the graph's slots last."""
    if not 0 < count <= ROW_SLOTS - capture.rows_used:
        return None
    capture.rows_used += count
    return ROWS_AT + capture.rows_used - count


def captured_inputs(marks: "dict | None", name: str, values: tuple, keywords: tuple, skip: int) -> None:
    """With the NaN check on, before a call captured into a graph runs where
    SGLANG_KERNEL_API_NAN_FLAGS_INPUTS names it: captured reductions (no
    synchronisation; they run on each replay, before the call's kernels)
    write a flag each of its arguments (as nan_flags.arguments_of finds
    them) and whether one held NaN/Inf."""
    checked = _checked(marks)
    if checked is None or not nan_flags.inputs_wanted(name):
        return
    capture, position = checked
    found, positional, count, self_first = nan_flags.arguments_of(values, keywords, skip, REPLAY_INPUTS)
    device = capture.flags.device if capture.flags is not None else found[0][1][0].device if found else None
    found = [(at, [tensor for tensor in tensors if tensor.device == device]) for at, tensors in found]
    found = [(at, tensors) for at, tensors in found if tensors]
    start = _room(capture, count) if found else None
    if start is None:
        return
    try:
        flags = _flags_on(capture, device)
        for at, tensors in found:
            flags[start + at] = torch.stack([(~tensor.isfinite()).any() for tensor in tensors]).any()
        flags[FED + position - 1] = flags[start:start + count].any()
        capture.inputs[position] = (start, count, positional, int(self_first))
        capture.keywords[position] = keywords
    except Exception as exc:
        capture.nan_failed = True
        warn_failed_once("capturing the NaN check of a CUDA graph's call's arguments", exc)


def captured_output(marks: dict, result: Any) -> None:
    """With the NaN check on, after a call captured into a graph: a captured
    reduction (no synchronisation; it runs on each replay) writes whether its
    floating outputs hold NaN/Inf into its slot of the graph's flag buffer."""
    checked = _checked(marks)
    if checked is None:
        return
    capture, position = checked
    floats = [tensor for tensor in tensors_of(result, MAX_OUTPUTS) if tensor.is_floating_point() and tensor.numel()]
    if capture.flags is not None:
        floats = [tensor for tensor in floats if tensor.device == capture.flags.device]
    if not floats:
        return
    try:
        flags = _flags_on(capture, floats[0].device)
        flags[position - 1] = torch.stack([(~tensor.isfinite()).any() for tensor in floats]).any()
        # Its first output's rows (a batch's requests', where the batch maps them), while the graph's slots last.
        count = floats[0].shape[0] if floats[0].dim() else 0
        start = _room(capture, count)
        if start is not None:
            flags[start: start + count] = (~floats[0].isfinite()).reshape(count, -1).any(1)
            capture.rows[position] = (start, count)
    except Exception as exc:
        capture.nan_failed = True
        warn_failed_once("capturing the NaN check of a CUDA graph's call", exc)


def _begin(original: Callable) -> Callable:
    @functools.wraps(original)
    def capture_begin(graph, *args, **kwargs):
        capture = Capture(next(_ids))
        _local.captures = [*getattr(_local, "captures", ()), capture]
        decorator.capturing(+1)
        try:
            return original(graph, *args, **kwargs)
        except BaseException:
            _ended(capture)
            raise

    return capture_begin


def _ended(capture: Capture) -> None:
    captures = getattr(_local, "captures", [])
    if capture in captures:
        captures.remove(capture)
        decorator.capturing(-1)


def _end(original: Callable) -> Callable:
    @functools.wraps(original)
    def capture_end(graph, *args, **kwargs):
        captures = getattr(_local, "captures", None)
        capture = captures[-1] if captures else None
        check = None
        if capture is not None and capture.flags is not None and not capture.nan_failed:
            try:  # still captured: the summary's kernels join the graph
                check = NanCheck(capture.flags, [name for name, _, _ in capture.calls], capture.modules,
                                 capture.keywords)
            except Exception as exc:
                warn_failed_once("capturing the summary of a CUDA graph's NaN check", exc)
        try:
            result = original(graph, *args, **kwargs)
        finally:
            if capture is not None:
                _ended(capture)
        if capture is not None:  # captured whole: its calls are the suspects of its replays
            try:
                info = Graph(capture.graph_id)
                if check is not None:
                    check.fill(capture.rows, capture.inputs)
                    info.nan = check
                _keep(graph, info)
                captured_calls[capture.graph_id] = len(capture.calls) + capture.left_out
                writer = current_writer()
                if writer is not None and not writer.failed:
                    calls = tuple(((writer.symbols.get(name) or writer.symbol(name) or name), shapes, dtypes)
                                  for name, shapes, dtypes in capture.calls)
                    writer.add_graph(capture.graph_id, calls, capture.left_out)
            except Exception as exc:
                warn_failed_once("recording a CUDA graph's captured calls", exc)
        return result

    return capture_end


def replay_attributes(**attributes: Any) -> "ReplayContext":
    """`with replay_attributes(**{"sglang.batch.size": 8}):` the replays made
    inside carry these attributes (an integration's view of its batch)."""
    return ReplayContext(attributes)


class ReplayContext:
    def __init__(self, attributes: dict) -> None:
        self.attributes = {key: value for key, value in attributes.items() if value is not None}

    def __enter__(self) -> "ReplayContext":
        self.previous = _context.attributes
        _context.attributes = self.attributes
        return self

    def __exit__(self, *exc_info) -> None:
        _context.attributes = self.previous


def _before(args: tuple, kwargs: dict, _context=_context, _attribute=_ATTRIBUTE, _flags=FLAG_GRAPH_REPLAY):
    """A replay's span: the graph's id and replay number packed in its call
    number (the attributes a level-1 call has cost nothing more), plus what
    an integration says of it. Once per replay: the defaults bind locals."""
    graph = args[0] if args else None
    info = getattr(graph, _attribute, None) or _graph_of(graph)
    if info is None:  # captured before recording began: a graph with no known calls
        info = Graph(next(_ids))
        _keep(graph, info)
    return _context.attributes, _flags, info.next_replay()


def _after(args: tuple, call: "tuple | None", result: Any):
    """After a replay: it is the pending suspect of a device error; with the
    NaN check on, its flags are copied to be read later; with the output
    check on, one reduction over the graph's outputs flags the span."""
    if call is None:
        return None
    _replays[0] = call[CALL_SEQ]
    if not _replays[1]:
        return None
    info = _graph_of(args[0] if args else None)
    if info is not None and info.nan is not None and _checks["nan"]:
        error = nan_flags.replayed(info.nan, call)
        if error is not None:
            return None, error
    if info is None or not info.outputs or not _checks["outputs"]:
        return None
    try:
        floats = [tensor for tensor in info.outputs if tensor.is_floating_point() and tensor.numel()]
        if not floats:
            return None
        flags = torch.stack([tensor.isnan().any() for tensor in floats] +
                            [tensor.isinf().any() for tensor in floats]).tolist()
    except Exception as exc:
        if is_device_error(exc):  # the synchronisation met one: this replay's, or an earlier call's
            return None, exc
        warn_failed_once("checking a CUDA graph's outputs for NaN/Inf", exc)
        return None
    healthy()
    return {HAS_NAN: any(flags[: len(floats)]), HAS_INF: any(flags[len(floats):])}, None


def suspect() -> "tuple[str, dict] | None":
    """The newest replay since the device was last seen healthy, as a note
    and attributes for a call that meets a device error; None when none."""
    if _replays[0] is None:
        return None
    fields = replay_fields(_replays[0])
    graph_id, replay = fields[GRAPH_ID], fields[GRAPH_REPLAY]
    calls = captured_calls.get(graph_id)
    kernels = f"whose {calls} captured kernels are" if calls is not None else "whose kernels are"
    return (f"the newest CUDA graph replay before it was replay {replay} of graph {graph_id}, {kernels} the likeliest "
            "culprits", {GRAPH_SUSPECT: f"graph {graph_id}, replay {replay}"})


def pending() -> bool:
    """Whether a replay would be blamed for a device error met now."""
    return _replays[0] is not None


def healthy() -> None:
    """The recorder synchronised and saw no device error: no replay before is a suspect."""
    _replays[0] = None


def watch_graph_outputs(graph: Any, outputs: Any) -> None:
    """At level 5 with SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK=1, after each
    replay of `graph` its `outputs` (tensors, or containers and objects
    holding them: the static tensors the captured code returned) are checked
    for NaN/Inf in one reduction, and its replay span flagged."""
    tensors = tensors_of(outputs, MAX_OUTPUTS)
    info = _graph_of(graph)
    if info is None:
        info = Graph(next(_ids))
        _keep(graph, info)
    info.outputs = tuple(tensors[:MAX_OUTPUTS])


_installed: dict = {}  # class -> its Instrumentation


def record_graph_class(graph_class: type) -> "Instrumentation | None":
    """Records the captures and replays of `graph_class` (torch.cuda.CUDAGraph,
    or a stand-in with the same methods) from now on, at the level in force."""
    handle = _installed.get(graph_class)
    if handle is not None and handle.active:
        return handle
    handle = Instrumentation(f"{graph_class.__name__} captures and replays")
    for name, recorded in (("capture_begin", _begin), ("capture_end", _end),
                           ("replay", lambda method: decorator.wrap_hooked(method, REPLAY_NAME, _before, _after,
                                                                        replay=(_ATTRIBUTE, _context, _replays)))):
        method = getattr(graph_class, name)
        if not getattr(method, _RECORDED, False):  # one a base class has recorded already: recorded once
            wrapper = recorded(method)
            setattr(wrapper, _RECORDED, True)
            handle.add(Patch(graph_class, name, wrapper))
    _installed[graph_class] = handle
    return handle


def follow_config(cfg: "_config.KernelTraceConfig") -> None:
    """torch's CUDAGraph recorded while the level is above 0 (again at a new
    level); nothing wrapped at level 0."""
    # The NaN flags (capture/nan_flags.py) flag captured calls by the graph NaN check, at any level.
    _checks.update(outputs=cfg.level >= 5 and cfg.graph_output_check,
                   nan=(cfg.level >= 5 and cfg.graph_nan_check) or (cfg.level > 0 and cfg.nan_flags))
    _replays[1] = _checks["outputs"] or _checks["nan"]
    for handle in list(_installed.values()):
        handle.undo()
    installed = list(_installed)
    _installed.clear()
    if cfg.level > 0:
        graph_class = getattr(getattr(torch, "cuda", None), "CUDAGraph", None)
        for cls in dict.fromkeys([*installed, graph_class]):
            if cls is not None:
                record_graph_class(cls)


decorator.watch_graphs(sys.modules[__name__])
_config.on_change(follow_config)
follow_config(_config.get_config())
