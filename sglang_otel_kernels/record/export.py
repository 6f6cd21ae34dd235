"""OTLP export beside the trace file, configured by the standard OTEL_* variables.

The kernel path never waits on the network: ended spans go to the SDK's
BatchSpanProcessor (a bounded queue drained by a background thread with the
official OTLP exporter). When the queue is full (a collector down or slow),
spans are dropped here, before the SDK would log a warning for each one, and
the drops are counted and reported once. Sampling (OTEL_TRACES_SAMPLER) is
applied here, at export, so that the trace file keeps every call.
"""

from __future__ import annotations

import os
import threading
import time
import weakref
from typing import Mapping

from opentelemetry.sdk.trace import SpanProcessor
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF, ALWAYS_ON, TraceIdRatioBased

from ..notices import warn
from .export_errors import export_batch

ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
DEFAULT_MAX_QUEUE = 2048
_processors: "weakref.WeakSet[ExportProcessor]" = weakref.WeakSet()


def otlp_endpoint(environ: Mapping[str, str] = os.environ) -> str | None:
    for name in ENDPOINT_VARIABLES:
        value = environ.get(name, "").strip()
        if value:
            return value
    return None


def otlp_protocol(environ: Mapping[str, str] = os.environ) -> str:
    """grpc (the Python SDK's and SGLang's default) or http/protobuf."""
    value = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip().lower()
    if value not in ("grpc", "http/protobuf"):
        warn(f"OTLP protocol {value!r} is not supported (grpc or http/protobuf); using grpc")
        return "grpc"
    return value


def otlp_exporter(environ: Mapping[str, str] = os.environ) -> SpanExporter:
    """The official exporter (over gRPC, with our encoding of the request);
    it reads the endpoint, headers, TLS, compression and timeout from the
    same standard variables itself."""
    if otlp_protocol(environ) == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter()
    from .otlp_encode import DirectGrpcExporter

    return DirectGrpcExporter()


class ExportSampler:
    """OTEL_TRACES_SAMPLER's decision, made when a span ends.

    The provider itself samples everything (so the trace file sees every
    call); this decides what goes to OTLP. Ratio decisions depend on the trace
    id only, so a trace is kept or dropped whole; a parent-based sampler
    follows a remote parent's sampled flag (the client's traceparent).
    """

    def __init__(self, environ: Mapping[str, str] = os.environ) -> None:
        name = environ.get("OTEL_TRACES_SAMPLER", "parentbased_always_on").strip().lower()
        argument = environ.get("OTEL_TRACES_SAMPLER_ARG", "").strip()
        self.parent_based = name.startswith("parentbased_")
        root = name.removeprefix("parentbased_")
        if root == "always_on":
            self.root = ALWAYS_ON
        elif root == "always_off":
            self.root = ALWAYS_OFF
        elif root == "traceidratio":
            try:
                ratio = float(argument) if argument else 1.0
                if not 0.0 <= ratio <= 1.0:
                    raise ValueError
            except ValueError:
                warn(f"OTEL_TRACES_SAMPLER_ARG={argument!r} is not a ratio in [0, 1]; using 1.0")
                ratio = 1.0
            self.root = TraceIdRatioBased(ratio)
        else:
            warn(f"OTEL_TRACES_SAMPLER={name!r} is not supported here; exporting every span")
            self.parent_based, self.root = False, ALWAYS_ON

    def keep(self, span) -> bool:
        parent = span.parent
        remote = parent is not None and parent.is_remote
        return self.keep_ids(span.context.trace_id, span.name, remote, remote and parent.trace_flags.sampled)

    def keep_ids(self, trace_id: int, name: str, remote_parent: bool, parent_sampled: bool) -> bool:
        """The decision for a span by its trace id, name, and its parent's
        place (in another process or not) and sampled flag."""
        if self.parent_based and remote_parent:
            return parent_sampled
        if self.root is ALWAYS_ON:  # what it would say, without its look at the current context
            return True
        return self.root.should_sample(None, trace_id, name).decision.is_sampled()


class _CountingExporter(SpanExporter):
    """Counts what reaches the exporter, so the queue's fill is known without
    reaching into the batch processor, and notices failed exports. While the
    export is paused, batches still queued are dropped here unencoded:
    encoding them for a collector that is down would only take interpreter
    time from the kernels."""

    def __init__(self, exporter: SpanExporter, owner: "ExportProcessor") -> None:
        self.exporter = exporter
        self.owner = owner
        self.taken = 0
        self.failed = 0
        self._causes: set = set()  # why batches failed, each said once

    def export(self, spans) -> SpanExportResult:
        self.taken += len(spans)
        if self.owner.paused():
            self.failed += len(spans)
            return SpanExportResult.FAILURE
        why = export_batch(self.exporter, spans)
        self.owner.export_result(why is None)
        if why is None:
            return SpanExportResult.SUCCESS
        self.failed += len(spans)
        if why not in self._causes:
            self._causes.add(why)
            warn(f"OTLP export failed: {why}; spans that cannot be sent are dropped and counted, "
                 "kernel calls go on (the trace file keeps them)")
        return SpanExportResult.FAILURE

    def shutdown(self) -> None:
        self.exporter.shutdown()

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.exporter.force_flush(timeout_millis)


class ExportProcessor(SpanProcessor):
    """Samples, then hands spans to a BatchSpanProcessor, dropping (and
    counting) instead of queueing past its capacity.

    After a failed export, spans are dropped at once for a pause that doubles
    up to a minute (and ends with the first success): encoding a batch for a
    collector that is down would take interpreter time from the kernels.
    """

    MIN_PAUSE_S = 1.0
    MAX_PAUSE_S = 60.0

    def __init__(
        self,
        exporter: SpanExporter,
        sampler: ExportSampler | None = None,
        max_queue_size: int | None = None,
        **batch_options,
    ) -> None:
        if max_queue_size is None:
            try:
                max_queue_size = int(os.environ.get("OTEL_BSP_MAX_QUEUE_SIZE", DEFAULT_MAX_QUEUE))
            except ValueError:
                max_queue_size = DEFAULT_MAX_QUEUE
        self.max_queue_size = max_queue_size
        self.sampler = sampler or ExportSampler()
        self.exporter = _CountingExporter(exporter, self)
        self.batch = BatchSpanProcessor(self.exporter, max_queue_size=max_queue_size, **batch_options)
        self.handed = 0
        self.dropped = 0
        self._lock = threading.Lock()
        self._drop_reported = False
        self._paused_until = 0.0
        self._pause = self.MIN_PAUSE_S
        _processors.add(self)

    def paused(self) -> bool:
        return bool(self._paused_until) and time.monotonic() < self._paused_until

    def export_result(self, succeeded: bool) -> None:
        if succeeded:
            self._pause = self.MIN_PAUSE_S
            self._paused_until = 0.0
        else:
            self._paused_until = time.monotonic() + self._pause
            self._pause = min(self._pause * 2, self.MAX_PAUSE_S)

    def after_fork_in_child(self) -> None:
        # The batch processor empties its queue in the child: so does the count.
        self._lock = threading.Lock()
        self.handed = self.exporter.taken

    def on_start(self, span, parent_context=None) -> None:
        pass

    def on_end(self, span) -> None:
        if not self.sampler.keep(span):
            return
        if self.paused():
            self.dropped += 1
            return
        with self._lock:
            full = self.handed - self.exporter.taken >= self.max_queue_size
            if not full:
                self.handed += 1
        if full:
            self.dropped += 1
            if not self._drop_reported:
                self._drop_reported = True
                warn(
                    f"the OTLP export queue is full ({self.max_queue_size} spans; is the collector down or slow?); "
                    "further spans are dropped and counted, kernel calls go on (the trace file keeps them)"
                )
            return
        self.batch.on_end(span)

    def shutdown(self) -> None:
        self.batch.shutdown()
        if self.dropped or self.exporter.failed:
            warn(
                f"OTLP export: {self.dropped} span(s) dropped (full queue, or paused after a failure), "
                f"{self.exporter.failed} span(s) failed to export"
            )

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return self.batch.force_flush(timeout_millis)


def _after_fork_in_child() -> None:
    for processor in list(_processors):
        processor.after_fork_in_child()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
