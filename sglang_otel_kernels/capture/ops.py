"""Kernels reached through `torch.ops`: custom ops whose implementation is
recorded, and whole op namespaces recorded without touching their source.

A custom op registered here has the recorded function as its implementation,
so every call that reaches the implementation is recorded, including the
calls a `torch.compile` graph makes (the op stays one opaque node; while
compiling, only its fake implementation runs, and that is never recorded).
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from .. import config as _config
from ..notices import warn
from .decorator import debug_kernel_api
from .naming import infer_api_name
from .patches import Instrumentation, Patch

# Libraries made here must outlive the call: dropping one unregisters its ops.
_libraries: dict[str, "torch.library.Library"] = {}
# Ops whose implementation is recorded already: instrument_namespace leaves them.
_recorded_ops: set[str] = set()


def _fake_from_shape(fn: Callable[..., Any], out_shape: "int | str | None", out_dtype: "torch.dtype | None"):
    """A fake implementation for compile: an empty tensor like the argument at
    `out_shape` (a position or a name), or None for an in-place op."""
    signature = inspect.signature(fn)

    def fake(*args, **kwargs):
        if out_shape is None:
            return None
        bound = signature.bind(*args, **kwargs)
        bound.apply_defaults()
        like = bound.args[out_shape] if isinstance(out_shape, int) else bound.arguments[out_shape]
        return torch.empty_like(like, dtype=out_dtype)

    return fake


def _library(namespace: str) -> "torch.library.Library":
    library = _libraries.get(namespace)
    if library is None:
        library = _libraries[namespace] = torch.library.Library(namespace, "FRAGMENT")
    return library


def _register(fn, *, op_name, namespace, mutates_args, out_shape, out_dtype, fake_impl, schema, kernel_name):
    if fake_impl is not None and out_shape is not None:
        raise ValueError("give out_shape or fake_impl, not both")
    name = op_name or fn.__name__
    qualified = f"{namespace}::{name}"
    traced = debug_kernel_api(fn, op_name=kernel_name or infer_api_name(fn))
    fake = fake_impl or _fake_from_shape(fn, out_shape, out_dtype)
    if schema is None:
        # The schema comes from fn's annotations (followed through the wrapper).
        op = torch.library.custom_op(qualified, traced, mutates_args=tuple(mutates_args))
        op.register_fake(fake)
    else:
        library = _library(namespace)
        library.define(f"{name}{schema}")
        torch.library.impl(qualified, "CompositeExplicitAutograd", lib=library)(traced)
        torch.library.register_fake(qualified, fake, lib=library)
    _recorded_ops.add(qualified)
    return getattr(getattr(torch.ops, namespace), name)


def register_kernel_op(
    fn: Callable[..., Any] | None = None,
    *,
    op_name: str | None = None,
    namespace: str = "sglang",
    mutates_args: Sequence[str] = (),
    out_shape: "int | str | None" = None,
    out_dtype: "torch.dtype | None" = None,
    fake_impl: Callable[..., Any] | None = None,
    kernel_name: str | None = None,
) -> Any:
    """Registers `fn` as the custom op `torch.ops.<namespace>.<op_name or fn's
    name>` whose calls are recorded like `@debug_kernel_api` calls (span,
    attributes, text log, trace file), also from compiled graphs. The schema
    comes from fn's type annotations; the fake implementation for compile is
    `fake_impl`, or an empty tensor like the argument `out_shape` (position or
    name; `out_dtype` overrides its dtype), or None for an in-place op. The
    kernel is named as SGLang names `fn`, or `kernel_name`. Returns the op.
    Usable as a decorator, with or without arguments."""

    def register(f: Callable[..., Any]) -> Any:
        return _register(f, op_name=op_name, namespace=namespace, mutates_args=mutates_args, out_shape=out_shape,
                         out_dtype=out_dtype, fake_impl=fake_impl, schema=None, kernel_name=kernel_name)

    return register if fn is None else register(fn)


def register_kernel_op_from_extern(
    fn: Callable[..., Any],
    *,
    schema: str | None = None,
    op_name: str | None = None,
    namespace: str = "sglang",
    mutates_args: Sequence[str] = (),
    out_shape: "int | str | None" = None,
    out_dtype: "torch.dtype | None" = None,
    fake_impl: Callable[..., Any] | None = None,
) -> Any:
    """A function of another library (a FlashInfer kernel, say) as a recorded
    custom op, as `register_kernel_op`; `schema` (e.g. `"(Tensor x, float eps)
    -> Tensor"`) stands in for annotations such functions often lack. The
    kernel is named after the function's own module, as SGLang names it.
    Registering a name that exists already returns the existing op."""
    name = op_name or fn.__name__
    existing = getattr(getattr(torch.ops, namespace), name, None) if _has_op(namespace, name) else None
    if existing is not None:
        return existing
    return _register(fn, op_name=name, namespace=namespace, mutates_args=mutates_args, out_shape=out_shape,
                     out_dtype=out_dtype, fake_impl=fake_impl, schema=schema, kernel_name=None)


def _has_op(namespace: str, name: str) -> bool:
    return f"{namespace}::{name}" in _op_names(namespace)


def _op_names(namespace: str) -> set[str]:
    prefix = namespace + "::"
    return {full.split(".", 1)[0] for full in torch._C._dispatch_get_all_op_names() if full.startswith(prefix)}


# The live handle per namespace (instrumentation lasts until undone, handle kept or not).
_instrumented_namespaces: dict[str, Instrumentation] = {}


def instrument_namespace(namespace: str, *, include: Sequence[str] = (), exclude: Sequence[str] = ()) -> Instrumentation:
    """Records every op registered in `torch.ops.<namespace>` now (or those
    whose name matches an `include` fnmatch pattern and no `exclude` one), as
    kernels named `torch.ops.<namespace>.<op>`, without touching their source.
    Ops registered with `register_kernel_op` are recorded already and left
    alone. Calls that look the op up on `torch.ops.<namespace>` are recorded; a
    reference taken before, and calls from compiled graphs, are not (for
    those, register the op with `register_kernel_op`). Returns a handle whose
    `undo()` puts the ops back; also a context manager."""
    import fnmatch

    if not isinstance(namespace, str) or not namespace.isidentifier():
        raise ValueError(f"namespace must be a torch.ops namespace name, got {namespace!r}")
    handle = Instrumentation(f"torch.ops.{namespace}")
    if _config.get_config().level == 0:
        warn(f"instrument_namespace({namespace!r}): the level is 0, nothing is recorded "
             "(set SGLANG_KERNEL_API_LOGLEVEL or configure(level=...) first)")
        return handle
    previous = _instrumented_namespaces.get(namespace)
    if previous is not None and previous.active:
        previous.undo()  # instrumenting twice records each call once
    owner = getattr(torch.ops, namespace)
    for qualified in sorted(_op_names(namespace)):
        name = qualified.split("::", 1)[1]
        if qualified in _recorded_ops:
            continue
        if include and not any(fnmatch.fnmatchcase(name, p) for p in include):
            continue
        if any(fnmatch.fnmatchcase(name, p) for p in exclude):
            continue
        packet = getattr(owner, name)
        handle.add(Patch(owner, name, debug_kernel_api(packet, op_name=f"torch.ops.{namespace}.{name}")))
    _instrumented_namespaces[namespace] = handle
    return handle
