"""SGLang's own kernel logging, made ours: `install()` replaces
`debug_kernel_api`, `debug_torch_op` and `wrap_method_with_debug_kernel_once`
in `sglang.kernels.kernel_api_logging` the moment that module is imported,
before SGLang's layers import them from it, so every kernel SGLang decorates
(custom ops, attention backends, quant methods) produces our spans, trace file
and text log. With SGLang's request tracing on (`--enable-trace`), SGLang
installs its TracerProvider, which kernel spans then share, and each
`Scheduler.run_batch` runs inside a `forward_batch` span linked to the root
span of every request in the batch (it ends once `process_batch_result` has
processed the batch's results: a scheduler killed in between died serving
it), so kernels attach to its request traces
(with each request's rows: NaN/Inf in an output is traced to its requests);
the batch's trace id comes from its step and requests, so the tensor-parallel
ranks' kernels of one batch share a trace. The collectives of its
`GroupCoordinator` (all-reduce with its custom and pynccl paths, all-gather,
reduce-scatter, broadcast, send/recv of tensors, dicts and objects) are
recorded like torch.distributed's (capture/collectives.py), and the
scheduler's ranks (tp, pp, dp, ep, attention tp/dp) go into the trace file
and the resource.

Beyond what SGLang decorates, the ops that real crashes happen in and SGLang
does not decorate are recorded too: the embedding lookup, where an
out-of-vocabulary token fails, and the sampler, where a request asking for
more top logprobs than the vocabulary has fails, each naming the request
whose input it was (`EXPLAINED_OPS`), and the logits processor
(`UNDECORATED_OPS`);
each fused op's span names its class (`sglang.kernel.op_class`: all of them
run as `BaseFusedOp.forward`), and once the model is loaded each layer's call
names its module (`sglang.kernel.module`, `model.layers.1.mlp.down_proj`),
fixed per layer when it is named, so a call costs nothing more.

A request SGLang rejects before its scheduler (a 400) has its root span
ended, status ERROR with why, where SGLang leaves it open.

Install it before SGLang is imported: `sglang-otel-kernels run -- python -m
sglang.launch_server ...` does so in every process of the server (its
spawned scheduler and worker processes included).
"""

from __future__ import annotations

import functools
import importlib
import inspect
import os
import sys
import types
from typing import Any, Callable

from .. import config as _config
from ..capture import import_hooks
from ..capture.patches import Instrumentation, Patch
from ..notices import warn, warn_failed_once

LOGGING_MODULE = "sglang.kernels.kernel_api_logging"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
PARALLEL_STATE_MODULE = "sglang.srt.distributed.parallel_state"
RUNTIME_CONTEXT_MODULE = "sglang.srt.runtime_context"
# SGLang's CUDA graph runners (0.5.23) and the backend that captures and replays their graphs.
GRAPH_RUNNERS = {"sglang.srt.model_executor.runner.decode_cuda_graph_runner": "DecodeCudaGraphRunner",
                 "sglang.srt.model_executor.runner.prefill_cuda_graph_runner": "PrefillCudaGraphRunner"}
GRAPH_BACKEND_MODULE = "sglang.srt.model_executor.runner_backend.full_cuda_graph_backend"
FUSED_OP_MODULE = "sglang.kernels.fused_op"
MODEL_RUNNER_MODULE = "sglang.srt.model_executor.model_runner"
TOKENIZER_MANAGER_MODULE = "sglang.srt.managers.tokenizer_manager"
# Where SGLang's samplers find `sanitize_nan_logits` (the sampler imports it; speculative decoding's
# verification imports it from async_probe when it runs), and the name of the logits' mark.
SANITIZER_MODULES = ("sglang.srt.utils.async_probe", "sglang.srt.layers.sampler")
LOGITS_MARK = "sglang.sampler.logits"
# Where SGLang is told to stop (0.5.23), recorded as a stop so that a server
# stopped on purpose reads "stopped", not "ended" or "died": its launcher's
# handlers (run in its event loop: no signal-time writes) and the scheduler's
# ShutdownReq, after which it exits, or its launcher kills it.
STOPS = {
    (TOKENIZER_MANAGER_MODULE, "SignalHandler", "sigterm_handler"): "SIGTERM, taken by SGLang's handler",
    (TOKENIZER_MANAGER_MODULE, "SignalHandler", "running_phase_sigquit_handler"):
        "SIGQUIT from SGLang's launcher: one of its processes failed",
    (SCHEDULER_MODULE, "Scheduler", "handle_shutdown"): "SGLang's ShutdownReq from its launcher",
}
# Where crashes happen that SGLang's logger does not see (0.5.23): the
# embedding lookup (an out-of-vocabulary token: IndexError on the CPU, a
# device-side assert on a GPU) and the sampler (top_logprobs_num beyond the
# vocabulary: RuntimeError, on either), recorded with the rule that names the
# request whose input it was (`EXPLAINED_OPS`, below its rules), and the
# logits, named as SGLang infers a name.
UNDECORATED_OPS = ("sglang.srt.layers.logits_processor:LogitsProcessor.forward",)
QUANT_METHODS = ("apply", "embedding")  # a layer's quant method's recorded calls, named after the layer
MAX_REPLAY_REQUESTS = 64  # request ids a replay's span names (its batch span names them all)
NAMES = ("debug_kernel_api", "debug_torch_op", "wrap_method_with_debug_kernel_once")
BATCH_SPAN = "sglang.forward_batch"
SCHEDULER_INIT_SPAN = "sglang.scheduler.init"
# On a Scheduler: (its batch, its span, its out_cache_loc) until the batch's results are processed.
_OPEN_BATCH = "_sglang_otel_kernels_open_batch"
LOGDEST = "SGLANG_KERNEL_API_LOGDEST"

_installed: Instrumentation | None = None


def install() -> Instrumentation:
    """Idempotent; returns the handle whose `undo()` (or `uninstall()`) gives
    SGLang its own functions back."""
    global _installed
    if _installed is not None and _installed.active:
        return _installed
    from ..record.setup import watch_global_provider

    watch_global_provider()  # SGLang's own spans recorded from its process_tracing_init on
    handle = Instrumentation("sglang")
    handle.on_undo(import_hooks.before_import(LOGGING_MODULE, _no_logger_file))
    handle.on_undo(import_hooks.when_imported(LOGGING_MODULE, functools.partial(_patch_logging, handle)))
    handle.on_undo(import_hooks.when_imported(SCHEDULER_MODULE, functools.partial(_patch_scheduler, handle)))
    handle.on_undo(import_hooks.when_imported(PARALLEL_STATE_MODULE, functools.partial(_patch_coordinator, handle)))
    for module, runner in GRAPH_RUNNERS.items():
        handle.on_undo(import_hooks.when_imported(module, functools.partial(_patch_runner, handle, runner)))
    handle.on_undo(import_hooks.when_imported(GRAPH_BACKEND_MODULE, functools.partial(_patch_graph_backend, handle)))
    if _config.get_config().level > 0:
        from ..capture.paths import instrument

        for path in UNDECORATED_OPS:
            handle.on_undo(instrument(path).undo)
        for (module, owner, method), (name, rule) in EXPLAINED_OPS.items():
            handle.on_undo(import_hooks.when_imported(module, functools.partial(
                _record_explaining, handle, owner, method, name, rule)))
        handle.on_undo(import_hooks.when_imported(FUSED_OP_MODULE, functools.partial(_patch_fused_ops, handle)))
        handle.on_undo(import_hooks.when_imported(MODEL_RUNNER_MODULE, functools.partial(_patch_model_runner, handle)))
        handle.on_undo(import_hooks.when_imported(TOKENIZER_MANAGER_MODULE,
                                                  functools.partial(_patch_rejections, handle)))
        for module in dict.fromkeys(module for module, _, _ in STOPS):
            handle.on_undo(import_hooks.when_imported(module, functools.partial(_patch_stops, handle)))
        if _config.get_config().nan_flags:
            for module in SANITIZER_MODULES:
                handle.on_undo(import_hooks.when_imported(module, functools.partial(_patch_sanitizer, handle)))
    _installed = handle
    return handle


def uninstall() -> None:
    if _installed is not None:
        _installed.undo()


def _no_logger_file() -> Callable[[], None]:
    """SGLang's module opens its logger's destination when it is imported: a
    file for anything but stdout/stderr (a file named `off` for ours). Its
    functions are replaced right after, so that logger never writes: while
    the module runs it is given stderr to open instead, then the variable is
    put back."""
    previous = os.environ.get(LOGDEST)
    if previous is None or previous.strip() in ("stdout", "stderr"):
        return lambda: None
    os.environ[LOGDEST] = "stderr"

    def restore() -> None:
        os.environ[LOGDEST] = previous

    return restore


def _patch_logging(handle: Instrumentation, module: Any) -> None:
    from ..capture.recording import decorator

    originals = {name: getattr(module, name, None) for name in NAMES}
    for name in NAMES:
        if originals[name] is not None and originals[name] is not getattr(decorator, name):
            handle.add(Patch(module, name, getattr(decorator, name)))
    # Modules that imported SGLang's functions before this keep them.
    early = sorted(
        other_name for other_name, other in list(sys.modules.items())
        if other_name.startswith("sglang.") and other_name != LOGGING_MODULE and other is not None
        and any(originals[name] is not None and vars(other).get(name) is originals[name] for name in NAMES)
    )
    if early:
        shown = ", ".join(early[:5]) + (f" and {len(early) - 5} more" if len(early) > 5 else "")
        warn(f"SGLang modules imported before the integration keep SGLang's own logger: {shown}; "
             "install it first (sglang-otel-kernels run -- <command>)")


def _rows(batch: Any, requests: int) -> "list[int] | None":
    """Each request's rows in a ScheduleBatch's token-flattened tensors, for
    NaN provenance: one in decode, its extend length in prefill, extend and
    mixed batches; None where SGLang's batch says neither (speculative
    verification, an idle batch, fields this version lacks)."""
    try:
        mode = batch.forward_mode
        if mode.is_decode():
            return [1] * requests
        lengths = getattr(batch, "extend_lens", None)
        if (mode.is_extend() and not getattr(mode, "is_target_verify", lambda: False)()
                and lengths is not None and len(lengths) == requests):
            return [int(length) for length in lengths]
    except Exception:  # a batch without these fields: rows stay unknown, the batch runs
        pass
    return None


# SGLang's rank names (its ParallelContext) and ours (record/identity.py).
_RANKS = (("tp_rank", "tp_rank"), ("pp_rank", "pp_rank"), ("dp_rank", "dp_rank"), ("moe_ep_rank", "ep_rank"),
          ("attn_tp_rank", "attn_tp_rank"), ("attn_dp_rank", "attn_dp_rank"))


def _learn_ranks() -> None:
    """This scheduler's ranks as SGLang published them, into the trace file
    and the resource. Each is read on its own: an unpublished one raises."""
    from ..record import identity

    try:
        parallel = importlib.import_module(RUNTIME_CONTEXT_MODULE).get_parallel()
    except Exception:
        return
    found = {}
    for theirs, ours in _RANKS:
        try:
            value = getattr(parallel, theirs)
        except Exception:
            continue
        if type(value) is int:
            found[ours] = value
    identity.update(**found)


def _patch_scheduler(handle: Instrumentation, module: Any) -> None:
    scheduler = getattr(module, "Scheduler", None)
    original = getattr(scheduler, "run_batch", None)
    if original is None or _config.get_config().level == 0:
        return
    from ..capture.requests import open_batch, span_context_of

    learnt = []  # once a batch has run

    @functools.wraps(original)
    def run_batch(self, batch, *args, **kwargs):
        if not learnt:  # a scheduler made without its __init__ (or before the ranks were published)
            learnt.append(True)
            _learn_ranks()
        unprocessed = self.__dict__.pop(_OPEN_BATCH, None)
        if unprocessed is not None:  # a batch whose results were never processed
            unprocessed[1].end()
        # Every decode step comes here: one loop, no helper calls or comprehension frames.
        members, rids = [], []
        for request in getattr(batch, "reqs", None) or ():
            rid = getattr(request, "rid", None)
            trace_context = getattr(getattr(request, "time_stats", None), "trace_ctx", None)
            # An untraced request (no --enable-trace: every request, every step) holds SGLang's
            # TraceNullContext, which answers every attribute with itself: told apart as SGLang does.
            traced = getattr(trace_context, "tracing_enable", True) is not False
            name = str(rid)
            members.append((span_context_of(getattr(trace_context, "root_span_context", None)) if traced else None,
                            None if rid is None else name))
            rids.append(name)
        # Every tensor-parallel rank runs the same step on the same requests: one trace for all.
        opened = open_batch(members, BATCH_SPAN, None, (getattr(self, "forward_ct", None), tuple(rids)),
                            _rows(batch, len(members)), processes_results)
        try:
            result = original(self, batch, *args, **kwargs)
        except BaseException as exc:
            opened.close(exc)
            raise
        opened.close(None)
        if processes_results:
            # SGLang's overlap loop (the default) processes a copy of the batch (ScheduleBatch.copy) a
            # step later: the copy shares the tensor of the step's output slots, new every step.
            self.__dict__[_OPEN_BATCH] = (batch, opened.span, getattr(batch, "out_cache_loc", None))
        return result

    handle.add(Patch(scheduler, "run_batch", run_batch))
    process = getattr(scheduler, "process_batch_result", None)
    processes_results = process is not None
    if processes_results:
        @functools.wraps(process)
        def process_batch_result(self, batch, *args, **kwargs):
            # The batch's span ends once its results are processed (the scheduler's own Python, a
            # good part of a step on the CPU): a scheduler killed meanwhile died serving that batch.
            pending = self.__dict__.get(_OPEN_BATCH)
            if pending is None or (pending[0] is not batch and (
                    pending[2] is None or getattr(batch, "out_cache_loc", None) is not pending[2])):
                return process(self, batch, *args, **kwargs)  # an earlier batch's, ended by the next run_batch
            del self.__dict__[_OPEN_BATCH]
            return _ending(pending[1], process, self, batch, *args, **kwargs)

        handle.add(Patch(scheduler, "process_batch_result", process_batch_result))
    init = scheduler.__init__

    @functools.wraps(init)
    def __init__(self, *args, **kwargs):
        # Ranks known before the model loads and its kernels run (the first batch looks again).
        _learn_ranks()
        # The start is a stage of its own: a rank that cannot start (SGLang's run_scheduler_process
        # catches the exception, tells its parent and returns) fails in it, and one killed while it
        # loads dies in it, named in the report like a batch.
        from opentelemetry import trace

        from ..schema import STAGE

        stage = _engine_span(SCHEDULER_INIT_SPAN, {STAGE: "init"})

        def initialise():
            with trace.use_span(stage, end_on_exit=False, record_exception=False, set_status_on_exception=False):
                return init(self, *args, **kwargs)

        return _ending(stage, initialise)

    handle.add(Patch(scheduler, "__init__", __init__))


def _patch_stops(handle: Instrumentation, module: Any) -> None:
    for (name, owner, method), reason in STOPS.items():
        original = getattr(getattr(module, owner, None), method, None) if name == module.__name__ else None
        if original is not None:
            handle.add(Patch(getattr(module, owner), method, _then_stop(original, reason)))


def _own_method(module: Any, owner: str, name: str) -> "tuple[Any, Any]":
    """(class `owner` of `module`, its own `name`), each None where absent
    (a version of SGLang without them: nothing is patched)."""
    cls = getattr(module, owner, None)
    return cls, (vars(cls).get(name) if isinstance(cls, type) else None)


def _patch_rejections(handle: Instrumentation, module: Any) -> None:
    """`TokenizerManager._release_req_states_on_failure`, which SGLang calls
    when a request failed before reaching its scheduler (over the context
    length: a 400): SGLang drops its state and never ends its root span
    (`Req <rid>`), which read as unfinished for ever in the trace file and
    never reached the back end. It is ended here, status ERROR with why."""
    manager, original = _own_method(module, "TokenizerManager", "_release_req_states_on_failure")
    if original is None:
        return

    @functools.wraps(original)
    def release(self, request_states, *args, **kwargs):
        try:
            _end_rejected(self, request_states, sys.exc_info()[1])
        except Exception as exc:  # SGLang's cleanup goes on regardless
            warn_failed_once("ending a rejected request's span", exc)
        return original(self, request_states, *args, **kwargs)

    handle.add(Patch(manager, "_release_req_states_on_failure", release))


def _end_rejected(manager: Any, request_states: Any, exc: "BaseException | None") -> None:
    """The root spans of the requests of `request_states` that SGLang drops
    undelivered (as its cleanup decides: still its state, never dispatched)."""
    from opentelemetry.trace import Status, StatusCode

    from ..record.spans import describe_exception

    states = getattr(manager, "rid_to_state", None) or {}
    for rid, state in request_states.items():
        if states.get(rid) is not state or getattr(state, "dispatched", True):
            continue
        context = getattr(getattr(state, "time_stats", None), "trace_ctx", None)
        root = getattr(context, "root_span", None)
        if root is None or not getattr(root, "is_recording", lambda: False)():
            continue
        said = describe_exception(exc) if exc is not None else "the request failed"
        root.set_status(Status(StatusCode.ERROR, f"rejected before reaching the scheduler: {said}"))
        context.trace_req_finish()  # SGLang's own ending: its thread spans, then the root


def _then_stop(original: Callable, reason: str) -> Callable:
    @functools.wraps(original)
    def stopping(*args, **kwargs):
        _record_stop(reason)
        return original(*args, **kwargs)
    return stopping


def _record_stop(reason: str) -> None:
    """A `sglang.process.stop` span saying why this process was told to stop
    (its trace file then reads "stopped")."""
    from ..schema import STOP_REASON, STOP_SPAN

    _engine_span(STOP_SPAN, {STOP_REASON: reason}).end()


def _ending(span: Any, call: Callable, *args, **kwargs) -> Any:
    """`call(*args, **kwargs)`, then `span` ended, the call's exception
    recorded on it (status ERROR). No context manager: it runs every decode step."""
    try:
        return call(*args, **kwargs)
    except BaseException as exc:
        from ..record.spans import record_failure  # torch is imported by the time SGLang runs

        record_failure(span, exc)
        raise
    finally:
        span.end()


def _patch_sanitizer(handle: Instrumentation, module: Any) -> None:
    """With the NaN flags on: the logits SGLang samples from, flagged a row
    (a request) each just before `sanitize_nan_logits` (which, with
    SGLANG_SANITIZE_NAN_LOGITS, turns NaN/Inf into numbers and the request
    is served as if healthy): a request whose row held NaN/Inf gets the
    flags' mark with NONFINITE_LOGITS in its trace, found at the step's end
    like any flag, whichever call made the NaN."""
    original = getattr(module, "sanitize_nan_logits", None)
    if original is None or getattr(original, "_sglang_otel_kernels_watched", False):
        return  # not this version's, or the sampler imported ours from async_probe
    from ..capture import nan_flags
    from ..schema import NONFINITE_LOGITS

    marks = {NONFINITE_LOGITS: True}

    @functools.wraps(original)
    def sanitize_nan_logits(logits, *args, **kwargs):
        nan_flags.watch(logits, LOGITS_MARK, marks)
        return original(logits, *args, **kwargs)

    sanitize_nan_logits._sglang_otel_kernels_watched = True  # type: ignore[attr-defined]
    handle.add(Patch(module, "sanitize_nan_logits", sanitize_nan_logits))


def _engine_span(name: str, attributes: dict) -> Any:
    """A span of the engine's own (a stage, a stop) beside the kernel spans; a
    non-recording one where it cannot be made: SGLang goes on regardless."""
    from opentelemetry import trace

    try:
        from ..capture.decorator import kernel_tracer

        return kernel_tracer().start_span(name, attributes=attributes)
    except Exception as exc:
        warn_failed_once(f"recording {name}", exc)
        return trace.INVALID_SPAN


def _patch_coordinator(handle: Instrumentation, module: Any) -> None:
    cfg = _config.get_config()
    if cfg.level == 0:
        return
    # SGLang's ranks are published by the time its process groups are built:
    # learnt then, in every process that builds them, before a model loads.
    for setup in ("init_distributed_environment", "initialize_model_parallel"):
        original = getattr(module, setup, None)
        if original is not None:
            handle.add(Patch(module, setup, _then_learn_ranks(original)))
    coordinator = getattr(module, "GroupCoordinator", None)
    if coordinator is None or not cfg.collectives:
        return
    from .sglang_collectives import record_coordinator  # needs torch, imported by now

    record_coordinator(coordinator, handle)


def _patch_runner(handle: Instrumentation, name: str, module: Any) -> None:
    """A graph runner's `execute(forward_batch)`: the replays it makes carry
    the batch's size, forward mode and requests."""
    runner = getattr(module, name, None)
    original = vars(runner).get("execute") if runner is not None else None
    if original is None or _config.get_config().level == 0:
        return
    from ..capture.graphs import replay_attributes  # needs torch, imported by now
    from ..schema import BATCH_REQUEST_IDS, BATCH_SIZE, FORWARD_MODE

    @functools.wraps(original)
    def execute(self, forward_batch, *args, **kwargs):
        try:
            mode = getattr(getattr(forward_batch, "forward_mode", None), "name", None)
            rids = list(getattr(forward_batch, "rids", None) or ())[:MAX_REPLAY_REQUESTS]
            context = replay_attributes(**{BATCH_SIZE: getattr(forward_batch, "batch_size", None), FORWARD_MODE: mode,
                                           BATCH_REQUEST_IDS: tuple(map(str, rids)) or None})
        except Exception as exc:  # never in the way of SGLang's forward pass
            warn_failed_once("reading a CUDA graph replay's batch", exc)
            return original(self, forward_batch, *args, **kwargs)
        with context:
            return original(self, forward_batch, *args, **kwargs)

    handle.add(Patch(runner, "execute", execute))


def _patch_graph_backend(handle: Instrumentation, module: Any) -> None:
    """The backend's `capture_one(shape_key, ...)`: the graph it made and the
    outputs it keeps are watched (SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK)."""
    backend = getattr(module, "FullCudaGraphBackend", None)
    original = vars(backend).get("capture_one") if backend is not None else None
    if original is None or _config.get_config().level == 0:
        return
    from ..capture.graphs import watch_graph_outputs

    @functools.wraps(original)
    def capture_one(self, shape_key, *args, **kwargs):
        result = original(self, shape_key, *args, **kwargs)
        try:
            graph = getattr(self, "_graphs", {}).get(shape_key)
            if graph is not None:
                watch_graph_outputs(graph, getattr(self, "_outputs", {}).get(shape_key))
        except Exception as exc:  # a backend whose fields changed: the capture stands, unwatched
            warn_failed_once("watching a CUDA graph's outputs", exc)
        return result

    handle.add(Patch(backend, "capture_one", capture_one))


def _then_learn_ranks(original: Callable) -> Callable:
    @functools.wraps(original)
    def call(*args, **kwargs):
        result = original(*args, **kwargs)
        _learn_ranks()
        return result

    return call


def _patch_fused_ops(handle: Instrumentation, module: Any) -> None:
    """Each subclass of `BaseFusedOp` made from now on (RMSNorm, SiluAndMul,
    RotaryEmbedding, ...) gets the base's recorded `forward` under the same
    name with its class as `sglang.kernel.op_class`: SGLang decorates the
    base's method once, so every fused op's call reads `BaseFusedOp.forward`."""
    from ..capture.decorator import rewrap
    from ..schema import OP_CLASS

    base = getattr(module, "BaseFusedOp", None)
    forward = vars(base).get("forward") if isinstance(base, type) else None
    if getattr(forward, "_kernel_site", None) is None:
        return
    ours = {forward}  # the recorded forwards a subclass may inherit and still get its own
    previous = vars(base).get("__init_subclass__")

    def __init_subclass__(cls, **kwargs):
        if isinstance(previous, classmethod):
            previous.__func__(cls, **kwargs)
        else:
            super(base, cls).__init_subclass__(**kwargs)
        if getattr(cls, "forward", None) not in ours:
            return  # it has a forward of its own
        try:
            named = rewrap(forward, {OP_CLASS: cls.__name__})
        except Exception as exc:  # the class stands, recorded under the base's name alone
            warn_failed_once("naming a fused op's class", exc)
            return
        if named is not None:
            ours.add(named)
            handle.add(Patch(cls, "forward", named))

    handle.add(Patch(base, "__init_subclass__", classmethod(__init_subclass__)))


def _record_explaining(handle: Instrumentation, owner: str, method: str, name: "str | None",
                       rule: Callable[[BaseException, dict], None], module: Any) -> None:
    """`owner.method` of `module`, recorded as `name` (None: as SGLang
    infers one); when it raises, `rule(exception, its arguments by name)`
    notes on the exception which requests' input caused it
    (describe/culprits.py), which its span then names."""
    from ..capture.decorator import debug_kernel_api
    from ..describe.culprits import explained

    cls, original = _own_method(module, owner, method)
    if original is None:
        return
    signature = inspect.signature(original)

    @functools.wraps(original)
    def explaining(*args, **kwargs):
        try:
            return original(*args, **kwargs)
        except Exception as exc:
            if explained(exc) is None:  # else an inner call told it already
                try:
                    rule(exc, signature.bind(*args, **kwargs).arguments)
                except Exception:  # noqa: BLE001 - the call's own exception goes on, unexplained
                    pass
            raise

    handle.add(Patch(cls, method, debug_kernel_api(explaining, op_name=name)))


def _token_beyond_the_vocabulary(exc: BaseException, arguments: dict) -> None:
    """`UnquantizedEmbeddingMethod.embedding(layer, input_)` raised IndexError (on the CPU)."""
    from ..describe.culprits import out_of_range

    if isinstance(exc, IndexError):
        out_of_range(exc, arguments["input_"], arguments["layer"].weight, "the embedding")


def _more_top_logprobs_than_tokens(exc: BaseException, arguments: dict) -> None:
    """`Sampler.forward(logits_output, sampling_info, return_logprob,
    top_logprobs_nums, ...)`: torch's topk refused a k beyond the logits'
    width (the largest top_logprobs_num of the batch)."""
    from ..describe.culprits import more_than

    if isinstance(exc, RuntimeError) and "selected index k out of range" in str(exc):
        logits = arguments["logits_output"].next_token_logits
        more_than(exc, arguments["top_logprobs_nums"], logits.shape[-1], "top_logprobs_num", "tokens of the vocabulary")


# (module, class, method) -> (its span's name, None: as SGLang infers one; the rule naming the culprit).
EXPLAINED_OPS = {
    ("sglang.srt.layers.quantization.unquant", "UnquantizedEmbeddingMethod", "embedding"):
        ("sglang.quant_method.UnquantizedEmbeddingMethod.embedding", _token_beyond_the_vocabulary),
    ("sglang.srt.layers.sampler", "Sampler", "forward"): (None, _more_top_logprobs_than_tokens),
}


def _patch_model_runner(handle: Instrumentation, module: Any) -> None:
    """`ModelRunner.load_model`: once the model is loaded, its layers' calls
    are named after their modules (`label_modules`)."""
    runner, original = _own_method(module, "ModelRunner", "load_model")
    if original is None:
        return

    @functools.wraps(original)
    def load_model(self, *args, **kwargs):
        result = original(self, *args, **kwargs)
        try:
            label_modules(handle, [("", getattr(self, "model", None)), ("sampler", getattr(self, "sampler", None))])
        except Exception as exc:  # the model serves, its calls unnamed
            warn_failed_once("naming the model's layers on their kernel calls", exc)
        return result

    handle.add(Patch(runner, "load_model", load_model))


def label_modules(handle: Instrumentation, roots: "list[tuple[str, Any]]") -> int:
    """Every recorded call a module of `roots` ((path prefix, torch module))
    makes, its own `forward` or its quant method's `apply` / `embedding`,
    carries the module's path (`sglang.kernel.module`) from now on: each
    gets a recorded version of its own, made here once. A module or quant
    method shared by several paths (one rotary embedding for every layer)
    is left as it is: which one a call serves is not known. Returns how
    many were named."""
    import torch

    from ..capture.decorator import rewrap
    from ..schema import MODULE

    layers: dict[int, tuple[Any, list[str]]] = {}
    methods: dict[int, tuple[Any, list[str]]] = {}
    for prefix, root in roots:
        if not isinstance(root, torch.nn.Module):
            continue
        for path, layer in root.named_modules(prefix=prefix, remove_duplicate=False):
            if not path:
                continue
            layers.setdefault(id(layer), (layer, []))[1].append(path)
            method = getattr(layer, "quant_method", None)
            if method is not None:
                methods.setdefault(id(method), (method, []))[1].append(path)
    named = 0
    for layer, paths in layers.values():
        forward = getattr(type(layer), "forward", None)
        if len(paths) == 1 and "forward" not in vars(layer) and getattr(forward, "_kernel_site", None) is not None:
            own = rewrap(forward, {MODULE: paths[0]})
            if own is not None:
                handle.add(Patch(layer, "forward", types.MethodType(own, layer)))
                named += 1
    for method, paths in methods.values():
        if len(paths) != 1:
            continue
        for name in QUANT_METHODS:
            bound = getattr(method, name, None)
            own = rewrap(bound, {MODULE: paths[0]}) if getattr(bound, "_kernel_site", None) is not None else None
            if own is None:
                continue
            # SGLang wraps `apply` on the object (a bound method's wrapper); the class's methods bind here.
            handle.add(Patch(method, name, own if name in vars(method) else types.MethodType(own, method)))
            named += 1
    return named
