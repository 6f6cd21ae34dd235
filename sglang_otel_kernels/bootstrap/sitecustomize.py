"""Run by Python at start-up in every process that `sglang-otel-kernels run`
starts (its directory is put first on PYTHONPATH, which child processes
inherit): installs the SGLang integration and SGLANG_KERNEL_API_INSTRUMENT
before the application imports anything, then runs the sitecustomize this one
shadows, if there is one. Torch-free, and never breaks the process."""

import importlib
import os
import sys


def _start() -> None:
    try:
        from sglang_otel_kernels.capture.paths import instrument_from_env
        from sglang_otel_kernels.integrations.sglang import install

        install()
        instrument_from_env()
    except Exception as exc:  # the application must start whatever happens here
        print(f"sglang-otel-kernels: start-up instrumentation failed ({type(exc).__name__}: {exc})", file=sys.stderr)


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    ours = sys.modules.pop("sitecustomize", None)
    saved = list(sys.path)
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    try:
        importlib.import_module("sitecustomize")
    except ImportError:
        pass
    finally:
        sys.path[:] = saved
        if ours is not None and "sitecustomize" not in sys.modules:
            sys.modules["sitecustomize"] = ours


_start()
_chain()
