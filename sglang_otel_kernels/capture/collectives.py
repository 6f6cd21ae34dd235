"""torch.distributed's collectives and point-to-point ops as kernel spans.

A crash or stall on one rank is a hang on all the others, which wait in a
collective for it. So that a report can line the ranks up (as PyTorch's
Flight Recorder does), each call of `all_reduce`, `all_gather`, ..., `send`,
`recv` is a kernel span `torch.distributed.<op>` carrying, at every level,
its group (name and global ranks), a per-group sequence number counted here
in call order (the same number on every rank for the same collective), the
shapes and dtypes of its tensors and `async_op`. Point-to-point ops are
counted per peer and direction, so the n-th send from rank a to rank b
pairs with the n-th recv on b from a.

A collective called inside a recorded one (`send` calls `isend`; SGLang's
`GroupCoordinator.all_reduce` may call `torch.distributed.all_reduce`) is
not recorded again: the outer call stands for it, and each rank counts the
same calls. Calls through the module (`dist.all_reduce`) are recorded from
`install()` on; a name imported before (`from torch.distributed import
all_reduce`) keeps the original, unless `sglang-otel-kernels run` installed
this before anything was imported.
"""

from __future__ import annotations

import functools
import inspect
import itertools
import os
import weakref
from typing import Any, Callable

import torch

from .. import config as _config
from ..notices import warn_failed_once
from ..record import identity
from ..record.spans import FLAGS
from ..record.tracefile import CALL, FLAG_COLLECTIVE, PACKED_COLLECTIVE, per_thread
from .decorator import wrap_hooked
from .patches import Instrumentation, Patch

MAX_TENSORS = 8  # of a list argument, the first this many are described


class Spec:
    """What one op's parameters are: the tensors it is given (`inputs`) and
    fills (`outputs`), its reduction, its root or peer as a (global rank,
    rank in the group) pair of parameter names (either may be None), the
    direction of a point-to-point op, whether it always returns at once."""

    __slots__ = ("op", "inputs", "outputs", "reduce", "root", "peer", "direction", "always_async")

    def __init__(self, op: str, inputs=(), outputs=(), reduce=None, root=None, peer=None, direction=None,
                 always_async=False) -> None:
        self.op, self.inputs, self.outputs, self.reduce = op, inputs, outputs, reduce
        self.root, self.peer, self.direction, self.always_async = root, peer, direction, always_async


def _ops(*specs: Spec) -> dict[str, Spec]:
    return {spec.op: spec for spec in specs}


SPECS = _ops(
    Spec("all_reduce", ("tensor",), reduce="op"),
    Spec("all_gather", ("tensor",), ("tensor_list",)),
    Spec("all_gather_into_tensor", ("input_tensor",), ("output_tensor",)),
    Spec("reduce_scatter", ("input_list",), ("output",), reduce="op"),
    Spec("reduce_scatter_tensor", ("input",), ("output",), reduce="op"),
    Spec("broadcast", ("tensor",), root=("src", "group_src")),
    Spec("reduce", ("tensor",), reduce="op", root=("dst", "group_dst")),
    Spec("all_to_all", ("input_tensor_list",), ("output_tensor_list",)),
    Spec("all_to_all_single", ("input",), ("output",)),
    Spec("barrier"),
    Spec("send", ("tensor",), peer=("dst", "group_dst"), direction="send"),
    Spec("isend", ("tensor",), peer=("dst", "group_dst"), direction="send", always_async=True),
    Spec("recv", ("tensor",), peer=("src", "group_src"), direction="recv"),
    Spec("irecv", ("tensor",), peer=("src", "group_src"), direction="recv", always_async=True),
)

_dtype_names: dict = {}
_shape_texts: dict = {}  # torch.Size -> "(4, 4096)": shapes repeat, formatting one costs 0.3 us
_MAX_SHAPES = 4096


def tensor_fields(value: Any, shapes: list, dtypes: list) -> None:
    """Appends the shape and dtype of a tensor, or of the first tensors of a
    list or dict."""
    if isinstance(value, torch.Tensor):
        shape = value.shape
        text = _shape_texts.get(shape)
        if text is None:
            text = str(tuple(shape))
            if len(_shape_texts) < _MAX_SHAPES:
                _shape_texts[shape] = text  # (symbolic shapes never come: calls while torch.compile traces are not recorded)
        shapes.append(text)
        dtype = value.dtype
        name = _dtype_names.get(dtype)
        if name is None:
            name = _dtype_names[dtype] = str(dtype)
        dtypes.append(name)
    elif isinstance(value, (list, tuple, dict)):
        items = list(value.values()) if isinstance(value, dict) else value
        for item in items[:MAX_TENSORS]:
            tensor_fields(item, shapes, dtypes)
        if len(items) > MAX_TENSORS:
            shapes.append(f"... {len(items) - MAX_TENSORS} more")


class Counters:
    """Per-group sequence numbers, counted from 1 in call order; a point-to-point
    op's per (group, direction, peer, tag)."""

    def __init__(self) -> None:
        self._counts: dict = {}

    def next(self, key) -> int:
        counter = self._counts.get(key)
        if counter is None:
            counter = self._counts.setdefault(key, itertools.count(1))
        return next(counter)  # atomic under the GIL: two threads never get one number

    def reset(self) -> None:
        self._counts = {}


counters = Counters()


class Parameters:
    """Where each parameter of a function sits, so that a call's argument is
    found without binding the signature: `slot(name)` once, `value(...)` per call."""

    def __init__(self, func: Callable) -> None:
        self.at: dict[str, tuple[int, Any]] = {}
        try:
            parameters = inspect.signature(func).parameters.values()
        except (TypeError, ValueError):
            parameters = ()
        for index, parameter in enumerate(parameters):
            default = None if parameter.default is inspect.Parameter.empty else parameter.default
            self.at[parameter.name] = (index, default)

    def slot(self, name: str | None) -> tuple:
        """(name, position, default) of a parameter; one the function lacks is always its default, None."""
        index, default = self.at.get(name, (1 << 30, None)) if name is not None else (1 << 30, None)
        return name, index, default

    @staticmethod
    def value(args: tuple, kwargs: dict, slot: tuple) -> Any:
        name, index, default = slot
        if kwargs and name in kwargs:
            return kwargs[name]
        return args[index] if index < len(args) else default

    def get(self, args: tuple, kwargs: dict, name: str | None) -> Any:
        return self.value(args, kwargs, self.slot(name))


class Collective:
    """The attributes of one call of a collective op, made before it runs;
    None for a call not to record (inside a recorded collective, or one that
    communicates nothing). Subclasses say which group a call is in."""

    def __init__(self, spec: Spec, func: Callable) -> None:
        self.spec = spec
        self.parameters = parameters = Parameters(func)
        self.op = spec.op
        # Each call reads its arguments through these, found once.
        self._inputs = tuple(map(parameters.slot, spec.inputs))
        self._outputs = tuple(map(parameters.slot, spec.outputs))
        self._reduce = parameters.slot(spec.reduce) if spec.reduce is not None else None
        self._root = tuple(map(parameters.slot, spec.root)) if spec.root is not None else None
        self._peer = tuple(map(parameters.slot, spec.peer)) if spec.peer is not None else None
        self._tag, self._async = parameters.slot("tag"), parameters.slot("async_op")

    def group(self, args: tuple, kwargs: dict) -> "tuple | None":
        """(what identifies the group in this process, its label, its members'
        global ranks), or None: the call is not recorded."""
        raise NotImplementedError

    def peer(self, args: tuple, kwargs: dict, ranks: tuple):
        """The other rank of a point-to-point op (global), None for any."""
        value = Parameters.value
        return global_rank(value(args, kwargs, self._peer[0]), value(args, kwargs, self._peer[1]), ranks)

    def inputs(self, args: tuple, kwargs: dict) -> tuple[list, list]:
        return self._tensors(args, kwargs, self._inputs)

    @staticmethod
    def _tensors(args: tuple, kwargs: dict, slots: tuple) -> tuple[list, list]:
        """The shapes and dtypes of the tensors in these parameters."""
        shapes: list = []
        dtypes: list = []
        for slot in slots:
            tensor_fields(Parameters.value(args, kwargs, slot), shapes, dtypes)
        return shapes, dtypes

    def __call__(self, args: tuple, kwargs: dict, _state=per_thread) -> "tuple | None":
        """The decorator's `Before` hook (capture/decorator.py)."""
        try:
            call = _state.state[CALL]
            if call is not None and call[FLAGS] & FLAG_COLLECTIVE:
                return None  # inside a recorded collective: that one stands for this call
            group = self.group(args, kwargs)
            return None if group is None else (self._attributes(args, kwargs, *group), FLAG_COLLECTIVE, None)
        except Exception as exc:
            warn_failed_once(f"recording the collective {self.op}", exc, "; the call goes on unrecorded")
            return None

    def _attributes(self, args: tuple, kwargs: dict, key: Any, label: str, ranks: tuple,
                    _value=Parameters.value) -> dict:
        """The call's attributes, packed as the trace file keeps them
        (tracefile.PACKED_COLLECTIVE: COLLECTIVE_FIELDS' values in order)."""
        spec = self.spec
        in_shapes, in_dtypes = self.inputs(args, kwargs)
        out_shapes = out_dtypes = reduce = root = peer = tag = None
        if self._outputs:
            shapes, dtypes = self._tensors(args, kwargs, self._outputs)
            if shapes:
                out_shapes, out_dtypes = tuple(shapes), tuple(dtypes)
        if self._reduce is not None:
            reduce = reduce_name(_value(args, kwargs, self._reduce))
        if self._root is not None:
            root = global_rank(_value(args, kwargs, self._root[0]), _value(args, kwargs, self._root[1]), ranks)
        if spec.direction is not None:
            peer = self.peer(args, kwargs, ranks)
            if peer is None:
                peer = "any"
            tag = _value(args, kwargs, self._tag) or None
            key = (key, spec.direction, peer, tag)
        asynchronous = spec.always_async or bool(_value(args, kwargs, self._async))
        return {PACKED_COLLECTIVE: (self.op, label, ranks, counters.next(key), asynchronous,
                                    tuple(in_shapes) if in_shapes else None, tuple(in_dtypes) if in_dtypes else None,
                                    out_shapes, out_dtypes, reduce, peer, root, None if tag is None else int(tag))}


_reduce_names: dict = {}


def reduce_name(reduce: Any) -> str:
    """`SUM`, `MAX`...: a ReduceOp's name (a property of a C++ enum: cached)."""
    try:
        name = _reduce_names.get(reduce)
    except TypeError:  # a ReduceOp made with a premul factor does not hash
        name = None
    if name is None:
        name = getattr(reduce, "name", None) or str(reduce)
        if len(_reduce_names) < 64:
            try:
                _reduce_names[reduce] = name
            except TypeError:
                pass
    return name


def global_rank(global_value, group_value, ranks: tuple):
    """A peer or root as a global rank, given as one or as a rank in the group."""
    if global_value is not None:
        return int(global_value)
    if group_value is not None and 0 <= int(group_value) < len(ranks):
        return ranks[int(group_value)]
    return None


# -- torch.distributed --------------------------------------------------------

_dist = None  # torch.distributed, once install() found it available
_groups: dict = {}  # id(group) -> (a weak reference to it, its label, its members' global ranks)
_MAX_GROUPS = 4096
_labels: dict = {}  # label -> id(group) of the group that has it
_rendezvous: dict = {}  # what init_process_group was given
_learnt = False  # this process's rank and job are known


def group_label(group) -> tuple:
    """(label, global ranks) of a process group: its description (`tp:device`,
    `default_pg`), else its name, which torch makes the same on every rank."""
    info = _groups.get(id(group))
    if info is not None and info[0]() is group:
        return info[1], info[2]
    description = getattr(group, "group_desc", "") or ""
    name = str(getattr(group, "group_name", "") or "")
    label = description if description and description != "undefined" else name or "group"
    if _labels.get(label, id(group)) != id(group):
        label = f"{label} ({name})"  # two groups of this process share a description
    try:
        ranks = tuple(int(rank) for rank in _dist.get_process_group_ranks(group))
    except Exception:
        ranks = ()
    if len(_groups) < _MAX_GROUPS:  # a process has a few groups; one that makes them without end is not kept
        try:
            _groups[id(group)] = (weakref.ref(group), label, ranks)  # never what keeps a group alive
            _labels.setdefault(label, id(group))
        except TypeError:
            pass  # a group type without weak references: looked up again on each call
    return label, ranks


def learn_identity(again: bool = False) -> None:
    """The global rank, world size and job (its rendezvous, which tells two
    jobs' files apart) once torch.distributed is initialised; once, unless
    `again`."""
    global _learnt
    dist = _dist
    if (_learnt and not again) or dist is None or not dist.is_initialized():
        return
    rendezvous = _rendezvous.get("init_method")
    if not rendezvous or rendezvous == "env://":
        address, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
        if address and port:
            rendezvous = f"env://{address}:{port}"
        elif not rendezvous:
            # init_process_group ran before install(): torch keeps its init method.
            rendezvous = getattr(dist.distributed_c10d, "_default_pg_init_method", None) or "unknown"
    run_id = os.environ.get("TORCHELASTIC_RUN_ID")
    if run_id and run_id != "none":
        rendezvous = f"{rendezvous} run {run_id}"
    try:
        identity.update(rank=dist.get_rank(), world_size=dist.get_world_size(), job=str(rendezvous))
        _learnt = True
    except Exception as exc:
        warn_failed_once("reading this process's rank", exc)


class TorchCollective(Collective):
    """A torch.distributed op; its group is its `group` argument, else the
    default group. A rank outside the group is not recorded (torch does
    nothing there)."""

    def __init__(self, spec: Spec, func: Callable) -> None:
        super().__init__(spec, func)
        self._group = self.parameters.slot("group")

    def group(self, args: tuple, kwargs: dict) -> "tuple | None":
        dist = _dist
        group = Parameters.value(args, kwargs, self._group)
        if group is None:
            group = dist.group.WORLD
            if group is None:
                return None  # not initialised: torch raises for the call itself
        elif group is dist.GroupMember.NON_GROUP_MEMBER:
            return None
        if not _learnt:
            learn_identity()
        return (id(group), *group_label(group))


def _init_process_group(original: Callable) -> Callable:
    """Keeps what the job's rendezvous is, then learns the ranks."""
    parameters = Parameters(original)

    @functools.wraps(original)
    def init_process_group(*args, **kwargs):
        init_method = parameters.get(args, kwargs, "init_method")
        store = parameters.get(args, kwargs, "store")
        if init_method is not None:
            _rendezvous["init_method"] = str(init_method)
        elif store is not None:
            host, port = getattr(store, "host", None), getattr(store, "port", None)
            _rendezvous["init_method"] = f"store://{host}:{port}" if host and port else f"store {type(store).__name__}"
        result = original(*args, **kwargs)
        learn_identity(again=True)  # a new default group
        return result

    return init_process_group


_installed: Instrumentation | None = None
_installed_level = 0


def install() -> Instrumentation | None:
    """Records the ops of torch.distributed from now on, at the level in
    force (idempotent while it holds); None where torch.distributed is not
    available."""
    global _installed, _installed_level, _dist
    level = _config.get_config().level
    if _installed is not None and _installed.active:
        if level == _installed_level:
            return _installed
        _installed.undo()
    import torch.distributed as dist

    if not dist.is_available():
        return None
    _dist = dist
    handle = Instrumentation("torch.distributed collectives")
    module = dist.distributed_c10d
    for op in SPECS:
        original = getattr(module, op, None)
        if original is None:
            continue  # an op this torch release lacks
        recorded = wrap_hooked(original, f"torch.distributed.{op}", TorchCollective(SPECS[op], original))
        for owner in (module, dist):
            if getattr(owner, op, None) is original:
                handle.add(Patch(owner, op, recorded))
    original = module.init_process_group
    wrapped = _init_process_group(original)
    for owner in (module, dist):
        if getattr(owner, "init_process_group", None) is original:
            handle.add(Patch(owner, "init_process_group", wrapped))
    _installed, _installed_level = handle, level
    if dist.is_initialized():
        learn_identity()
    return handle


def uninstall() -> None:
    if _installed is not None:
        _installed.undo()


def follow_config(cfg: "_config.KernelTraceConfig") -> None:
    """Installed while the level is above 0 and collectives are on, removed otherwise."""
    if cfg.level > 0 and cfg.collectives:
        install()
    else:
        uninstall()


_config.on_change(follow_config)
follow_config(_config.get_config())


def _after_fork_in_child() -> None:
    global _learnt
    counters.reset()
    _learnt = False


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
