"""Replacing an attribute with its recorded version, and putting it back."""

from __future__ import annotations

import threading
from typing import Any, Callable

_MISSING = object()


class Patch:
    """`owner.attribute` replaced; `undo()` restores it if it is still ours
    (someone who replaced it after us keeps theirs)."""

    __slots__ = ("owner", "attribute", "original", "replacement", "had_own")

    def __init__(self, owner: Any, attribute: str, replacement: Any) -> None:
        self.owner = owner
        self.attribute = attribute
        # A class attribute is read from the class's own __dict__, so that
        # staticmethod/classmethod objects (and inherited ones) come back as they were.
        own = vars(owner).get(attribute, _MISSING) if isinstance(owner, type) else _MISSING
        self.had_own = own is not _MISSING or not isinstance(owner, type)
        self.original = own if own is not _MISSING else getattr(owner, attribute)
        self.replacement = replacement
        setattr(owner, attribute, replacement)

    def undo(self) -> None:
        current = vars(self.owner).get(self.attribute, _MISSING) if isinstance(self.owner, type) else \
            getattr(self.owner, self.attribute, _MISSING)
        if current is not self.replacement:
            return
        if self.had_own:
            setattr(self.owner, self.attribute, self.original)
        else:
            delattr(self.owner, self.attribute)  # it was inherited: inherit it again


class Instrumentation:
    """What an `instrument*` call changed: `undo()` puts everything back;
    also a context manager (`with instrument_namespace("sglang"): ...`)."""

    def __init__(self, description: str) -> None:
        self.description = description
        self.patches: list[Patch] = []
        self._removers: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self.active = True

    @property
    def targets(self) -> list[str]:
        """What is instrumented now, as `owner.attribute`."""
        with self._lock:
            return [f"{_owner_name(p.owner)}.{p.attribute}" for p in self.patches]

    def add(self, patch: Patch) -> None:
        with self._lock:
            self.patches.append(patch)

    def on_undo(self, remover: Callable[[], None]) -> None:
        with self._lock:
            self._removers.append(remover)

    def undo(self) -> None:
        with self._lock:
            patches, self.patches = self.patches, []
            removers, self._removers = self._removers, []
            self.active = False
        for remover in removers:
            remover()
        for patch in reversed(patches):
            patch.undo()

    def __enter__(self) -> "Instrumentation":
        return self

    def __exit__(self, *exc_info) -> None:
        self.undo()

    def __repr__(self) -> str:
        return f"<Instrumentation {self.description}: {len(self.patches)} patched{'' if self.active else ', undone'}>"


def _owner_name(owner: Any) -> str:
    return getattr(owner, "__qualname__", None) or getattr(owner, "__name__", None) or type(owner).__name__
