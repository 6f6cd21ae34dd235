"""Tracing set-up, done once: on the first kernel span, or at `configure()`.

The application's TracerProvider is reused when it has one (our trace-file
processor is added to it; its exporters are left alone). Otherwise an SDK
provider is created and installed as the global one, so the application's own
request spans land in the same place.
"""

from __future__ import annotations

import atexit
import faulthandler
import functools
import os
import signal
import socket
import subprocess
import sys
import threading
import weakref
from typing import Callable

from opentelemetry import trace
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Tracer as SDKTracer
from opentelemetry.sdk.trace import TracerProvider as SDKTracerProvider
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

from .. import config as _config
from .. import files
from .._version import __version__
from ..notices import warn, warn_failed_once
from . import core, export, identity, processor, silence, tracefile

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_attached: "weakref.WeakSet" = weakref.WeakSet()
_own_providers: "weakref.WeakSet" = weakref.WeakSet()
_warned_foreign = False
_watching = False
_recorders: "weakref.WeakSet" = weakref.WeakSet()
_sidecars: set = set()  # the trace files a sidecar of this process follows
_faulthandler_file = None
_faulthandler_theirs = False  # the application had enabled faulthandler before our first file: it keeps it
_sigterm_before = None  # Python's SIGTERM handler when faulthandler took SIGTERM (the pure-Python path; None: not)
_writer_settings: "tuple | None" = None  # those of the current writer (follow_trace_file)


def process_attributes() -> dict:
    """What tells this process from the others of a job: its pid, its host
    and its ranks, as far as they are known."""
    attributes = {"process.pid": os.getpid(), "host.name": socket.gethostname()}
    attributes.update(identity.resource_attributes(identity.known()))
    return attributes


def default_resource() -> Resource:
    # Resource.create also merges OTEL_RESOURCE_ATTRIBUTES.
    return Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME") or "sglang", **process_attributes()})


def _identity_changed(values: dict) -> None:
    """Ranks learnt after start-up go into the trace file and onto the
    resource of the providers this package made (in-process export)."""
    writer = processor.current_writer()
    if writer is not None:
        writer.set_identity(values)
    for provider in list(_own_providers):
        _add_to_resource(provider, identity.resource_attributes(values))
    _with_process.clear()
    _carry_process_everywhere()


def _add_to_resource(provider, attributes: dict) -> None:
    # The SDK offers no public way to change a provider's resource: its
    # internal update, where it is there (1.44 on; tests/test_sdk_fields.py
    # pins it). Older ones keep theirs, and the kernel spans handed to the
    # provider's processors carry the updated one (resource_of).
    update = getattr(provider, "_update_resource", None)
    if update is not None:
        update(Resource(attributes))
    else:
        _updated_resources[provider] = resource_of(provider).merge(Resource(attributes))


_updated_resources: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


_with_process: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # provider -> (pid, resource)


def resource_of(provider) -> Resource:
    """The resource kernel spans handed to `provider`'s processors carry:
    its own, with what this package learnt since it was made (ranks, a forked
    child's pid) where its SDK could not take it. An application's provider
    whose resource names no process (SGLang's own, with --enable-trace) gets
    this process's attributes under its own, for this package's spans alone
    (kernel spans here, batch and request spans by carry_process): a report
    read from a back end tells the processes, and ranks, apart."""
    resource = _updated_resources.get(provider) if _updated_resources else None  # mostly empty: no weakref made
    if resource is not None:
        return resource
    resource = getattr(provider, "resource", None)
    if resource is None or "process.pid" in resource.attributes:
        return resource or Resource.get_empty()
    pid = os.getpid()
    kept = _with_process.get(provider)
    if kept is None or kept[0] != pid:  # a forked child's spans carry its own pid
        kept = _with_process[provider] = (pid, Resource(process_attributes()).merge(resource))
    return kept[1]


def carry_process(tracer, provider) -> None:
    """Our tracer of an application's provider whose resource names no
    process: the batch and request spans it makes carry what the kernel
    spans carry (resource_of). The SDK's Tracer keeps its resource in
    `resource` (tests/test_sdk_fields.py)."""
    resource = getattr(provider, "resource", None)
    if isinstance(tracer, SDKTracer) and resource is not None and "process.pid" not in resource.attributes:
        tracer.resource = resource_of(provider)


def _carry_process_everywhere() -> None:
    """After a fork or news of the ranks: every tracer carry_process set."""
    for recorder in list(_recorders):
        if recorder.tracer:
            carry_process(recorder.tracer, recorder.provider)


identity.on_change(_identity_changed)


def resolve_provider(configured):
    """The provider kernel spans go to, with the trace-file processor on it:
    the one given to `configure`, else the application's global one, else a
    new one installed as the global provider."""
    provider = configured
    if provider is None:
        provider = trace.get_tracer_provider()
        if isinstance(provider, trace.ProxyTracerProvider):
            watch_global_provider()  # so that an application's provider installed later takes ours' place
            trace.set_tracer_provider(own_provider())
            provider = trace.get_tracer_provider()
    attach_trace_file(provider)
    return provider


def sidecar_takes_kernel_spans(provider) -> bool:
    """Whether the sidecar exports the kernel spans of an application's own
    provider (SGLANG_KERNEL_API_EXPORT_SIDECAR=kernels) instead of its
    processors: it needs the trace file and an endpoint of its own."""
    if provider in _own_providers:
        return False
    writer = processor.current_writer()
    if writer is not None and writer.path in _sidecars:
        return True  # a sidecar already follows the file: kernel spans are its
    cfg = _config.get_config()
    return cfg.export_sidecar == _config.KERNELS and cfg.trace_file != _config.OFF and export.otlp_endpoint() is not None


def watch_global_provider() -> None:
    """From now on, a provider the application installs as the global one
    (SGLang's process_tracing_init does) gets the trace file attached at
    once, so that its spans are recorded from then on, not from the first
    kernel; and if the global one is the provider this package installed
    (tracing was set up before the application's), the application's takes
    its place: ours is a default, never a reason to refuse the application's.
    Wraps `opentelemetry.trace.set_tracer_provider`, once."""
    global _watching
    if _watching:
        return
    _watching = True
    original = trace.set_tracer_provider

    @functools.wraps(original)
    def set_tracer_provider(tracer_provider) -> None:
        current = trace.get_tracer_provider()
        # OpenTelemetry sets the global provider once; its guard is private
        # (tests/test_sdk_fields.py pins it). Where it is not, the API keeps
        # ours and says so, as it would for any second provider.
        handing_over = (current in _own_providers and tracer_provider is not current
                        and hasattr(trace, "_TRACER_PROVIDER_SET_ONCE"))
        if handing_over:
            trace._TRACER_PROVIDER_SET_ONCE = type(trace._TRACER_PROVIDER_SET_ONCE)()
            trace._TRACER_PROVIDER = None
        original(tracer_provider)
        if handing_over:
            _handed_over()
        if _config.get_config().level > 0:
            try:
                follow_trace_file(_config.get_config())  # the file now, not at the first kernel
                attach_trace_file(trace.get_tracer_provider())
            except Exception as exc:
                warn(f"trace file not attached to the new TracerProvider ({type(exc).__name__}: {exc})")

    trace.set_tracer_provider = set_tracer_provider


def _handed_over() -> None:
    """After the application's provider replaced ours: kernel spans go to it
    from the next call on; a sidecar already following the trace file (it
    exports everything) now exports kernel spans only, as the application
    exports its own, and kernel spans are left to it."""
    writer = processor.current_writer()
    if writer is not None and writer.path in _sidecars:
        writer.append((tracefile.MODE, tracefile.MODE_KERNELS_ONLY))
    for recorder in list(_recorders):
        recorder.provider = recorder.tracer = None


def track(recorder) -> None:
    """A kernel-span recorder to re-point when the global provider changes."""
    _recorders.add(recorder)


def own_provider() -> SDKTracerProvider:
    """Samples everything, so the trace file keeps every call; OTLP export, when
    an endpoint is set, samples by OTEL_TRACES_SAMPLER on its own."""
    provider = SDKTracerProvider(resource=default_resource(), sampler=ALWAYS_ON)
    _own_providers.add(provider)
    if export.otlp_endpoint() is not None and not _sidecar_exports(_config.get_config()):
        _export_in_process(provider)
    return provider


def _export_in_process(provider: SDKTracerProvider) -> None:
    try:
        provider.add_span_processor(export.ExportProcessor(export.otlp_exporter()))
    except Exception as exc:
        warn(f"OTLP export not set up ({type(exc).__name__}: {exc})")


def _sidecar_exports(cfg: "_config.KernelTraceConfig") -> bool:
    """Sidecar export (the default) needs the trace file; without it, spans
    are exported from this process."""
    if not cfg.export_sidecar:
        return False
    if cfg.trace_file == _config.OFF:
        warn("the trace file is off, so there is no export sidecar: spans are exported from this process "
             "(SGLANG_KERNEL_API_EXPORT_SIDECAR=0 says so without this line)")
        return False
    return True


def attach_trace_file(provider) -> None:
    global _warned_foreign
    writer = processor.current_writer()
    if writer is not None and isinstance(provider, SDKTracerProvider):
        # Also for a file configured after the provider was first attached.
        writer.metadata.setdefault("resource", dict(provider.resource.attributes))
    if provider in _attached:
        return
    if not isinstance(provider, SDKTracerProvider):
        if writer is not None and not _warned_foreign:
            _warned_foreign = True
            warn(
                f"the installed TracerProvider ({type(provider).__name__}) is not the "
                "OpenTelemetry SDK's: kernel spans reach it as spans its tracer makes (with ids of its own), "
                "and the trace file holds the kernel calls but not its spans"
            )
        return
    recorder = processor.TraceFileProcessor()
    provider.add_span_processor(recorder)
    _attached.add(provider)
    # The span open here (an application's request, begun before its first
    # kernel call) started before the file was attached: recorded now, so a
    # crash in the kernel still names it.
    recorder.adopt(trace.get_current_span())


def follow_trace_file(cfg: "_config.KernelTraceConfig") -> None:
    """The trace-file writer the settings call for becomes the current one.
    The same trace-file settings keep the same writer: a new one would start
    the file afresh and lose what it holds."""
    global _writer_settings
    settings = (cfg.level > 0, cfg.spans, cfg.blackbox, cfg.trace_file, cfg.trace_file_size, cfg.trace_file_fsync,
                cfg.faulthandler)
    if settings != _writer_settings:
        _writer_settings = settings
        processor.set_writer(make_writer(cfg))


def make_writer(cfg: "_config.KernelTraceConfig") -> "tracefile.TraceFileWriter | None":
    if cfg.level == 0 or (not cfg.spans and not cfg.blackbox) or cfg.trace_file == _config.OFF:
        return None
    metadata = {
        "format": "sglang-otel-kernels trace file",
        "package_version": __version__,
        "level": cfg.level,
        "blackbox": cfg.blackbox,
        "host": socket.gethostname(),
        "argv": sys.argv,
        "python": sys.version.split()[0],
    }
    writer = tracefile.TraceFileWriter(
        cfg.trace_file,
        capacity=cfg.trace_file_size,
        fsync=cfg.trace_file_fsync,
        metadata=metadata,
        on_open=functools.partial(_on_open, cfg.faulthandler, cfg.export_sidecar, cfg.trace_file, cfg.trace_file_keep,
                                  cfg.hang_seconds),
        on_failure=_no_sidecar if cfg.export_sidecar else None,
        # Where a thread that went silent waits, after as long as a hang takes (0: never).
        on_beat=silence.SilentThreads(cfg.hang_seconds).check if cfg.hang_seconds > 0 else None,
    )
    writer.identity = identity.known()  # in the header: the ranks known when the file is created
    return writer


_opened: "list[Callable[[str], None]]" = []  # the layers above's listeners (capture/uncaught.py's hooks)


def on_open(listener: "Callable[[str], None]") -> None:
    """Call `listener(path)` whenever a trace file is opened for writing."""
    _opened.append(listener)


def _on_open(faulthandler_wanted: bool, sidecar_wanted: bool, template: str, keep: int, hang_seconds: float,
             trace_path: str) -> None:
    for listener in _opened:
        listener(trace_path)
    if faulthandler_wanted:
        _enable_faulthandler(trace_path)
    if sidecar_wanted:
        _start_sidecar(trace_path, hang_seconds)
    if keep > 0:
        # Off the kernel thread, which is writing its first record now.
        threading.Thread(target=_prune, args=(template, trace_path, keep), name="sglang-otel-kernels-prune",
                         daemon=True).start()


def _prune(template: str, own: str, keep: int) -> None:
    try:
        from .retention import prune

        prune(template, own, keep)
    except Exception as exc:  # a guest's housekeeping never disturbs the host
        warn_failed_once("pruning earlier trace files", exc)


def _no_sidecar() -> None:
    """The trace file could not be created, so no sidecar can follow it:
    the providers this package made export from this process instead."""
    if export.otlp_endpoint() is None:
        return
    provider = trace.get_tracer_provider()
    if provider in _own_providers:
        warn("without a trace file there is no export sidecar: spans are exported from this process")
        _export_in_process(provider)
    elif sidecar_takes_kernel_spans(provider):
        warn("without a trace file there is no export sidecar: kernel spans are not exported "
             "(SGLANG_KERNEL_API_EXPORT_SIDECAR=1 hands them to the application's exporters)")


def _start_sidecar(trace_path: str, hang_seconds: float) -> None:
    """`sglang-otel-kernels follow` for this file and process, in its own
    session (a Ctrl-C for the application must not stop it before it has
    exported what the application left) and out of its process tree, at a
    lower priority (nice 10); it exits after this process does."""
    if export.otlp_endpoint() is None:
        return  # nothing to export to
    command = ["follow", trace_path, "--pid", str(os.getpid()), "--hang-seconds", repr(hang_seconds)]
    following = True
    if trace.get_tracer_provider() not in _own_providers:
        following = sidecar_takes_kernel_spans(trace.get_tracer_provider())
        # The application exports its own spans; with its kernel spans too, from its process, the sidecar
        # reads the file only once the process has ended: what its exporter never had, and how it ended.
        command.append("--kernels-only" if following else "--ending-only")
    # Not `-m sglang_otel_kernels`: that searches the working directory
    # first, where another `sglang_otel_kernels/` would run instead. The
    # sidecar imports this very package, from where it was loaded.
    # Niced: export is background work, and yields the cores to the application's.
    code = (f"import os, sys; os.nice(10); sys.path[0] = {_PACKAGE_ROOT!r}; "
            "from sglang_otel_kernels.__main__ import main; sys.exit(main())")
    # Started through a shell that exits at once: the sidecar is then no descendant of this process, so
    # an engine's cleanup that kills its whole process tree (SGLang's kill_process_tree, after a crash)
    # leaves it to export what the crash left. The shell's own exit is reaped by subprocess later.
    launcher = ["/bin/sh", "-c", '"$@" &', "sh"] if os.path.exists("/bin/sh") else []
    try:
        subprocess.Popen(
            [*launcher, sys.executable, "-c", code, *command],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, start_new_session=True,
        )
        if following:  # kernel spans are its to export
            _sidecars.add(trace_path)
    except OSError as exc:
        warn(f"cannot start the export sidecar ({exc}); spans stay in the trace file "
             "(sglang-otel-kernels replay sends them later)")


def _enable_faulthandler(trace_path: str) -> None:
    """Python's traceback on SIGSEGV/SIGBUS/SIGABRT/SIGFPE/SIGILL, beside the
    trace file (an application that enabled faulthandler itself keeps it),
    and a word on SIGTERM, so that a process stopped on purpose (systemd, a
    launcher stopping its children) reads as stopped, not dead: text with no
    "Fatal Python error" line, then SIGTERM does what it did before (ends the
    process, or runs the application's handler). The compiled core writes
    one line (`mark_sigterm`: dumping stacks in a signal handler can crash
    the stop into a SIGSEGV); the pure-Python path has only faulthandler,
    told to write the interrupted thread's stack alone (other threads'
    frames change under the dump: all of them crashed a test process now
    and then; on CPython 3.12 before 3.12.8 and 3.13.0 even that one can).
    An application that sets a SIGTERM handler of its own later replaces
    this one, and handles its stop itself."""
    global _faulthandler_file, _faulthandler_theirs, _sigterm_before
    if _faulthandler_file is None:
        _faulthandler_theirs = faulthandler.is_enabled()
    try:
        # Never through a link, never a FIFO; the writer moved an earlier
        # run's traceback aside with its trace file.
        path = tracefile.traceback_path(trace_path)
        fd = files.open_regular(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW)
        os.fchmod(fd, 0o600)  # whatever the umask, and for a file that existed
        new_file = os.fdopen(fd, "w")
        if not _faulthandler_theirs:
            faulthandler.enable(file=new_file, all_threads=True)
        before = signal.getsignal(signal.SIGTERM)
        if core.native is not None:
            core.native.mark_sigterm(new_file.fileno())
        elif hasattr(faulthandler, "register") and before is not signal.SIG_IGN:
            # An ignored SIGTERM stops nothing: nothing may say it did.
            faulthandler.register(signal.SIGTERM, file=new_file, all_threads=False, chain=True)
            _sigterm_before = before
    except (OSError, ValueError, RuntimeError) as exc:
        warn(f"cannot enable faulthandler ({exc})")
        return
    previous, _faulthandler_file = _faulthandler_file, (new_file, path)
    if previous is not None:
        previous[0].close()
    else:
        atexit.register(_remove_empty_traceback)


def _remove_empty_traceback() -> None:
    """At a clean exit nothing was written to the traceback file: it is
    removed (only if the path still names our file), so runs leave nothing
    empty behind. A process that dies keeps it, written or not."""
    if _faulthandler_file is None:
        return
    handle, path = _faulthandler_file
    try:
        mine = os.fstat(handle.fileno())
        if mine.st_size:
            return
        # SIGTERM stays registered: unregistering would put back the handler from before it,
        # over one the application may have set since.
        if not _faulthandler_theirs:
            faulthandler.disable()
        there = os.stat(path, follow_symlinks=False)
        if (there.st_dev, there.st_ino) == (mine.st_dev, mine.st_ino):
            os.unlink(path)
    except OSError:
        pass


def _after_fork_in_child() -> None:
    global _sigterm_before
    # A forked child's spans must carry its own pid. The SDK refreshes only
    # the resource detectors named in OTEL_EXPERIMENTAL_RESOURCE_DETECTORS.
    for provider in list(_own_providers):
        _add_to_resource(provider, {"process.pid": os.getpid()})
    _carry_process_everywhere()
    # A worker its parent stops with SIGTERM must not say so in the parent's
    # traceback file: the child gets back the handler from before ours (it
    # registers its own with its own file), unless the application set one
    # since, which replaced ours already.
    if core.native is not None:
        core.native.mark_sigterm(-1)
    elif _sigterm_before is not None and signal.getsignal(signal.SIGTERM) is _sigterm_before:
        faulthandler.unregister(signal.SIGTERM)
    _sigterm_before = None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
