"""Importable kernels for the level-10 tests: `rerun` finds them by import path."""

import os
import signal

import torch

import sglang_otel_kernels as sok


def scale(x, factor, *, dtype=None, bias=None):
    out = x * factor
    if bias is not None:
        out = out + bias
    return out.to(dtype) if dtype is not None else out


def scale_wrong(x, factor, *, dtype=None, bias=None):
    return scale(x, factor, dtype=dtype, bias=bias) + 1e-3


def gather(table, index):
    """Fails on an out-of-range index, as a kernel's bounds check does; with
    DUMP_KERNELS_DIE set it kills the process instead, as a GPU fault does
    (`abort`: SIGABRT, `segv`: SIGSEGV, else exit status 3)."""
    if int(index.max()) >= table.shape[0]:
        how = os.environ.get("DUMP_KERNELS_DIE")
        if how == "abort":
            os.abort()
        if how == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        if how:
            os._exit(3)
        raise IndexError(f"index {int(index.max())} out of range for {table.shape[0]} rows")
    return table[index]


def gather_clamped(table, index):
    return table[index.clamp(max=table.shape[0] - 1)]


def double(x):
    return x * 2


def nested(tensors, options, *, scales=None):
    total = sum(t.sum() for t in tensors) * options["weight"]
    if scales:
        total = total * scales[0]
    return {"total": total, "parts": [t * options["weight"] for t in tensors], "dtype": options["dtype"]}


def die(x, how):
    if how == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    if how == "exit":
        os._exit(7)
    return x


class Layer:
    def apply(self, x):
        return x * 2


def decorate_all():
    """Decorated at call time, so that the tests' configured level applies."""
    return {name: sok.debug_kernel_api(func, op_name=f"test.{name}")
            for name, func in (("scale", scale), ("gather", gather), ("nested", nested), ("die", die))}
