"""Run a callback right after a module is imported (or now, if it already is),
so that a library's functions can be replaced before anything imports them by
name; or right before its code runs, to change what it sees while it runs.
Torch-free: hooks can be set before torch or the target is imported."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Callable

_lock = threading.RLock()
_hooks: dict[str, list[Callable]] = {}
_before: dict[str, list[Callable[[], Callable[[], None]]]] = {}
# when_imported(settled=): top-level packages whose submodules' loaders are wrapped too, and the
# callbacks waiting for one of their imports to end: (package, callback).
_packages: set[str] = set()
_waiting: list[tuple[str, Callable[[], None]]] = []


class _Finder(importlib.abc.MetaPathFinder):
    """Sits first on sys.meta_path; for a watched module, finds the real spec
    with the other finders and wraps its loader so the hooks run after it."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in _hooks and fullname not in _before and fullname.partition(".")[0] not in _packages:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader)
                return spec
        return None


class _Loader(importlib.abc.Loader):
    def __init__(self, loader) -> None:
        self._loader = loader

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        with _lock:
            before = list(_before.get(module.__name__, ()))
        undo = [callback() for callback in before]
        try:
            self._loader.exec_module(module)
        finally:
            for restore in reversed(undo):
                restore()
        _run(module.__name__, module)
        _release(module.__name__)

    def __getattr__(self, name):  # get_source, is_package, ... of the real loader
        return getattr(self._loader, name)


_finder = _Finder()


def _run(name: str, module) -> None:
    with _lock:
        callbacks = list(_hooks.get(name, ()))
    for callback in callbacks:
        callback(module)


def _half_made(package: str, besides: str = "") -> bool:
    """Whether a submodule of `package` (but `besides`) imported through this
    finder is still being imported: its code has not run to its end."""
    prefix = package + "."
    for name, module in list(sys.modules.items()):
        spec = getattr(module, "__spec__", None)
        if (name.startswith(prefix) and name != besides and getattr(spec, "_initializing", False)
                and isinstance(getattr(spec, "loader", None), _Loader)):
            return True
    return False


def _release(name: str) -> None:
    """After submodule `name` ran: the callbacks waiting for its package, once none of its submodules is half made."""
    package = name.partition(".")[0]
    with _lock:
        due = [callback for waits_for, callback in _waiting if waits_for == package]
        if not due or _half_made(package, besides=name):
            return
        _waiting[:] = [entry for entry in _waiting if entry[0] != package]
    for callback in due:
        callback()


def _after(package: str, callback: Callable) -> Callable:
    def run(module) -> None:
        with _lock:
            if _half_made(package):
                _waiting.append((package, functools.partial(callback, module)))
                return
        callback(module)
    return run


def when_imported(name: str, callback: Callable, *, settled: "str | None" = None) -> Callable[[], None]:
    """Calls `callback(module)` once `name` is imported (at once if it is);
    returns a function that removes the hook. `settled`, a top-level package:
    where `name` is imported by one of its submodules (the callback would
    find them half made), the callback waits for the end of the outermost
    such import (of those imported after this call)."""
    if settled is not None:
        with _lock:
            _packages.add(settled)
        callback = _after(settled, callback)
    remove = _add(_hooks, name, callback)
    module = sys.modules.get(name)
    if module is not None:
        callback(module)
    return remove


def before_import(name: str, callback: Callable[[], Callable[[], None]]) -> Callable[[], None]:
    """Calls `callback()` right before the code of module `name` runs, and the
    function it returns right after (nothing if the module is imported
    already); returns a function that removes the hook."""
    return _add(_before, name, callback)


def _add(table: dict, name: str, callback: Callable) -> Callable[[], None]:
    with _lock:
        table.setdefault(name, []).append(callback)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)

    def remove() -> None:
        with _lock:
            callbacks = table.get(name, [])
            if callback in callbacks:
                callbacks.remove(callback)
            if not callbacks:
                table.pop(name, None)

    return remove
