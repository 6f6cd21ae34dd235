"""Which recording core runs: the compiled one (`_native`, built from
`_native.c` by `pip install`) or this package's pure-Python path.

The compiled core records a call that needs no more than its span (the
black box; levels 1 to 4 with no text log and no in-process export) in C: its
wrapper, clock reads, numbering, nesting and the two records with their CRC,
into the same ring in the same layout; from level 3 also its arguments' and
result's metadata (tensors, numbers, strings and None in C; any other value
by the Python path's own function, for that value alone). Every other call
(statistics, dumps, the text log, a kernel's or a thread's first call), and
every record the writer makes itself, goes through Python as before. A
serving engine's batch span of the trace file alone (capture/requests.py),
opened every step, is also started, attached and ended here. It also
holds SIGTERM's handler, which writes one line beside the trace file
(record/setup.py says why not faulthandler's). Where the extension
is missing, fails to load, or the interpreter runs without the GIL (the core
relies on it to copy a record whole), the Python path runs, with one notice;
`SGLANG_KERNEL_API_NATIVE=0` asks for it.
"""

from __future__ import annotations

import contextvars
import os
import sys
import sysconfig

from ..notices import warn

ENV = "SGLANG_KERNEL_API_NATIVE"


def _load():
    """The extension module, or None (and why, for `--version`)."""
    if os.environ.get(ENV, "").strip().lower() in ("0", "false", "off", "no"):
        return None, f"{ENV}=0"
    if sysconfig.get_config_var("Py_GIL_DISABLED") and not getattr(sys, "_is_gil_enabled", lambda: True)():
        return None, "a free-threaded interpreter"
    try:
        from .. import _native
    except ImportError as exc:
        return None, f"the compiled core is not built here ({exc})"
    return _native, ""


native, why_not = _load()
if native is None and not why_not.startswith(ENV):
    warn(f"the pure-Python recording core runs: {why_not}; pip install on a machine with a C compiler "
         "builds the compiled one")
NATIVE: bool = native is not None


def context_var() -> tuple:
    """OpenTelemetry's ContextVar, which the compiled core reads directly
    where the runtime context is the default one (else None), and the
    function that gives the current context."""
    from opentelemetry import context

    runtime = getattr(context, "_RUNTIME_CONTEXT", None)
    variable = getattr(runtime, "_current_context", None)
    return (variable if isinstance(variable, contextvars.ContextVar) else None), context.get_current


def _reseed() -> None:
    # Ids as random as the SDK's; a forked child draws its own.
    native.seed(os.urandom(32))
    native.reset_seq()


if native is not None:
    _reseed()
    if hasattr(os, "register_at_fork"):
        os.register_at_fork(after_in_child=_reseed)


def describe() -> str:
    """Which core records, for `--version`."""
    return "compiled (C)" if NATIVE else f"pure Python ({why_not})"
