"""Recording functions and methods named by import path, without editing their
source: `instrument("package.module:Class.method")`, or the environment
variable SGLANG_KERNEL_API_INSTRUMENT, applied when the module is imported."""

from __future__ import annotations

import os
import sys
from typing import Any

from .. import config as _config
from ..notices import warn
from . import import_hooks
from .patches import Instrumentation, Patch

ENV_PATHS = "SGLANG_KERNEL_API_INSTRUMENT"


def parse_path(path: str) -> tuple[str, list[str]]:
    """`package.module:Qual.name` -> ("package.module", ["Qual", "name"])."""
    if not isinstance(path, str):
        raise ValueError(f"an import path is a string 'package.module:qualname', got {path!r}")
    module, sep, qualname = path.strip().partition(":")
    parts = qualname.split(".")
    if not sep or not module or not all(part.isidentifier() for part in parts):
        raise ValueError(f"{path!r} is not an import path 'package.module:qualname' (e.g. 'pkg.ops:rmsnorm' "
                         "or 'pkg.layers:Linear.forward')")
    return module, parts


def _recorded(value: Any, op_name: str | None) -> Any:
    """The recorded version of a function, keeping a staticmethod or
    classmethod wrapper around it."""
    from .recording import decorator
    from .naming import infer_api_name

    if isinstance(value, (staticmethod, classmethod)):
        inner = value.__func__
        return type(value)(decorator.debug_kernel_api(inner, op_name=op_name or infer_api_name(inner)))
    if isinstance(value, type) or not callable(value):
        raise ValueError(f"{value!r} is not a function or method (name one, e.g. 'module:Class.method')")
    return decorator.debug_kernel_api(value, op_name=op_name or infer_api_name(value))


def _apply(module: Any, parts: list[str], op_name: str | None, handle: Instrumentation, path: str) -> None:
    owner = module
    for part in parts[:-1]:
        owner = getattr(owner, part, None)
        if owner is None:
            raise ValueError(f"{path}: {module.__name__} has no {'.'.join(parts[:-1])}")
    attribute = parts[-1]
    value = vars(owner).get(attribute) if isinstance(owner, type) else getattr(owner, attribute, None)
    if value is None and isinstance(owner, type):
        value = getattr(owner, attribute, None)  # inherited: recorded on this class
    if value is None:
        raise ValueError(f"{path}: no attribute {attribute!r}")
    handle.add(Patch(owner, attribute, _recorded(value, op_name)))


def instrument(*paths: str, op_name: str | None = None) -> Instrumentation:
    """Records each function or method named by `package.module:qualname`
    as if it carried `@debug_kernel_api` (named as SGLang would name it, or
    `op_name`). A module imported already is changed now; one not imported yet
    is changed the moment it is, so code importing the name from it gets the
    recorded version. Returns a handle whose `undo()` restores everything."""
    parsed = [(path, *parse_path(path)) for path in paths]
    if op_name is not None and len(paths) != 1:
        raise ValueError("op_name names one function: give one path with it")
    handle = Instrumentation(", ".join(paths))
    if _config.get_config().level == 0:
        warn(f"instrument({', '.join(paths)}): the level is 0, nothing is recorded "
             "(set SGLANG_KERNEL_API_LOGLEVEL or configure(level=...) first)")
        return handle
    try:
        for path, module_name, parts in parsed:
            module = sys.modules.get(module_name)
            if module is not None:
                _apply(module, parts, op_name, handle, path)
                continue

            def apply(module, parts=parts, path=path) -> None:
                # Runs inside the application's import: report, never raise there.
                try:
                    _apply(module, parts, op_name, handle, path)
                except ValueError as exc:
                    warn(f"cannot instrument {exc}")

            handle.on_undo(import_hooks.when_imported(module_name, apply))
    except ValueError:
        handle.undo()
        raise
    return handle


_from_env: Instrumentation | None = None


def instrument_from_env(environ=os.environ) -> Instrumentation | None:
    """SGLANG_KERNEL_API_INSTRUMENT: comma-separated import paths; a malformed
    one is reported and skipped. Once per process: the start-up hook of
    `sglang-otel-kernels run` and importing this package both call it."""
    global _from_env
    if _from_env is not None and _from_env.active:
        return _from_env
    raw = environ.get(ENV_PATHS, "")
    paths = []
    for item in (part.strip() for part in raw.split(",")):
        if not item:
            continue
        try:
            parse_path(item)
            paths.append(item)
        except ValueError as exc:
            warn(f"{ENV_PATHS}: {exc}; skipped")
    if not paths:
        return None
    handle = instrument(*paths)
    if _config.get_config().level > 0:  # at level 0 nothing was applied: a later call (after configure) applies
        _from_env = handle
    return handle
