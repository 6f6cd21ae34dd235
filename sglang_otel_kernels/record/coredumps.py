"""CUDA core dumps on a device exception, written beside the trace files.

On an illegal address, a device-side assert or another device exception,
the CUDA driver writes a core dump when CUDA_ENABLE_COREDUMP_ON_EXCEPTION=1
(it reads its variables once, when CUDA initialises). The dump names the
faulting kernel, its grid, block, warp and lane, and the exception:
`report` reads it (recover/cuda_coredump.py) and joins it to the call or the
CUDA graph replay that was running. With `cuda_coredump` on
(SGLANG_KERNEL_API_CUDA_COREDUMP=1, `configure(cuda_coredump=True)`,
`run --cuda-coredump`) the variables below are set where unset: a CUDA_*
variable the user set is never overridden. SGLang's own switch
(SGLANG_CUDA_COREDUMP, which sets the same variables in its process) is left
to do its work, and its directory (SGLANG_CUDA_COREDUMP_DIR) is used.

A lightweight dump (no memory, no non-relocated images) is a few MB and
takes from under a second to several seconds to write, while the process
waits: nothing is written until a device exception.
"""

from __future__ import annotations

import os
import sys
from typing import Mapping

from .. import config as _config
from ..notices import warn

# The "lightweight" set: what names the fault (tables and relocated cubins), no memory.
LIGHTWEIGHT_FLAGS = ("skip_nonrelocated_elf_images,skip_global_memory,skip_shared_memory,skip_local_memory,"
                     "skip_constbank_memory")
# The driver puts the host, the pid and the time in for %h, %p and %t; SGLang names its dumps so too.
DUMP_NAME = "cuda_coredump_%h.%p.%t"
ENV_SGLANG = "SGLANG_CUDA_COREDUMP"
ENV_SGLANG_DIR = "SGLANG_CUDA_COREDUMP_DIR"


def dump_directory(environ: Mapping[str, str], trace_file: str) -> str:
    """Where dumps go: SGLang's directory when it names one, else the trace files'."""
    chosen = environ.get(ENV_SGLANG_DIR, "").strip()
    if chosen:
        return os.path.abspath(chosen)
    template = _config.DEFAULT_TRACE_FILE if trace_file == _config.OFF else trace_file
    return os.path.dirname(os.path.abspath(template))


def dump_variables(environ: Mapping[str, str], trace_file: str) -> dict[str, str]:
    """The CUDA_* variables that turn dumps on and are not set in `environ`;
    none when SGLang's own switch is on (it sets them in its process)."""
    try:
        if _config.parse_flag(environ.get(ENV_SGLANG, "")):
            return {}
    except ValueError:
        pass  # not a flag SGLang would take as on either
    wanted = {
        "CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1",
        "CUDA_COREDUMP_GENERATION_FLAGS": LIGHTWEIGHT_FLAGS,
        "CUDA_COREDUMP_SHOW_PROGRESS": "1",
        "CUDA_COREDUMP_FILE": os.path.join(dump_directory(environ, trace_file), DUMP_NAME),
    }
    return {key: value for key, value in wanted.items() if key not in environ}


def prepare(environ: Mapping[str, str], trace_file: str) -> dict[str, str]:
    """`dump_variables`, with the directory its dump file names made (private)."""
    added = dump_variables(environ, trace_file)
    if "CUDA_COREDUMP_FILE" in added:
        directory = os.path.dirname(added["CUDA_COREDUMP_FILE"])
        try:
            os.makedirs(directory, mode=0o700, exist_ok=True)
        except OSError as exc:
            warn(f"cuda_coredump: cannot create {directory} ({exc}); the driver will fail to write a dump there")
    return added


def enable(cfg: "_config.KernelTraceConfig") -> dict[str, str]:
    """Sets this process's variables (see `prepare`); says so when CUDA is
    already initialised here (the driver read its variables then: `run
    --cuda-coredump` sets them before the command starts)."""
    added = prepare(os.environ, cfg.trace_file)
    if not added:
        return added
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    try:
        late = bool(cuda is not None and cuda.is_initialized())
    except Exception:  # a torch without CUDA support, or a stand-in
        late = False
    if late:
        warn("cuda_coredump: CUDA is already initialised in this process, so its driver will not write core "
             "dumps here; turn it on before CUDA starts (SGLANG_KERNEL_API_CUDA_COREDUMP=1 in the environment, "
             "or sglang-otel-kernels run --cuda-coredump -- COMMAND)")
    os.environ.update(added)
    return added


def follow_config(cfg: "_config.KernelTraceConfig") -> None:
    if cfg.cuda_coredump:
        enable(cfg)


_config.on_change(follow_config)
follow_config(_config.get_config())
