"""Settings: SGLang's environment variables, read once at import, and `configure()`.

The level is taken when a function is decorated (level 0 returns the function
itself), so set it before decorating: through the environment as with SGLang, or
with `configure(level=...)` in code.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import os
from typing import TYPE_CHECKING, Any, Callable, Mapping

from .notices import warn

if TYPE_CHECKING:
    from opentelemetry.trace import TracerProvider

LEVELS = (0, 1, 3, 5, 10)
OFF = "off"
KERNELS = "kernels"
DEFAULT_TRACE_FILE = "sglang_kernel_trace_%i.sgltrace"
DEFAULT_TRACE_FILE_SIZE = 16 * 1024 * 1024
DEFAULT_TRACE_FILE_KEEP = 20
MIN_TRACE_FILE_SIZE = 64 * 1024
MAX_TRACE_FILE_SIZE = 1 << 40
MAX_BYTES = 1 << 50
DEFAULT_DUMP_DIR = "sglang_kernel_api_dumps"
DEFAULT_DUMP_MAX_BYTES = 20 * 1024**3
DEFAULT_DUMP_MAX_COUNT = 1000
DEFAULT_HANG_SECONDS = 60.0


@dataclasses.dataclass(frozen=True)
class KernelTraceConfig:
    """Where kernel calls are recorded and in how much detail.

    level: 0 off, 1 names, 3 arguments and results, 5 statistics too, 10 also
        dumps each call's inputs (before the call) and outputs to a directory.
    log_dest: "stdout", "stderr", "off" (no text log), or a file path (appended to;
        "%i" becomes the process id when the file is opened).
    spans: open one OpenTelemetry span per call (off when OTEL_SDK_DISABLED=true).
    tracer_provider: where spans go; None means the global provider (one is
        created and installed if the application has none).
    trace_file: the crash-safe trace file, a path ("%i" becomes the pid) or "off".
    trace_file_size: its capacity in bytes; the newest records are kept.
    trace_file_fsync: msync each record, for power-loss durability (slow).
    trace_file_keep: of the files earlier runs left under the same name
        pattern, the newest this many stay; older ones that hold nothing
        eventful (no crash, no failure, no traceback) are removed; 0 keeps all.
    faulthandler: write the Python traceback of a fatal signal beside the trace file.
    blackbox: kernel calls into the trace file alone, at level-1 detail (name,
        call number, times, thread, status, inside the span around the call),
        not handed to the provider's processors: the production mode, cheapest
        per call, also with OTEL_SDK_DISABLED. Other spans are recorded as usual.
    dump_dir: where level 10 writes one directory per call ("%i" becomes the pid).
    dump_include / dump_exclude: fnmatch patterns on the kernel name; a call is
        dumped when it matches an include pattern (or there are none) and no
        exclude pattern.
    dump_max_bytes / dump_max_count: once this process's dumps reach either,
        dumping stops (one warning; each span says why it has no dump).
    export_sidecar: OTLP export by a separate process that follows the trace
        file (`sglang-otel-kernels follow`), started with it, instead of by an
        exporter in this process (the default; False exports in-process).
        Applies to the provider this package creates; "kernels" also has the
        sidecar export the kernel spans of an application's own provider
        (not handed to its processors then), its own spans staying with it.
    collectives: record the collectives and point-to-point ops of
        torch.distributed (and SGLang's GroupCoordinator) as kernel spans
        with their group, per-group sequence number and tensor shapes, so a
        report can line the ranks up.
    graph_output_check: at level 5, after each replay of a CUDA graph whose
        outputs are known (`watch_graph_outputs`, SGLang's runners), one
        reduction over them flags the replay's span has_nan / has_inf (a
        synchronisation per replay).
    graph_nan_check: at level 5, each decorated call captured into a CUDA
        graph gets a captured reduction that writes whether its floating
        outputs hold NaN/Inf into its slot of a device buffer; after each
        replay the buffer is copied without blocking and read once landed
        (at the next replay, a step's end or a statistics transfer), and the
        first captured call of the replay that made NaN/Inf is named on the
        replay's span.
    nan_flags: at any level from 1 (and in the black box), each recorded
        call's outputs are reduced on their device to non-finite flags (per
        row of its first output, and one per other output) in a device
        buffer, with no host read in the call's path; the flags are copied
        without blocking into a mapped file beside the trace file
        (`<trace file>.nanflags`, which outlives a crash) at each batch's
        end, and read there: the first call of a step that made NaN/Inf is
        annotated in the trace file with its requests (capture/nan_flags.py).
        Calls captured into a CUDA graph get the graph NaN check.
    nan_flag_inputs: with nan_flags on, fnmatch patterns on the kernel name
        ("*": every call): the tensor arguments of the calls they match are
        flagged too, before the call runs (a flag an argument: a list, tuple
        or dict of tensors is one; a module, or a module method's self, by
        its own parameters and buffers; in CUDA graphs too), so the first
        flagged call says whether
        the NaN/Inf came in through an input or out of finite inputs. Each
        such argument is read whole on its device: name ops whose inputs
        are activations, not a KV cache pool.
    hang_seconds: a kernel call in flight longer than this is exported by
        the sidecar while the process still runs, marked hung; a thread
        that recorded calls and then none for this long gets its Python
        stack into the trace file; the report calls a collective waited on
        longer than this a hang; 0 turns the early export and the stacks off.
    cuda_coredump: the CUDA driver writes a core dump on a device exception
        (an illegal address, a device-side assert), beside the trace files,
        which `report` reads and joins to the call that was running; set
        before CUDA initialises, never over a CUDA_* variable already set
        (record/coredumps.py).
    """

    level: int = 0
    log_dest: str = "stdout"
    spans: bool = True
    tracer_provider: "TracerProvider | None" = None
    trace_file: str = DEFAULT_TRACE_FILE
    trace_file_size: int = DEFAULT_TRACE_FILE_SIZE
    trace_file_fsync: bool = False
    trace_file_keep: int = DEFAULT_TRACE_FILE_KEEP
    faulthandler: bool = True
    blackbox: bool = False
    dump_dir: str = DEFAULT_DUMP_DIR
    dump_include: tuple = ()
    dump_exclude: tuple = ()
    dump_max_bytes: int = DEFAULT_DUMP_MAX_BYTES
    dump_max_count: int = DEFAULT_DUMP_MAX_COUNT
    export_sidecar: "bool | str" = True
    collectives: bool = True
    graph_output_check: bool = False
    graph_nan_check: bool = False
    nan_flags: bool = False
    nan_flag_inputs: tuple = ()
    hang_seconds: float = DEFAULT_HANG_SECONDS
    cuda_coredump: bool = False


def parse_level(raw: str) -> int:
    """SGLang's levels; anything else that is a non-negative integer is kept, as
    SGLang compares with thresholds (2 acts as 1, 4 as 3)."""
    level = int(raw.strip())
    if level < 0:
        raise ValueError("level must be >= 0")
    return level


def parse_bytes(text: str) -> int:
    """Bytes: `16777216`, `64K`, `16M`, `1G`, `20GB` (powers of 1024), up to
    MAX_BYTES; `inf`, NaN and the like are a ValueError like any other typo."""
    value = text.strip().upper().removesuffix("B").removesuffix("I")
    scale = 1
    if value and value[-1] in "KMGT":
        scale = 1024 ** ("KMGT".index(value[-1]) + 1)
        value = value[:-1]
    number = float(value) * scale
    if not math.isfinite(number):
        raise ValueError("not a finite number of bytes")
    if not 0 <= number <= MAX_BYTES:
        raise ValueError(f"must be between 0 and {MAX_BYTES} (1 PiB)")
    return int(number)


def parse_size(text: str) -> int:
    """A trace file's capacity: bytes as `parse_bytes` reads them, 64 KiB to 1 TiB."""
    return check_size(parse_bytes(text))


class OutOfRange(ValueError):
    """A setting that parsed but lies outside its range; `nearest` is the bound used instead."""

    def __init__(self, message: str, nearest: Any, shown: str) -> None:
        super().__init__(message)
        self.nearest, self.shown = nearest, shown


def check_size(size: int) -> int:
    if size < MIN_TRACE_FILE_SIZE:
        raise OutOfRange(f"below the minimum, 64K ({MIN_TRACE_FILE_SIZE} bytes)", MIN_TRACE_FILE_SIZE, "64K")
    if size > MAX_TRACE_FILE_SIZE:
        raise OutOfRange(f"above the maximum, 1T ({MAX_TRACE_FILE_SIZE} bytes)", MAX_TRACE_FILE_SIZE, "1T")
    return size


def parse_count(text: str) -> int:
    count = int(text.strip())
    if count < 0:
        raise ValueError("must not be negative")
    return count


def parse_patterns(text: str) -> tuple:
    """SGLang's comma-separated fnmatch patterns; blanks are ignored."""
    return tuple(part.strip() for part in text.split(",") if part.strip())


def parse_sidecar(text: str) -> "bool | str":
    """SGLANG_KERNEL_API_EXPORT_SIDECAR: a flag, or `kernels`."""
    return KERNELS if text.strip().lower() == KERNELS else parse_flag(text)


def parse_seconds(text: str) -> float:
    seconds = float(text.strip())
    if not math.isfinite(seconds) or seconds < 0:
        raise ValueError("must be a finite number of seconds, 0 or more")
    return seconds


def parse_flag(text: str) -> bool:
    value = text.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"not a boolean: {text!r}")


def _from_env(environ: Mapping[str, str], name: str, parse: Callable[[str], Any], default: Any) -> Any:
    raw = environ.get(name)
    if raw is None:
        return default
    try:
        return parse(raw)
    except OutOfRange as exc:
        warn(f"{name}={raw!r} is {exc}: using {exc.shown}")
        return exc.nearest
    except (ValueError, OverflowError) as exc:
        warn(f"cannot parse {name}={raw!r} ({exc}), using {default!r}")
        return default


def _log_path(dest: str) -> str:
    """A text-log file's path made absolute when the setting is read, as
    SGLang's logging.FileHandler does at import: an application's later
    chdir does not move the log, and `sub/../log.txt` is `log.txt` even with
    no `sub`. `%i` stays, for the pid of the process that first writes."""
    return dest if dest in ("stdout", "stderr", OFF) else os.path.abspath(dest)


def config_from_env(environ: Mapping[str, str] = os.environ) -> KernelTraceConfig:
    """Read SGLang's SGLANG_KERNEL_API_* variables, ours, and OTEL_SDK_DISABLED;
    a value that does not parse gives one warning and the default, as SGLang does."""
    level = 0
    raw_level = environ.get("SGLANG_KERNEL_API_LOGLEVEL")
    if raw_level is not None:
        try:
            level = parse_level(raw_level)
        except ValueError:
            warn(f"cannot parse SGLANG_KERNEL_API_LOGLEVEL={raw_level!r}, using 0")
    log_dest = environ.get("SGLANG_KERNEL_API_LOGDEST", "stdout").strip()
    if not log_dest:
        warn("SGLANG_KERNEL_API_LOGDEST is empty, using stdout")
        log_dest = "stdout"
    log_dest = _log_path(log_dest)
    sdk_disabled = environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true"
    trace_file = environ.get("SGLANG_KERNEL_API_TRACEFILE", DEFAULT_TRACE_FILE).strip() or DEFAULT_TRACE_FILE
    return KernelTraceConfig(
        level=level,
        log_dest=log_dest,
        spans=not sdk_disabled,
        trace_file=trace_file,
        trace_file_size=_from_env(environ, "SGLANG_KERNEL_API_TRACEFILE_SIZE", parse_size, DEFAULT_TRACE_FILE_SIZE),
        trace_file_fsync=_from_env(environ, "SGLANG_KERNEL_API_TRACEFILE_FSYNC", parse_flag, False),
        trace_file_keep=_from_env(environ, "SGLANG_KERNEL_API_TRACEFILE_KEEP", parse_count, DEFAULT_TRACE_FILE_KEEP),
        faulthandler=_from_env(environ, "SGLANG_KERNEL_API_FAULTHANDLER", parse_flag, True),
        blackbox=_from_env(environ, "SGLANG_KERNEL_API_BLACKBOX", parse_flag, False),
        dump_dir=environ.get("SGLANG_KERNEL_API_DUMP_DIR", "").strip() or DEFAULT_DUMP_DIR,
        dump_include=parse_patterns(environ.get("SGLANG_KERNEL_API_DUMP_INCLUDE", "")),
        dump_exclude=parse_patterns(environ.get("SGLANG_KERNEL_API_DUMP_EXCLUDE", "")),
        dump_max_bytes=_from_env(environ, "SGLANG_KERNEL_API_DUMP_MAX_BYTES", parse_bytes, DEFAULT_DUMP_MAX_BYTES),
        dump_max_count=_from_env(environ, "SGLANG_KERNEL_API_DUMP_MAX_COUNT", parse_count, DEFAULT_DUMP_MAX_COUNT),
        export_sidecar=_from_env(environ, "SGLANG_KERNEL_API_EXPORT_SIDECAR", parse_sidecar, True),
        collectives=_from_env(environ, "SGLANG_KERNEL_API_COLLECTIVES", parse_flag, True),
        graph_output_check=_from_env(environ, "SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK", parse_flag, False),
        graph_nan_check=_from_env(environ, "SGLANG_KERNEL_API_GRAPH_NAN_CHECK", parse_flag, False),
        nan_flags=_from_env(environ, "SGLANG_KERNEL_API_NAN_FLAGS", parse_flag, False),
        nan_flag_inputs=parse_patterns(environ.get("SGLANG_KERNEL_API_NAN_FLAGS_INPUTS", "")),
        hang_seconds=_from_env(environ, "SGLANG_KERNEL_API_HANG_SECONDS", parse_seconds, DEFAULT_HANG_SECONDS),
        cuda_coredump=_from_env(environ, "SGLANG_KERNEL_API_CUDA_COREDUMP", parse_flag, False),
    )


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
    trace_file: str | None = None,
    trace_file_size: int | None = None,
    trace_file_fsync: bool | None = None,
    trace_file_keep: int | None = None,
    faulthandler: bool | None = None,
    blackbox: bool | None = None,
    dump_dir: str | None = None,
    dump_include: "tuple[str, ...] | list[str] | None" = None,
    dump_exclude: "tuple[str, ...] | list[str] | None" = None,
    dump_max_bytes: int | None = None,
    dump_max_count: int | None = None,
    export_sidecar: "bool | str | None" = None,
    collectives: bool | None = None,
    graph_output_check: bool | None = None,
    graph_nan_check: bool | None = None,
    nan_flags: bool | None = None,
    nan_flag_inputs: "tuple[str, ...] | list[str] | None" = None,
    hang_seconds: float | None = None,
    cuda_coredump: bool | None = None,
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
        changes["log_dest"] = _log_path(log_dest.strip())
    if spans is not None:
        changes["spans"] = bool(spans)
    if tracer_provider is not KEEP:
        changes["tracer_provider"] = tracer_provider
    if trace_file is not None:
        if not isinstance(trace_file, str) or not trace_file.strip():
            raise ValueError(f"trace_file must be a path or 'off'; got {trace_file!r}")
        changes["trace_file"] = trace_file.strip()
    if trace_file_size is not None:
        if isinstance(trace_file_size, bool) or not isinstance(trace_file_size, int):
            raise ValueError(f"trace_file_size must be an int; got {trace_file_size!r}")
        try:
            changes["trace_file_size"] = check_size(trace_file_size)
        except ValueError as exc:
            raise ValueError(f"trace_file_size must be {exc}; got {trace_file_size!r}") from None
    if trace_file_fsync is not None:
        changes["trace_file_fsync"] = bool(trace_file_fsync)
    if trace_file_keep is not None:
        if isinstance(trace_file_keep, bool) or not isinstance(trace_file_keep, int) or trace_file_keep < 0:
            raise ValueError(f"trace_file_keep must be a non-negative int; got {trace_file_keep!r}")
        changes["trace_file_keep"] = trace_file_keep
    if faulthandler is not None:
        changes["faulthandler"] = bool(faulthandler)
    if blackbox is not None:
        changes["blackbox"] = bool(blackbox)
    if dump_dir is not None:
        if not isinstance(dump_dir, str) or not dump_dir.strip():
            raise ValueError(f"dump_dir must be a path; got {dump_dir!r}")
        changes["dump_dir"] = dump_dir.strip()
    for name, patterns in (("dump_include", dump_include), ("dump_exclude", dump_exclude),
                           ("nan_flag_inputs", nan_flag_inputs)):
        if patterns is not None:
            if isinstance(patterns, str) or not all(isinstance(p, str) for p in patterns):
                raise ValueError(f"{name} must be a list of fnmatch patterns; got {patterns!r}")
            changes[name] = tuple(patterns)
    for name, limit in (("dump_max_bytes", dump_max_bytes), ("dump_max_count", dump_max_count)):
        if limit is not None:
            if isinstance(limit, bool) or not isinstance(limit, int) or limit < 0:
                raise ValueError(f"{name} must be an int >= 0; got {limit!r}")
            changes[name] = limit
    if export_sidecar is not None:
        if isinstance(export_sidecar, str) and export_sidecar != KERNELS:
            raise ValueError(f"export_sidecar must be True, False or {KERNELS!r}; got {export_sidecar!r}")
        changes["export_sidecar"] = export_sidecar if export_sidecar == KERNELS else bool(export_sidecar)
    if collectives is not None:
        changes["collectives"] = bool(collectives)
    if graph_output_check is not None:
        changes["graph_output_check"] = bool(graph_output_check)
    if graph_nan_check is not None:
        changes["graph_nan_check"] = bool(graph_nan_check)
    if nan_flags is not None:
        changes["nan_flags"] = bool(nan_flags)
    if hang_seconds is not None:
        if isinstance(hang_seconds, bool) or not isinstance(hang_seconds, (int, float)):
            raise ValueError(f"hang_seconds must be a number of seconds; got {hang_seconds!r}")
        try:
            changes["hang_seconds"] = parse_seconds(str(hang_seconds))
        except ValueError as exc:
            raise ValueError(f"hang_seconds {exc}; got {hang_seconds!r}") from None
    if cuda_coredump is not None:
        changes["cuda_coredump"] = bool(cuda_coredump)
    _config = dataclasses.replace(_config, **changes)
    # The decorator's runtime and its hooks follow the settings (and set
    # tracing up at once); loaded on first use because they need torch,
    # which reading a trace file does not.
    importlib.import_module(f"{__package__}.capture.recording")
    for listener in _listeners:
        listener(_config)
    return _config
