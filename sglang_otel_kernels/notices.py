"""What the package tells the user on stderr: one line each, prefixed with
its name; failures that could repeat on every call are told once."""

from __future__ import annotations

import sys

_told: set[str] = set()


def warn(message: str) -> None:
    print(f"sglang_otel_kernels: {message}", file=sys.stderr)


def warn_once(key: str, message: str) -> None:
    if key not in _told:
        _told.add(key)
        warn(message)


def warn_failed_once(what: str, exc: BaseException, then: str = "") -> None:
    """Tells once per `what` that it failed, with the exception's type and text."""
    warn_once(what, f"{what} failed ({type(exc).__name__}: {exc}){then}")
