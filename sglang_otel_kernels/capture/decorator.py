"""`debug_kernel_api` and its two helpers, compatible with SGLang's.

Everything that can be decided once (the name, the level, whether a leading
self/cls is skipped) is decided when a function is decorated; a call then
describes its arguments once and hands the description to the text log and to
the span. Instrumentation never raises into the caller and never masks the
kernel's own exception.
"""

from __future__ import annotations

import enum
import functools
import inspect
import itertools
import os
from time import time_ns
from typing import Any, Callable, Protocol, TypeVar, overload

import torch
from opentelemetry import context as otel_context
from opentelemetry import trace

from .. import config as _config
from .._version import __version__
from ..describe.culprits import explained
from ..describe.statistics import fill_statistics, is_device_error, nonfinite_rows
from ..notices import warn_failed_once
from ..describe.tensors import dtype_names
from ..describe.values import describe, identity_plan
from ..descriptions import tensors_in
from .. import schema
from ..record import attributes as _attrs
from ..record import batches, core, tracefile
from ..record.tensor_dumps import SKIPPED_CAPTURE, Dumps, import_path
from ..record.setup import follow_trace_file, watch_global_provider
from ..record.spans import KernelSpans, awaited, call_context, parent_context, parent_entry, parent_of, unwind
from ..record.textlog import TextLog, call_header, exception_line, section_lines
from ..describe.guards import compiler_flags, is_compiling, is_graph_capturing
from . import nan_flags
from .naming import infer_api_name, takes_self_first

F = TypeVar("F", bound=Callable[..., Any])

# SGLang's own marker, so functions it wrapped are not wrapped twice and back.
WRAPPED_MARKER = "_debug_kernel_wrapped"


class _Runtime:
    """Where calls are recorded, rebuilt by `configure()`."""

    def __init__(self, cfg: _config.KernelTraceConfig, previous: "_Runtime | None" = None) -> None:
        if previous is not None:
            previous.text.close()
        self.text = TextLog(cfg.log_dest)
        # Kernel spans go into the trace file; with the SDK on they also reach
        # the provider's processors, except in the black box (the file alone,
        # at level-1 detail, which works with OTEL_SDK_DISABLED too).
        self.spans = (KernelSpans(cfg.tracer_provider, sdk=cfg.spans, blackbox=cfg.blackbox)
                      if cfg.spans or cfg.blackbox else None)
        if cfg.level > 0 and cfg.spans and cfg.tracer_provider is None:
            # A provider the application installs from now on gets the trace file at once: its
            # request spans begun before the first kernel call are in the file from their start.
            watch_global_provider()
        # From level 3 a span carries its arguments' metadata, the black box's
        # too; level-5 statistics only outside the black box, which never
        # synchronises a device for its spans.
        self.span_arguments = self.spans is not None
        self.span_statistics = not cfg.blackbox
        # Level-5 statistics are computed for a reader that shows them: a span outside the black box, or the text log.
        self.statistics = self.span_statistics or self.text.enabled
        # Arguments are described (and, at level 5, their statistics computed)
        # only for a reader: the text log, or a span's attributes.
        self.describes_arguments = self.text.enabled or self.span_arguments
        # Calls of sites up to this level need their span alone: nothing to
        # describe, log or dump (-1: none).
        self.bare_upto = -1 if self.text.enabled or self.spans is None else 2
        follow_trace_file(cfg)
        # Level-10 counters and limits hold for the process while the dump settings stay.
        dumps = Dumps(cfg)
        self.dumps = previous.dumps if previous is not None and previous.dumps.settings == dumps.settings else dumps
        # Calls of sites above bare_upto up to this level need their span and
        # their arguments' metadata alone (no statistics, no dump): the
        # compiled core describes them.
        self.described_upto = -1 if self.bare_upto < 0 else 9 if cfg.blackbox else 4
        # Each call's outputs flagged on their device after it returns (capture/nan_flags.py), on either path;
        # where asked, its arguments before it runs.
        self.nan_flags = cfg.nan_flags
        self.flag_inputs = bool(cfg.nan_flags and cfg.nan_flag_inputs)
        nan_flags.ask_inputs(cfg.nan_flag_inputs if self.flag_inputs else ())
        if core.native is not None:  # the calls the compiled core records: those of the bare path, and these
            core.native.set_runtime(self.spans, self.bare_upto, self.spans.flags if self.spans is not None else 0,
                                    self.described_upto)
            core.native.set_nan_flags(nan_flags.flag_native if self.nan_flags else None,
                                      nan_flags.flag_inputs_native if self.flag_inputs else None,
                                      nan_flags.inputs_wanted)


_runtime = _Runtime(_config.get_config())
# Call numbers: the compiled core's counter where it records calls too.
_next_seq = core.native.next_seq if core.native is not None else itertools.count(1).__next__
# Where the recorder first saw a sticky device error (a CUDA error stays
# raised by every later call): so that no later call is blamed for it.
_device_fault: str | None = None
_ASYNC_NOTE = ("an asynchronous device error: it may come from any kernel launched since the last "
               "synchronisation")


def _statistics(infos: list) -> "BaseException | None":
    """Level-5 statistics of `infos`; the device error their transfer met,
    if any. A transfer that met none clears the CUDA graph replay that a
    later device error would have been blamed on."""
    fault = fill_statistics(infos)
    if (fault is None and _graphs is not None and _graphs.pending()
            and any(info.stats is not None and info.device != "cpu" for info in infos)):
        _graphs.healthy()
    return fault


def _saw_device_fault(where: str) -> None:
    global _device_fault
    if _device_fault is None:
        _device_fault = where


def _reconfigure(cfg: _config.KernelTraceConfig) -> None:
    """`configure()` sets tracing up at once, so that the application's request
    spans started before the first kernel already have a provider."""
    global _runtime
    _runtime = _Runtime(cfg, _runtime)
    if cfg.level > 0 and _runtime.spans is not None:
        _runtime.spans.setup()


def _after_fork_in_child() -> None:
    global _next_seq, _device_fault
    if core.native is None:
        _next_seq = itertools.count(1).__next__
    _device_fault = None
    _runtime.text.after_fork_in_child()
    _runtime.dumps.after_fork_in_child()


_config.on_change(_reconfigure)
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def kernel_tracer():
    """The tracer of the provider kernel spans go to (the global one when the
    SDK is off), so that batch and request spans land beside them."""
    spans = _runtime.spans
    if spans is None or not spans.sdk:
        return trace.get_tracer(schema.TRACER_NAME, __version__)
    return spans.tracer or spans.setup()


nan_flags.use_tracer(kernel_tracer)


def prime_parent(context, span_context) -> None:
    """Kernel calls about to run in `context`, whose current span has
    `span_context`, are given that span as their parent without looking
    for it there: a batch attaches a new context every step, and each
    step's first call would look."""
    parent = parent_entry(context, span_context)
    spans = _runtime.spans
    if spans is not None:
        spans.prime(parent)
    if core.native is not None:
        core.native.prime_parent(parent)


def _warn_once(what: str, exc: BaseException) -> None:
    warn_failed_once(what, exc, "; the kernel call goes on unrecorded in part")


_POSITIONAL_NAMES = [(f"arg[{i}]", f"input.arg{i}") for i in range(64)]


def _positional_names(index: int) -> tuple[str, str]:
    if index < len(_POSITIONAL_NAMES):
        return _POSITIONAL_NAMES[index]
    return f"arg[{index}]", f"input.arg{index}"


def _trace_ids(context, span_key: str) -> dict:
    """The ids a dump's metadata carries, to find its trace."""
    if not context.is_valid:
        return {}
    return {"trace_id": f"{context.trace_id:032x}", span_key: f"{context.span_id:016x}"}


# A call in progress, as the decorator keeps it: (the span's call tuple or
# None, the input attributes when spans carry them, the input paths holding
# NaN/Inf, the level-10 dump directory or None). A tuple: made once per call.
_Call = tuple


class KernelSite:
    """One decorated function: its name and level, fixed at decoration time."""

    __slots__ = ("name", "level", "skip_self", "with_args", "with_stats", "with_dumps", "function", "on_object")

    def __init__(self, func: Callable[..., Any], name: str, level: int) -> None:
        self.name = name
        self.level = level
        self.skip_self = takes_self_first(func)
        self.with_args = level >= 3
        self.with_stats = level >= 5
        self.with_dumps = level >= 10
        self.function = import_path(func) if self.with_dumps else None
        # A bound method's object, like a skipped self, is not in the dump.
        self.on_object = self.skip_self or inspect.ismethod(func)

    def begin(self, args: tuple, kwargs: dict, seq: int, extra: dict | None = None, kind_flags: int = 0) -> _Call | None:
        try:
            return self._begin(args, kwargs, seq, extra, kind_flags)
        except Exception as exc:
            _warn_once(f"recording the inputs of {self.name}", exc)
            return None

    def _begin(self, args: tuple, kwargs: dict, seq: int, extra: dict | None, kind_flags: int) -> _Call:
        """The start record is written before anything that synchronises a
        GPU (level-5 statistics, level-10 copies): a hang in earlier GPU work
        then leaves this call in flight with its shapes; the statistics and
        the dump directory follow in an ATTRIBUTES record, before the kernel."""
        runtime = _runtime
        positional = args[1:] if self.skip_self and args else args
        entries = ()
        if self.with_args and runtime.describes_arguments:
            entries = [(*_positional_names(i), describe(value)) for i, value in enumerate(positional)]
            entries += [(key, "input." + key, describe(value)) for key, value in kwargs.items()]
        spans = runtime.spans
        span = attrs = None
        nonfinite: list = []
        span_stats = self.with_stats and runtime.span_statistics
        stats = self.with_stats and runtime.statistics
        if spans is not None:
            if extra:  # a collective's group and number, first: a long argument list never pushes them out
                attrs = dict(extra)
            if entries and runtime.span_arguments:
                attrs = attrs or {}
                if span_stats:
                    # Placed first so that a long argument list never pushes them out.
                    attrs[schema.HAS_NAN] = attrs[schema.HAS_INF] = False
                    attrs[schema.NONFINITE] = ()
                for _, path, node in entries:
                    _attrs.add_value(attrs, path, node, False, nonfinite)
            span = spans.start(self.name, self.level, seq, attrs, kind_flags)
        if stats and entries:
            if _statistics(tensors_in([node for _, _, node in entries])) is not None:
                _saw_device_fault(f"before {self.name} (call {seq}) ran, so from earlier work")
        if runtime.text.enabled:
            lines = call_header(self.name)
            if positional and entries:
                lines += section_lines(
                    "Positional input arguments:", [(n, d) for n, _, d in entries[: len(positional)]], self.with_stats
                )
            if kwargs and entries:
                lines += section_lines(
                    "Keyword input arguments:", [(n, d) for n, _, d in entries[len(positional):]], self.with_stats
                )
        dump = skipped = None
        if self.with_dumps and runtime.dumps.wants(self.name):
            dump, skipped = self._dump_inputs(runtime, positional, kwargs, span)
            if runtime.text.enabled:
                lines.append(f"Dumped inputs to: {dump}" if dump else
                             "Tensor dump skipped: CUDA graph capture in progress" if skipped == SKIPPED_CAPTURE else
                             f"Tensor dump skipped: {skipped}")
        if runtime.text.enabled:
            runtime.text.write_lines(lines)
        if span is None:
            return (None, None, nonfinite, dump)
        added: dict = {}
        if dump is not None:
            added[schema.DUMP_DIR] = dump
        elif skipped is not None:
            added[schema.DUMP_SKIPPED] = skipped
        if span_stats and attrs is not None:
            for _, path, node in entries:
                _attrs.add_value(added, path, node, True, nonfinite, meta=False)
            if nonfinite:
                self._set_flags(added, nonfinite)
        if added:
            spans.add(span, added)
            if attrs is not None:
                attrs.update(added)
        return (span, attrs, nonfinite, dump)

    def _dump_inputs(self, runtime: _Runtime, positional: tuple, kwargs: dict,
                     span: tuple | None) -> tuple[str | None, str | None]:
        if is_graph_capturing("cuda"):
            return None, SKIPPED_CAPTURE
        # The span around the call: its recorded parent, else (no kernel spans) the current one.
        parent = (parent_context(span) or trace.INVALID_SPAN_CONTEXT) if span is not None else \
            trace.get_current_span().get_span_context()
        context = _trace_ids(parent, "parent_span_id")
        return runtime.dumps.save_inputs(self.name, self.function, self.on_object, positional, kwargs, context)

    @staticmethod
    def _span_ids(call: _Call) -> dict:
        return _trace_ids(call_context(call[0]), "span_id") if call[0] is not None else {}

    def _set_flags(self, attrs: dict, nonfinite: list) -> None:
        attrs[schema.NONFINITE] = tuple(nonfinite)
        attrs[schema.HAS_NAN] = any(attrs.get(schema.PREFIX + p + ".has_nan", False) for p in nonfinite)
        attrs[schema.HAS_INF] = any(attrs.get(schema.PREFIX + p + ".has_inf", False) for p in nonfinite)

    def finish(self, call: _Call | None, result: Any, hooked: "tuple | None" = None) -> None:
        """Ends a call that returned `result`; `hooked`: what an `After` hook
        added to it (attributes, a device error)."""
        if call is None:
            return
        span, _, _, dump = call
        runtime = _runtime
        added: dict | None = None
        events: tuple = ()
        fault = None
        try:
            dumped = dump is not None and runtime.dumps.save_outputs(dump, result, self._span_ids(call))
            if self.with_args and runtime.describes_arguments:
                node = describe(result)
                if self.with_stats and runtime.statistics:
                    fault = _statistics(tensors_in([node]))
                if runtime.text.enabled:
                    lines = [f"Dumped outputs to: {dump}"] if dumped else []
                    runtime.text.write_lines(lines + section_lines("Output:", [("return", node)], self.with_stats))
                if span is not None and runtime.span_arguments:
                    added, events = self._output(call, node)
        except Exception as exc:
            _warn_once(f"recording the result of {self.name}", exc)
        if hooked is not None:
            more, hook_fault = hooked
            added = {**(added or {}), **(more or {})} or None
            fault = fault or hook_fault
        if fault is not None:
            # Seen at the synchronisation right after this call: this call, or one launched before it.
            earlier = _device_fault
            graph = _graph_suspect()
            _saw_device_fault(f"after {self.name} ran")
            note = _ASYNC_NOTE + (f"; first seen {earlier}" if earlier else "; seen by the recorder after this call")
            if graph is not None and not earlier:
                note += f"; {graph[0]}"
                added = {**(added or {}), **graph[1]}
        if span is not None:
            try:
                if fault is not None:
                    runtime.spans.fail(span, fault, note, added)
                else:
                    runtime.spans.end(span, added, events)
            except Exception as exc:
                _warn_once(f"recording the end of {self.name}", exc)

    def _output(self, call: _Call, node) -> tuple[dict, tuple]:
        """The attributes the result adds, and the `nonfinite_output` event when
        it holds the first NaN/Inf."""
        _, inputs, inputs_nonfinite, _ = call
        outputs_nonfinite: list = []
        attrs: dict = {}
        _attrs.add_value(attrs, "output", node, self.with_stats and _runtime.span_statistics, outputs_nonfinite)
        events: tuple = ()
        if outputs_nonfinite:
            present = dict(inputs or {}, **attrs)
            self._set_flags(present, inputs_nonfinite + outputs_nonfinite)
            for key in (schema.NONFINITE, schema.HAS_NAN, schema.HAS_INF):
                attrs[key] = present[key]
            if not inputs_nonfinite:
                events = (("nonfinite_output", time_ns(), {schema.NONFINITE: tuple(outputs_nonfinite)}),)
            batch = batches.current()
            if batch is not None:
                requests = _nonfinite_requests(batch, node)
                if requests is not None:
                    attrs[schema.NONFINITE_REQUESTS] = requests
        return attrs, events

    def fail(self, call: _Call | None, exc: BaseException) -> None:
        if call is None:
            return
        runtime = _runtime
        span, _, _, dump = call
        if dump is not None:
            runtime.dumps.save_exception(dump, exc, self._span_ids(call))
        try:
            if isinstance(exc, Exception) and runtime.text.enabled:
                # SGLang logs Exception subclasses only (not KeyboardInterrupt, SystemExit).
                runtime.text.write_lines([exception_line(self.name, exc)])
        except Exception as inner:
            _warn_once(f"logging the exception of {self.name}", inner)
        if span is not None:
            note, added = "", None
            if _device_fault is not None and is_device_error(exc):
                note = f"a sticky device error, first seen {_device_fault}: not necessarily this call's"
            elif is_device_error(exc) and (graph := _graph_suspect()) is not None:
                # An asynchronous error seen first here: the newest CUDA graph replay comes first.
                _saw_device_fault(f"in {self.name}, after {graph[1][schema.GRAPH_SUSPECT]}")
                note, added = _ASYNC_NOTE + f"; {graph[0]}", graph[1]
            culprit = explained(exc)  # which request's input the call failed on, where an op can tell
            if culprit is not None:
                added = {**culprit, **(added or {})}
            try:
                runtime.spans.fail(span, exc, note, added)
            except Exception as inner:
                _warn_once(f"recording the exception of {self.name}", inner)


def _nonfinite_requests(batch: "batches.Batch", node) -> "tuple[str, ...] | None":
    """The requests of `batch` owning the output rows that hold NaN/Inf, in
    batch order and bounded; None when no flagged tensor's leading dimension
    maps to the batch's requests."""
    owners: "set[str] | None" = None
    for info in tensors_in([node]):
        if info.stats is None or not (info.stats[3] or info.stats[4]) or not info.shape:
            continue
        rows = nonfinite_rows(info)
        named = None if rows is None else batch.owners(info.shape[0], rows)
        if named is not None:
            owners = (owners or set()).union(named)
    if owners is None:
        return None
    return tuple(name for name in batch.names if name in owners)[: batches.MAX_NONFINITE_REQUESTS]


# The interface capture hooks register through (capture/collectives.py,
# graphs.py; loaded with this module by capture/recording.py): a hook that
# sees a call before it runs: (attributes, trace-file flags, call number or
# None for the next one), or None for a call not to record; and one after
# it: None, or (attributes added at its end, a device error the hook's own
# synchronisation met). Hooks run on every call, unguarded: each catches its
# own errors. `wrap_hooked` records a function with them.
Before = Callable[[tuple, dict], "tuple | None"]
After = Callable[[tuple, "tuple | None", Any], "tuple | None"]


class GraphWatch(Protocol):
    """What the CUDA graph recorder tells the decorator (`watch_graphs`)."""

    def captured(self, name: str, args: tuple, kwargs: dict, extra: "dict | None") -> "dict | None":
        """A call made while this thread captures a graph: `extra` with its place in the graph."""

    def suspect(self) -> "tuple[str, dict] | None":
        """The replay a device error met now is blamed on: a note and attributes."""

    def pending(self) -> bool:
        """Whether a replay would be blamed for a device error met now."""

    def healthy(self) -> None:
        """The recorder synchronised and saw no device error."""

    def captured_inputs(self, marks: "dict | None", name: str, values: tuple, keywords: tuple, skip: int) -> None:
        """Before a call captured into a graph runs with `values` (positional, then keyword ones named
        `keywords`; the first `skip` its self), where its arguments are flagged."""

    def captured_output(self, marks: dict, result: Any) -> None:
        """After a call captured into a graph returned `result` (`marks`: what `captured` added)."""


_graphs: "GraphWatch | None" = None
# How many CUDA graphs are being captured now (`capturing`): while any is,
# each call is marked with its graph and joins its call list.
_capturing = 0


def watch_graphs(watch: GraphWatch) -> None:
    global _graphs
    _graphs = watch


def _graph_suspect() -> "tuple[str, dict] | None":
    return _graphs.suspect() if _graphs is not None else None


def capturing(delta: int) -> None:
    """A graph capture began (+1) or ended (-1) on some thread."""
    global _capturing
    _capturing += delta
    if core.native is not None:
        core.native.set_capturing(_capturing)


def _flag_inputs(site: KernelSite, call: "tuple | None", seq: int, args: tuple, kwargs: dict,
                 extra: "dict | None") -> "int | None":
    """A call's arguments flagged before it runs where SGLANG_KERNEL_API_NAN_FLAGS_INPUTS asks (while a
    graph is captured, by the graph NaN check's captured reductions): what its outputs' flags name."""
    if not nan_flags.inputs_wanted(site.name):  # before any work: most calls are not asked for
        return None
    values, keywords, skip = args + tuple(kwargs.values()) if kwargs else args, tuple(kwargs), \
        1 if site.skip_self and args else 0
    if _capturing:
        _graphs.captured_inputs(extra, site.name, values, keywords, skip)
        return None
    return nan_flags.flag_inputs(call, seq, values, keywords, skip, extra)


def _wrap_coroutine(func: F, site: KernelSite, attributes: "dict | None") -> F:
    """The recorded version of a coroutine function: the call spans its
    whole await (in flight while it awaits, its exception, its result)."""

    @functools.wraps(func)
    async def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return await func(*args, **kwargs)
        seq = _next_seq()
        call = site.begin(args, kwargs, seq, attributes)
        token = awaited(call[0]) if call is not None and call[0] is not None else None
        try:
            inputs = _flag_inputs(site, call and call[0], seq, args, kwargs, attributes) if _runtime.flag_inputs \
                else None
            result = await func(*args, **kwargs)
        except BaseException as exc:
            if token is not None:
                otel_context.detach(token)
            site.fail(call, exc)
            raise
        if token is not None:
            otel_context.detach(token)
        if _runtime.nan_flags:
            nan_flags.flag(call and call[0], seq, result, attributes, inputs)
        site.finish(call, result)
        return result

    setattr(wrapper, WRAPPED_MARKER, True)
    return wrapper  # type: ignore[return-value]


def _wrap(func: F, name: str, level: int, before: Before | None = None, after: After | None = None,
          replay: "tuple | None" = None, attributes: "dict | None" = None) -> F:
    """The recorded version of `func`, optionally with hooks (see `Before`,
    `After`, `wrap_hooked`) or with `attributes` of its own on every call
    (see `rewrap`)."""
    site = KernelSite(func, name, level)
    attributes = attributes or None
    if before is None and inspect.iscoroutinefunction(func):
        return _wrap_coroutine(func, site, attributes)

    @functools.wraps(func)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if is_compiling():
            return func(*args, **kwargs)
        if before is None:
            extra, kind_flags, seq = attributes, 0, _next_seq()
        else:
            hooked = before(args, kwargs)
            if hooked is None:
                return func(*args, **kwargs)
            extra, kind_flags, seq = hooked
            if seq is None:
                seq = _next_seq()
        if _capturing:
            extra = _graphs.captured(name, args, kwargs, extra)
        runtime = _runtime
        # The outer handler costs nothing until an exception passes (an
        # exception table): see spans.unwind.
        try:
            if level <= runtime.bare_upto:
                # The span alone (level 1 without a text log, the black box): no
                # description, so none of the general path's layers.
                spans = runtime.spans
                try:
                    span = spans.start(name, level, seq, extra, kind_flags)
                except Exception as exc:
                    _warn_once(f"recording the start of {name}", exc)
                    return func(*args, **kwargs)
                try:
                    inputs = _flag_inputs(site, span, seq, args, kwargs, extra) if runtime.flag_inputs else None
                    result = func(*args, **kwargs)
                except BaseException as exc:
                    site.fail((span, None, None, None), exc)
                    raise
                if _capturing:
                    _graphs.captured_output(extra, result)
                elif runtime.nan_flags:
                    nan_flags.flag(span, seq, result, extra, inputs)
                if after is not None:
                    hooked = after(args, span, result)
                    if hooked is not None:  # attributes or a device error for the end
                        site.finish((span, None, None, None), result, hooked)
                        return result
                try:
                    spans.end(span)
                except Exception as exc:
                    _warn_once(f"recording the end of {name}", exc)
                return result
            call = site.begin(args, kwargs, seq, extra, kind_flags)
            try:
                inputs = _flag_inputs(site, call and call[0], seq, args, kwargs, extra) if runtime.flag_inputs \
                    else None
                result = func(*args, **kwargs)
            except BaseException as exc:
                site.fail(call, exc)
                raise
            if _capturing:
                _graphs.captured_output(extra, result)
            elif runtime.nan_flags:
                nan_flags.flag(call and call[0], seq, result, extra, inputs)
            site.finish(call, result, after(args, call and call[0], result) if after else None)
            return result
        except BaseException as exc:
            unwind(seq, exc, _runtime.spans)
            raise

    setattr(wrapper, WRAPPED_MARKER, True)
    plain = before is None and after is None and replay is None
    if plain:  # what `rewrap` starts from
        wrapper._kernel_site, wrapper._kernel_attributes = site, attributes  # type: ignore[attr-defined]
    if core.native is None or (replay is None and (before is not None or after is not None)):
        return wrapper  # type: ignore[return-value]
    # The compiled core records the calls of the bare path (and a graph's
    # replays, doing what its hooks do) and hands the others to `wrapper`. torch.compile traces `__original_fn` of an object
    # so marked (as torch.jit.script_if_tracing marks its wrappers): the
    # kernel itself, as through `wrapper`, which calls straight through then.
    recorded = core.native.Recorded(func, wrapper, site, name, level, replay,
                                    tracefile.encode(attributes) if attributes else None)
    functools.update_wrapper(recorded, func)
    if plain:
        recorded._kernel_site, recorded._kernel_attributes = site, attributes
    for key, value in ((WRAPPED_MARKER, True), ("__original_fn", func), ("__script_if_tracing_wrapper", True)):
        setattr(recorded, key, value)
    if hasattr(func, "__globals__"):  # where torch.library resolves the annotations of a custom op's function
        recorded.__globals__ = func.__globals__
    return recorded  # type: ignore[return-value]


def _native_failed(site: KernelSite, call: tuple, exc: BaseException) -> None:
    """A call the compiled core recorded raised `exc`: ended as the bare path ends it."""
    site.fail((call, None, None, None), exc)


def _add_described(attrs: dict, path: str, value: Any) -> None:
    """A value the compiled core leaves to the Python path (a container, an
    object, a tensor subclass, another layout), described as this path does."""
    _attrs.add_value(attrs, path, describe(value), False, [])


if core.native is not None:
    core.native.setup(tracefile.per_thread, *core.context_var(), parent_of, _native_failed, *compiler_flags())
    core.native.set_describer(torch.Tensor, torch.nn.Parameter, dtype_names(), torch.strided, schema.PREFIX,
                              _add_described, tracefile.encode, identity_plan, enum.Enum)


def wrap_hooked(func: F, name: str, before: Before, after: After | None = None, *,
                replay: "tuple | None" = None) -> F:
    """`func` recorded as `name` at the level in force, with hooks (a
    collective, a CUDA graph's replay). `replay`, for a graph's replay
    (capture/graphs.py): (the attribute its graph object keeps its Graph in,
    the thread-local whose `attributes` go on the span, the list [pending
    replay, output check on]), with which the compiled core records the
    replays the hooks would record alone, and updates the list as `after`."""
    return _wrap(func, name, _config.get_config().level, before, after, replay)


def rewrap(recorded: Callable[..., Any], attributes: dict) -> "Callable[..., Any] | None":
    """A new recorded version of the function a plain recorded wrapper
    (`debug_kernel_api`'s) records, under the same name, whose every call
    also carries `attributes` (text, numbers: what a layer knows of itself,
    such as its module path) besides those it had, written with its start
    at no cost per call. None when `recorded` is no such wrapper (hooked
    ones included). A bound method gives an unbound wrapper of its function."""
    site = getattr(recorded, "_kernel_site", None)
    function = getattr(recorded, "__wrapped__", None)
    if not isinstance(site, KernelSite) or function is None:
        return None
    return _wrap(function, site.name, site.level,
                 attributes={**(getattr(recorded, "_kernel_attributes", None) or {}), **attributes})


@overload
def debug_kernel_api(func: F, *, op_name: str | None = None) -> F: ...


@overload
def debug_kernel_api(*, op_name: str | None = None) -> Callable[[F], F]: ...


def debug_kernel_api(func: Callable[..., Any] | None = None, *, op_name: str | None = None) -> Any:
    """Records each call of the decorated kernel entry point: SGLang's text log
    and one OpenTelemetry span. At level 0 the function itself is returned."""
    level = _config.get_config().level
    if level == 0:
        return (lambda f: f) if func is None else func

    def decorate(f: F) -> F:
        if hasattr(f, WRAPPED_MARKER):
            return f
        return _wrap(f, op_name or infer_api_name(f), level)

    return decorate if func is None else decorate(func)


def debug_torch_op(op_func: Callable[..., Any], op_name: str, *, namespace: str = "sglang") -> Callable[..., Any]:
    """`torch.ops.<namespace>.<op_name>`, wrapped and named after `op_func` (the
    Python function the op was registered from) when logging is on."""
    op = getattr(getattr(torch.ops, namespace), op_name)
    if _config.get_config().level == 0:
        return op
    if hasattr(op_func, WRAPPED_MARKER):
        # Its Python side is already recorded: keep the op raw, and marked so
        # that decorating it later is a no-op too.
        setattr(op, WRAPPED_MARKER, True)
        return op
    return debug_kernel_api(op, op_name=infer_api_name(op_func))


def wrap_method_with_debug_kernel_once(
    obj: Any, method_name: str, *, op_name: str, marker_attr: str | None = None
) -> Any:
    """Replaces `obj.<method_name>` by its recorded version, once per object."""
    if _config.get_config().level == 0:
        return obj
    marker = marker_attr or f"_debug_kernel_{method_name}_wrapped"
    if getattr(obj, marker, False):
        return obj
    setattr(obj, method_name, debug_kernel_api(getattr(obj, method_name), op_name=op_name))
    setattr(obj, marker, True)
    return obj
