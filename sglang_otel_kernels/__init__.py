"""SGLang's kernel API logging, as OpenTelemetry spans.

    from sglang_otel_kernels import debug_kernel_api

    @debug_kernel_api
    def rms_norm(x, weight, eps=1e-6): ...

Levels and destinations come from SGLang's variables (SGLANG_KERNEL_API_LOGLEVEL,
SGLANG_KERNEL_API_LOGDEST), read at import, or from `configure()` called before
decorating.
"""

from ._version import __version__
from .capture.decorator import debug_kernel_api, debug_torch_op, wrap_method_with_debug_kernel_once
from .config import KernelTraceConfig, configure, get_config
from .recover.reader import RecoveredSpan, TraceFileContents, TraceFileError, read_trace, read_trace_file

__all__ = [
    "KernelTraceConfig",
    "RecoveredSpan",
    "TraceFileContents",
    "TraceFileError",
    "__version__",
    "configure",
    "debug_kernel_api",
    "debug_torch_op",
    "get_config",
    "read_trace",
    "read_trace_file",
    "wrap_method_with_debug_kernel_once",
]
