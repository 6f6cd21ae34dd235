"""The OpenTelemetry instrumentor (`BaseInstrumentor` convention), registered
under the `opentelemetry_instrumentor` entry point, so that
`opentelemetry-instrument <command>` turns kernel recording on.

`instrument()` sets the level to 1 unless SGLANG_KERNEL_API_LOGLEVEL (or the
`level` argument) says otherwise, installs the SGLang integration, and records
the import paths of SGLANG_KERNEL_API_INSTRUMENT plus those given as `paths`
and the torch.ops namespaces given as `namespaces`; `uninstrument()` undoes it.
"""

from __future__ import annotations

import os
from typing import Collection

from opentelemetry.instrumentation.instrumentor import BaseInstrumentor

from .. import config as _config


class KernelInstrumentor(BaseInstrumentor):
    def __init__(self) -> None:
        self._handles: list = []

    def instrumentation_dependencies(self) -> Collection[str]:
        return ("torch >= 2.1",)

    def _instrument(self, **kwargs) -> None:
        from ..capture.ops import instrument_namespace
        from ..capture.paths import instrument, instrument_from_env
        from . import sglang

        level = kwargs.get("level")
        if level is None and "SGLANG_KERNEL_API_LOGLEVEL" not in os.environ:
            level = 1
        changes = {"level": level} if level is not None else {}
        if kwargs.get("tracer_provider") is not None:
            changes["tracer_provider"] = kwargs["tracer_provider"]
        if changes:
            _config.configure(**changes)
        self._handles = [sglang.install()]
        from_env = instrument_from_env()
        if from_env is not None:
            self._handles.append(from_env)
        if kwargs.get("paths"):
            self._handles.append(instrument(*kwargs["paths"]))
        for namespace in kwargs.get("namespaces") or ():
            self._handles.append(instrument_namespace(namespace))

    def _uninstrument(self, **kwargs) -> None:
        handles, self._handles = self._handles, []
        for handle in reversed(handles):
            handle.undo()
