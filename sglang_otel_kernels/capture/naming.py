"""Names a kernel API the way SGLang's logger does, once, at decoration time."""

from __future__ import annotations

import inspect
import os
from typing import Any, Callable

_STRIPPED_PREFIXES = ("sglang.", "sgl_kernel.")


def infer_api_name(func: Callable[..., Any]) -> str:
    """`module.qualname`, with `<locals>` parts removed and a leading `sglang.` or
    `sgl_kernel.` dropped from the module; for `__main__` (and builtins) the
    stem of the source file stands in for the module."""
    qualname = getattr(func, "__qualname__", None) or getattr(func, "__name__", None) or "unknown"
    qualname = str(qualname).replace(".<locals>.", ".").replace("<locals>.", "")
    module = getattr(func, "__module__", None) or ""
    if not isinstance(module, str):
        module = ""
    for prefix in _STRIPPED_PREFIXES:
        if module.startswith(prefix):
            module = module[len(prefix):]
            break
    if module and module not in ("__main__", "builtins"):
        return f"{module}.{qualname}"
    try:
        source = inspect.getsourcefile(func)
    except TypeError:
        source = None
    if source:
        return f"{os.path.splitext(os.path.basename(source))[0]}.{qualname}"
    return qualname


def takes_self_first(func: Callable[..., Any]) -> bool:
    """True when the first parameter is `self` or `cls`: SGLang leaves that
    argument out of the log and does not count it."""
    try:
        parameters = inspect.signature(func).parameters
    except (TypeError, ValueError):
        return False
    first = next(iter(parameters), None)
    return first in ("self", "cls")
