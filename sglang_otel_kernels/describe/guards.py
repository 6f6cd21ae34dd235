"""Situations in which a tensor must not be touched."""

from __future__ import annotations

import torch


def _compiling_probe():
    compiler = getattr(torch, "compiler", None)
    probe = getattr(compiler, "is_compiling", None)
    if probe is None:
        probe = getattr(getattr(torch, "_dynamo", None), "is_compiling", None)
    return probe or (lambda: False)


# Resolved once: the wrapper asks on every call.
is_compiling = _compiling_probe()


def compiler_flags() -> tuple:
    """For the compiled core: torch.compiler's namespace, when `is_compiling`
    reads its `_is_compiling_flag` (read there directly, without a call), else
    None; and the probe."""
    compiler = getattr(torch, "compiler", None)
    reads_flag = (is_compiling is getattr(compiler, "is_compiling", None)
                  and "_is_compiling_flag" in getattr(getattr(is_compiling, "__code__", None), "co_names", ())
                  and isinstance(getattr(compiler, "_is_compiling_flag", None), bool))
    return (vars(compiler) if reads_flag else None), is_compiling


def is_graph_capturing(device_type: str) -> bool:
    """A CUDA (or XPU) graph is being captured on the current stream: no
    synchronisation and no `.item()` is allowed."""
    backend = getattr(torch, device_type, None)
    probe = getattr(backend, "is_current_stream_capturing", None)
    if probe is None:
        return False
    try:
        return bool(probe())
    except Exception:
        return False
