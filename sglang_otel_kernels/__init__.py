"""SGLang's kernel API logging, as OpenTelemetry spans, with a crash-safe trace file.

    from sglang_otel_kernels import debug_kernel_api

    @debug_kernel_api
    def rms_norm(x, weight, eps=1e-6): ...

Levels and destinations come from SGLang's variables (SGLANG_KERNEL_API_LOGLEVEL,
SGLANG_KERNEL_API_LOGDEST), read at import, or from `configure()` called before
decorating. `read_trace()` reads a trace file back. Without editing code:
`register_kernel_op` (custom ops), `instrument_namespace` (a torch.ops
namespace), `instrument` (functions by import path, also from
SGLANG_KERNEL_API_INSTRUMENT, applied when this package is imported), and
`sglang-otel-kernels run -- <command>` for SGLang itself.

The decorator side (which needs torch) loads on first use, so reading a trace
file, exporting or reporting works where torch is not installed.
"""

import os
from typing import TYPE_CHECKING, Any

from ._version import __version__
from .capture.patches import Instrumentation
from .capture.paths import ENV_PATHS, instrument, instrument_from_env
from .config import KernelTraceConfig, configure, get_config
from .record import coredumps as _coredumps
from .record.core import NATIVE
from .record.processor import trace_file_path
from .record.reader import RecoveredSpan, TraceFileContents, TraceFileError, read_trace, read_trace_file

del _coredumps  # imported for its effect: CUDA core dumps turned on from import on, when asked for

if TYPE_CHECKING:
    from .capture.decorator import debug_kernel_api, debug_torch_op, wrap_method_with_debug_kernel_once
    from .capture.ops import instrument_namespace, register_kernel_op, register_kernel_op_from_extern
    from .capture.graphs import watch_graph_outputs
    from .capture.requests import extract, forward_batch, inject

# name -> module under capture/, loaded on first use (they import torch)
_CAPTURE = {
    "debug_kernel_api": "decorator",
    "debug_torch_op": "decorator",
    "wrap_method_with_debug_kernel_once": "decorator",
    "forward_batch": "requests",
    "inject": "requests",
    "extract": "requests",
    "register_kernel_op": "ops",
    "register_kernel_op_from_extern": "ops",
    "instrument_namespace": "ops",
    "watch_graph_outputs": "graphs",
}


def __getattr__(name: str) -> Any:
    if name in _CAPTURE:
        import importlib

        importlib.import_module(f"{__name__}.capture.recording")  # the decorator with its hooks
        return getattr(importlib.import_module(f"{__name__}.capture.{_CAPTURE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if os.environ.get(ENV_PATHS) and get_config().level > 0:
    # At level 0 it waits for whoever turns recording on (the OpenTelemetry
    # instrumentor, configure()-then-instrument_from_env()).
    instrument_from_env()


def _record_collectives(_torch: Any) -> None:
    """Once torch is imported: the decorator's runtime and its hooks, which
    record torch.distributed's collectives (capture/collectives.py)."""
    try:
        import importlib

        importlib.import_module(f"{__name__}.capture.recording")
    except Exception as exc:  # inside the application's `import torch`: never raise there
        from .notices import warn_failed_once

        warn_failed_once("recording torch.distributed's collectives", exc)


if get_config().level > 0 and get_config().collectives:
    from .capture import import_hooks

    # Where one of this package's own modules imports torch, its modules are half made until that import ends.
    import_hooks.when_imported("torch", _record_collectives, settled=__name__)

__all__ = [
    "Instrumentation",
    "KernelTraceConfig",
    "NATIVE",
    "RecoveredSpan",
    "TraceFileContents",
    "TraceFileError",
    "__version__",
    "configure",
    "debug_kernel_api",
    "debug_torch_op",
    "extract",
    "forward_batch",
    "get_config",
    "inject",
    "instrument",
    "instrument_namespace",
    "read_trace",
    "read_trace_file",
    "register_kernel_op",
    "register_kernel_op_from_extern",
    "trace_file_path",
    "watch_graph_outputs",
    "wrap_method_with_debug_kernel_once",
]
