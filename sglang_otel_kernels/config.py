"""Settings: SGLang's environment variables, read once at import, and `configure()`.

The level is taken when a function is decorated (level 0 returns the function
itself), so set it before decorating: through the environment as with SGLang, or
with `configure(level=...)` in code.
"""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Callable, Mapping

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

LEVELS = (0, 1, 3, 5, 10)
LOG_DEST_OFF = "off"


@dataclasses.dataclass(frozen=True)
class KernelTraceConfig:
    """Where kernel calls are recorded and in how much detail.

    level: 0 off, 1 names, 3 arguments and results, 5 statistics too, 10 (for now) as 5.
    log_dest: "stdout", "stderr", "off" (no text log), or a file path (appended to;
        "%i" becomes the process id when the file is opened).
    spans: open one OpenTelemetry span per call (off when OTEL_SDK_DISABLED=true).
    tracer_provider: where spans go; None means the global provider.
    """

    level: int = 0
    log_dest: str = "stdout"
    spans: bool = True
    tracer_provider: "TracerProvider | None" = None


def _warn(message: str) -> None:
    print(f"sglang_otel_kernels: {message}", file=sys.stderr)


def parse_level(raw: str) -> int:
    """SGLang's levels; anything else that is a non-negative integer is kept, as
    SGLang compares with thresholds (2 acts as 1, 4 as 3)."""
    level = int(raw.strip())
    if level < 0:
        raise ValueError("level must be >= 0")
    return level


def config_from_env(environ: Mapping[str, str] = os.environ) -> KernelTraceConfig:
    """Read SGLANG_KERNEL_API_LOGLEVEL / _LOGDEST and OTEL_SDK_DISABLED; a value
    that does not parse gives one warning and the default, as SGLang does."""
    level = 0
    raw_level = environ.get("SGLANG_KERNEL_API_LOGLEVEL")
    if raw_level is not None:
        try:
            level = parse_level(raw_level)
        except ValueError:
            _warn(f"cannot parse SGLANG_KERNEL_API_LOGLEVEL={raw_level!r}, using 0")
    log_dest = environ.get("SGLANG_KERNEL_API_LOGDEST", "stdout").strip()
    if not log_dest:
        _warn("SGLANG_KERNEL_API_LOGDEST is empty, using stdout")
        log_dest = "stdout"
    sdk_disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    return KernelTraceConfig(level=level, log_dest=log_dest, spans=not sdk_disabled)


_config = config_from_env()
_listeners: list[Callable[[KernelTraceConfig], None]] = []


def get_config() -> KernelTraceConfig:
    """The settings in force now."""
    return _config


def on_change(listener: Callable[[KernelTraceConfig], None]) -> None:
    """Call `listener(config)` whenever `configure()` changes the settings."""
    _listeners.append(listener)


class _Keep:
    def __repr__(self) -> str:
        return "KEEP"


KEEP: Any = _Keep()


def configure(
    *,
    level: int | None = None,
    log_dest: str | None = None,
    spans: bool | None = None,
    tracer_provider: "TracerProvider | None" = KEEP,
) -> KernelTraceConfig:
    """Change the settings in code; arguments left out keep their value
    (`tracer_provider=None` goes back to the global provider).

    Functions decorated while the level was 0 stay unwrapped: configure first,
    then decorate (or import the modules that decorate).
    """
    global _config
    changes: dict = {}
    if level is not None:
        if isinstance(level, bool) or not isinstance(level, int) or level < 0:
            raise ValueError(f"level must be a non-negative int, one of {LEVELS}; got {level!r}")
        changes["level"] = level
    if log_dest is not None:
        if not isinstance(log_dest, str) or not log_dest.strip():
            raise ValueError(f"log_dest must be 'stdout', 'stderr', 'off' or a path; got {log_dest!r}")
        changes["log_dest"] = log_dest.strip()
    if spans is not None:
        changes["spans"] = bool(spans)
    if tracer_provider is not KEEP:
        changes["tracer_provider"] = tracer_provider
    _config = dataclasses.replace(_config, **changes)
    for listener in _listeners:
        listener(_config)
    return _config
