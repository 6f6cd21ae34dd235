"""Metrics for alerts, as OTLP metrics through the SDK's MeterProvider.

The export sidecar of each process counts what it reads of the trace file:
`sglang.kernel.calls`, `sglang.kernel.failures` (calls that ended in an
error) and `sglang.kernel.nonfinite` (calls whose output holds NaN/Inf),
each by kernel name, and gauges `sglang.kernel.in_flight.longest` (seconds
the oldest kernel call in flight has run: a hang grows it). `watch` gauges
`sglang.job.suspect`: 1 per suspect of a job's verdict, with its `reason`.
Every series carries the rank as `sglang.rank` where it is known. They are
exported every OTEL_METRIC_EXPORT_INTERVAL (60 s by default) to the OTLP
endpoint (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else the one traces go to);
OTEL_METRICS_EXPORTER=none turns them off. The shipped Collector serves them
to Prometheus (`sglang_kernel_calls_total{sglang_rank="2",...}`,
`sglang_kernel_in_flight_longest_seconds`, `sglang_job_suspect`).
"""

from __future__ import annotations

import os
import threading
from typing import Iterable
from urllib.parse import urlparse

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from .._version import __version__
from ..record import batches
from ..schema import COPY_OF, HUNG, NAME, TRACER_NAME
from .reader import RecoveredSpan

RANK = "sglang.rank"


def metric_exporter(traces_target: str, protocol: str, timeout_s: float) -> "MetricExporter | None":
    """The official OTLP metric exporter, to OTEL_EXPORTER_OTLP_METRICS_ENDPOINT
    or the traces' endpoint; None with OTEL_METRICS_EXPORTER=none."""
    if os.environ.get("OTEL_METRICS_EXPORTER", "").strip().lower() == "none":
        return None
    target = os.environ.get("OTEL_EXPORTER_OTLP_METRICS_ENDPOINT", "").strip() or traces_target
    if "://" not in target:
        target = "http://" + target
    parsed = urlparse(target)
    if protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as HttpExporter

        base = f"{parsed.scheme}://{parsed.netloc}"
        return HttpExporter(endpoint=target if parsed.path.endswith("/v1/metrics") else base + "/v1/metrics",
                            timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter

    return OTLPMetricExporter(endpoint=f"{parsed.scheme}://{parsed.netloc}", insecure=parsed.scheme == "http",
                              timeout=timeout_s)


def _provider(exporter: MetricExporter, resource: Resource) -> MeterProvider:
    return MeterProvider(resource=resource, metric_readers=[PeriodicExportingMetricReader(exporter)],
                         shutdown_on_exit=False)


class KernelMetrics:
    """The sidecar's metrics of one process."""

    def __init__(self, exporter: MetricExporter, resource: Resource) -> None:
        self.provider = _provider(exporter, resource)
        meter = self.provider.get_meter(TRACER_NAME, __version__)
        self._calls = meter.create_counter("sglang.kernel.calls", unit="{call}", description="kernel calls that ended")
        self._failures = meter.create_counter("sglang.kernel.failures", unit="{call}",
                                              description="kernel calls that ended in an error")
        self._nonfinite = meter.create_counter("sglang.kernel.nonfinite", unit="{call}",
                                               description="kernel calls whose output holds NaN or Inf")
        meter.create_observable_gauge("sglang.kernel.in_flight.longest", callbacks=[self._observe], unit="s",
                                      description="how long the oldest kernel call in flight has run")
        self._rank: "int | None" = None
        self._longest = 0.0
        self._lock = threading.Lock()
        self._pending: dict[tuple, int] = {}  # (name, failed, nonfinite) -> calls not added yet

    @property
    def rank(self) -> "int | None":
        return self._rank

    @rank.setter
    def rank(self, rank: "int | None") -> None:
        self.flush()  # the calls counted so far under the rank they had
        self._rank = rank

    def _attributes(self, **more) -> dict:
        return {RANK: self._rank, **more} if self._rank is not None else more

    def count(self, span: RecoveredSpan) -> None:
        """One kernel call that ended (a file's span; copies and early exports are not calls)."""
        attributes = span.attributes
        if NAME not in attributes or COPY_OF in attributes or HUNG in attributes or span.in_flight:
            return
        self.call(span.name, span.status_code == "ERROR", batches.output_flagged(attributes))

    def call(self, name: str, failed: bool, nonfinite: bool) -> None:
        """One kernel call that ended, kept with the others like it until `flush`."""
        key = (name, failed, nonfinite)
        self._pending[key] = self._pending.get(key, 0) + 1

    def flush(self) -> None:
        """The calls kept since the last flush, into the counters: an add per
        kind of call, rather than one per call (each costs microseconds)."""
        pending, self._pending = self._pending, {}
        for (name, failed, nonfinite), calls in pending.items():
            labels = self._attributes(**{NAME: name})
            self._calls.add(calls, labels)
            if failed:
                self._failures.add(calls, labels)
            if nonfinite:
                self._nonfinite.add(calls, labels)

    def in_flight(self, seconds: float) -> None:
        with self._lock:
            self._longest = seconds

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(self._longest, self._attributes())]

    def close(self) -> None:
        self.flush()
        self.provider.shutdown()  # the last values go out


class JobMetrics:
    """`watch`'s: `sglang.job.suspect`, 1 per suspect of each job's newest verdict."""

    def __init__(self, exporter: MetricExporter, resource: Resource) -> None:
        self.provider = _provider(exporter, resource)
        self.provider.get_meter(TRACER_NAME, __version__).create_observable_gauge(
            "sglang.job.suspect", callbacks=[self._observe], unit="{rank}",
            description="1 for each suspect rank of a job's cross-rank verdict, with its reason")
        self._suspects: list[dict] = []
        self._lock = threading.Lock()

    def verdicts(self, verdicts: list[dict]) -> None:
        found = [{RANK: suspect["rank"], "reason": suspect["reason"], "sglang.job": str(verdict["job"])}
                 for verdict in verdicts for suspect in verdict["suspects"]]
        with self._lock:
            self._suspects = found

    def _observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            return [Observation(1, attributes) for attributes in self._suspects]

    def close(self) -> None:
        self.provider.shutdown()
