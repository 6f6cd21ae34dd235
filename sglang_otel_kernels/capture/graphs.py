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
from ..notices import warn_failed_once
from ..record.processor import current_writer
from ..record.spans import CALL_SEQ, captured_calls
from ..record.tracefile import FLAG_GRAPH_REPLAY, MAX_GRAPH_CALLS, REPLAY_SHIFT, replay_fields
from ..schema import GRAPH_ID, GRAPH_POSITION, GRAPH_REPLAY, GRAPH_SUSPECT, HAS_INF, HAS_NAN, REPLAY_NAME
from . import decorator
from .collectives import MAX_TENSORS, tensor_fields
from .patches import Instrumentation, Patch

_ATTRIBUTE = "_sglang_otel_kernels_graph"  # where a graph object keeps its Graph
_RECORDED = "_sglang_otel_kernels_recorded"  # on our wrappers of a graph class's methods
MAX_OUTPUTS = 64  # tensors of a graph's outputs checked after each replay


@dataclasses.dataclass
class Capture:
    """A graph being captured on this thread."""

    graph_id: int
    calls: list = dataclasses.field(default_factory=list)  # (name, input shapes, input dtypes)
    left_out: int = 0  # calls past MAX_GRAPH_CALLS


class Graph:
    """A graph recorded here: the call number of its next replay
    (`next_replay()`: its id and the replay's number packed), the outputs to check."""

    __slots__ = ("next_replay", "outputs")

    def __init__(self, graph_id: int) -> None:
        self.next_replay = itertools.count((graph_id << REPLAY_SHIFT) + 1).__next__
        self.outputs: tuple = ()


_ids = itertools.count(1)
_local = threading.local()  # .captures: this thread's graphs being captured, innermost last
_fallback: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # graphs without a __dict__
# [the newest replay since the device was last seen healthy (its call number:
# graph id and replay number packed) or None, whether the output check is on
# (level 5 and SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK)]: a list, which the
# compiled core's replays update too.
_replays: list = [None, False]


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
    else:
        capture.left_out += 1
    marks = {GRAPH_ID: capture.graph_id, GRAPH_POSITION: position}
    return {**extra, **marks} if extra else marks


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
        try:
            result = original(graph, *args, **kwargs)
        finally:
            if capture is not None:
                _ended(capture)
        if capture is not None:  # captured whole: its calls are the suspects of its replays
            try:
                _keep(graph, Graph(capture.graph_id))
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
    output check on, one reduction over the graph's outputs flags the span."""
    if call is None:
        return None
    _replays[0] = call[CALL_SEQ]
    if not _replays[1]:
        return None
    info = _graph_of(args[0] if args else None)
    if info is None or not info.outputs:
        return None
    try:
        floats = [tensor for tensor in info.outputs if tensor.is_floating_point() and tensor.numel()]
        if not floats:
            return None
        flags = torch.stack([tensor.isnan().any() for tensor in floats] +
                            [tensor.isinf().any() for tensor in floats]).tolist()
    except Exception as exc:  # the synchronisation met a device error: this replay's, or an earlier call's
        return None, exc
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
    tensors: list = []
    _tensors(outputs, tensors, 0)
    info = _graph_of(graph)
    if info is None:
        info = Graph(next(_ids))
        _keep(graph, info)
    info.outputs = tuple(tensors[:MAX_OUTPUTS])


def _tensors(value: Any, found: list, depth: int) -> None:
    if len(found) >= MAX_OUTPUTS or depth > 3:
        return
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _tensors(item, found, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _tensors(item, found, depth + 1)
    elif hasattr(value, "__dict__"):  # a dataclass of outputs (SGLang's LogitsProcessorOutput)
        for item in vars(value).values():
            _tensors(item, found, depth + 1)


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
    _replays[1] = cfg.level >= 5 and cfg.graph_output_check
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
