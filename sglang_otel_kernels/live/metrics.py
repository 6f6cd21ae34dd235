"""Metrics for alerts, as OTLP metrics through the SDK's MeterProvider.

The export sidecar of each process counts what it reads of the trace file:
`sglang.kernel.calls`, `sglang.kernel.failures` (calls that ended in an
error) and `sglang.kernel.nonfinite` (calls whose output holds NaN/Inf),
each by kernel name, the last two from a kernel's first call on (at 0 until
it fails: an alert on their increase sees the first failure). It gauges
`sglang.kernel.in_flight.longest`: the seconds the innermost kernel call in
flight has run, named, with `sglang.kernel.collective` saying whether it is
a collective (a rank waiting there for another is a victim, not a hang);
and, once the process died with a kernel call in flight,
`sglang.kernel.in_flight_at_death` (1, that call named, with the fatal
signal) until the sidecar ends; once it died outside any kernel call (killed
between kernels, as the OOM killer does), or ended right after a failure
(SGLang's scheduler returns once its batch failed) or after an exception no
code caught (a device error raised by a later synchronisation, after its
kernel call returned),
`sglang.process.crashed` (1, with why in `sglang.process.reason`: that
exception's type, else the fatal signal, else `killed`, and its last kernel
call, the failed one where one failed). A process stopped on purpose
(SIGTERM, or told to stop) is gauged by neither. How a process ended is
decided where `report` decides it (recover/verdict.py `ending`): these
gauges only render it. `watch` gauges `sglang.job.suspect`: 1 per
suspect of a job's verdict while a rank of the job lives, with its
`reason`. Every series carries the rank (`sglang.rank`), the host
(`host.name`) and the job (`sglang.job`) where they are known; a series
that stops being true is exported once more at 0, so that it reads 0 at
once rather than keeping its last value until the back end expires it.
They are exported every OTEL_METRIC_EXPORT_INTERVAL (60 s by default) to
the OTLP endpoint (OTEL_EXPORTER_OTLP_METRICS_ENDPOINT, else the one traces
go to); OTEL_METRICS_EXPORTER=none turns them off. The shipped Collector
serves them to Prometheus (`sglang_kernel_calls_total{sglang_rank="2",...}`,
`sglang_kernel_in_flight_longest_seconds`, `sglang_job_suspect`), and the
shipped rules alert on them (collector-config/prometheus-alerts.yaml,
docs/runbook.md).
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
from ..schema import (COLLECTIVE_OP, COPY_OF, FATAL_SIGNAL, HUNG, MODULE, NAME, NONFINITE_CALL, NONFINITE_SPAN,
                      REQUEST_ID, TRACER_NAME)
from ..recover.ranks import rank_of_metadata
from ..record.reader import RecoveredSpan, innermost_call

RANK, HOST, JOB = "sglang.rank", "host.name", "sglang.job"
COLLECTIVE = "sglang.kernel.collective"  # whether the call is a collective (torch.distributed): its waiters are victims
REASON = "sglang.process.reason"  # why a process crashed outside any kernel call


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


_MAX_LABEL = 256  # a file's header is hostile input: a label past this is left out


def labels_of(metadata: dict) -> dict:
    """The rank, host and job a trace file's header (and the IDENTITY
    records after it) says, as metric attributes; those it lacks left out."""
    ranks = metadata.get("ranks") if isinstance(metadata.get("ranks"), dict) else {}
    found = {RANK: rank_of_metadata(metadata), HOST: metadata.get("host"), JOB: ranks.get("job")}
    return {key: value for key, value in found.items()
            if type(value) is int or (type(value) is str and 0 < len(value) <= _MAX_LABEL)}


class _Retiring:
    """The series of an observable gauge now true, and those exported before
    that are true no more: each of these is exported once more at 0."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._now: dict[tuple, float] = {}
        self._exported: set[tuple] = set()

    def set(self, series: "dict[tuple, float]") -> None:
        """`series`: attribute items (sorted) -> value, what is true now."""
        with self._lock:
            self._now = series

    def observe(self, options: CallbackOptions) -> Iterable[Observation]:
        with self._lock:
            now, gone = self._now, self._exported - self._now.keys()
            self._exported = set(now)
        return ([Observation(value, dict(key)) for key, value in now.items()]
                + [Observation(0, dict(key)) for key in gone])


def _module_of(attributes: dict) -> "str | None":
    """A span's module path as a label value: text from a file, bounded."""
    module = attributes.get(MODULE)
    return module[:_MAX_MODULE] if isinstance(module, str) and module else None


_MAX_MODULE = 256


def _key(attributes: dict) -> tuple:
    return tuple(sorted(attributes.items()))


class KernelMetrics:
    """The sidecar's metrics of one process. Without `counting` (a sidecar
    that reads the file once the process has ended, `follow --ending-only`)
    only how it ended is gauged: counters of the calls a ring still held
    would count some of its calls, once."""

    def __init__(self, exporter: MetricExporter, resource: Resource, counting: bool = True) -> None:
        self._counting = counting
        self.provider = _provider(exporter, resource)
        meter = self.provider.get_meter(TRACER_NAME, __version__)
        self._calls = meter.create_counter("sglang.kernel.calls", unit="{call}", description="kernel calls that ended")
        self._failures = meter.create_counter("sglang.kernel.failures", unit="{call}",
                                              description="kernel calls that ended in an error")
        self._nonfinite = meter.create_counter("sglang.kernel.nonfinite", unit="{call}",
                                               description="kernel calls whose output holds NaN or Inf")
        self._in_flight, self._death = _Retiring(), _Retiring()
        meter.create_observable_gauge("sglang.kernel.in_flight.longest", callbacks=[self._in_flight.observe], unit="s",
                                      description="how long the innermost kernel call in flight has run (its name, "
                                                  "and whether it is a collective)")
        meter.create_observable_gauge("sglang.kernel.in_flight_at_death", callbacks=[self._death.observe],
                                      unit="{call}", description="1: the process died with this kernel call in flight")
        self._crashed = _Retiring()
        meter.create_observable_gauge("sglang.process.crashed", callbacks=[self._crashed.observe], unit="{process}",
                                      description="1: the process died outside any kernel call, or ended right "
                                                  "after a failure or an exception no code caught (why: "
                                                  "sglang.process.reason)")
        self._labels: dict = {}
        self._seen: set[tuple] = set()  # (labels, name) whose failure and NaN/Inf series exist
        # (name, failed, nonfinite, counted already, module of a NaN/Inf) -> calls not added yet
        self._pending: dict[tuple, int] = {}

    @property
    def labels(self) -> dict:
        return self._labels

    @labels.setter
    def labels(self, labels: dict) -> None:
        """The process's rank, host and job (`labels_of`), on every series from now on."""
        if labels != self._labels:
            self.flush()  # the calls counted so far under the labels they had
            self._labels = labels

    def count(self, span: RecoveredSpan) -> None:
        """A span of the file that ended: a kernel call is counted (copies and
        early exports are not calls); the NaN flags' mark of a call (the one
        in its batch's trace, not a request's), as that call's NaN/Inf. A
        NaN/Inf is counted with the call's module path where it is known
        (the layer the alert names)."""
        attributes = span.attributes
        if NAME in attributes and COPY_OF not in attributes and HUNG not in attributes and not span.in_flight:
            nonfinite = batches.output_flagged(attributes)
            self.call(span.name, span.status_code == "ERROR", nonfinite,
                      module=_module_of(attributes) if nonfinite else None)
        elif span.name == NONFINITE_SPAN and REQUEST_ID not in attributes:
            marked = attributes.get(NONFINITE_CALL)
            if isinstance(marked, str):
                self.call(marked, False, True, counted=True, module=_module_of(attributes))

    def call(self, name: str, failed: bool, nonfinite: bool, counted: bool = False,
             module: "str | None" = None) -> None:
        """One kernel call that ended, kept with the others like it until
        `flush`; `counted`: the call was counted already (its NaN/Inf learnt
        after it ended); `module`: the module path of a call that made NaN/Inf."""
        if self._counting:
            key = (name, failed, nonfinite, counted, module)
            self._pending[key] = self._pending.get(key, 0) + 1

    def flush(self) -> None:
        """The calls kept since the last flush, into the counters: an add per
        kind of call, rather than one per call (each costs microseconds). A
        kernel's failure and NaN/Inf series start at 0 with its first call."""
        pending, self._pending = self._pending, {}
        for (name, failed, nonfinite, counted, module), calls in pending.items():
            labels = {**self._labels, NAME: name}
            if not counted:
                self._calls.add(calls, labels)
            seen = (_key(self._labels), name)
            if seen not in self._seen:
                self._seen.add(seen)
                self._failures.add(0, labels)
                self._nonfinite.add(0, labels)
            if failed:
                self._failures.add(calls, labels)
            if nonfinite:
                self._nonfinite.add(calls, {**labels, MODULE: module} if module else labels)

    def _call_labels(self, call: RecoveredSpan) -> dict:
        return {**self._labels, NAME: call.name, COLLECTIVE: COLLECTIVE_OP in call.attributes}

    def in_flight(self, calls: "list[RecoveredSpan]", now: int) -> None:
        """The kernel calls in flight at `now` (ns): the innermost is gauged."""
        call = innermost_call(calls)
        self._in_flight.set({} if call is None else
                            {_key(self._call_labels(call)): round(max(now - call.start_time, 0) / 1e9, 3)})

    def ended(self, ending: dict) -> None:
        """The process is gone, and `ending` is how (recover/verdict.py
        `ending`, decided there): one that pages is gauged with the kernel
        call it died in, else as a crash with why."""
        self._in_flight.set({})
        if not ending["pages"]:
            return
        died_in = ending["died_in"]
        if died_in is not None:
            self._death.set({_key({**self._labels, NAME: died_in["name"], COLLECTIVE: died_in["collective"],
                                   FATAL_SIGNAL: ending["signal"] or "none"}): 1})
            return
        labels = {**self._labels, REASON: ending["why"]}
        if ending["call"]:
            labels[NAME] = ending["call"]
        self._crashed.set({_key(labels): 1})

    def close(self) -> None:
        self.flush()
        self.provider.shutdown()  # the last values go out


class JobMetrics:
    """`watch`'s: `sglang.job.suspect`, 1 per suspect of each job's newest
    verdict while one of the job's ranks lives (a job gone has nobody to
    page for: its deaths are the sidecars' `sglang.kernel.in_flight_at_death`)."""

    def __init__(self, exporter: MetricExporter, resource: Resource) -> None:
        self.provider = _provider(exporter, resource)
        self._suspects = _Retiring()
        self.provider.get_meter(TRACER_NAME, __version__).create_observable_gauge(
            "sglang.job.suspect", callbacks=[self._suspects.observe], unit="{rank}",
            description="1 for each suspect rank of a live job's cross-rank verdict, with its reason")

    def verdicts(self, verdicts: list[dict]) -> None:
        found = {}
        for verdict in verdicts:
            ranks = {rank["rank"]: rank for rank in verdict["ranks"]}
            if not any(rank["state"] in ("running", "frozen") for rank in ranks.values()):
                continue
            for suspect in verdict["suspects"]:
                host = (ranks.get(suspect["rank"]) or {}).get("host")
                attributes = {RANK: suspect["rank"], "reason": suspect["reason"], JOB: str(verdict["job"])}
                if type(host) is str and host:
                    attributes[HOST] = host[:_MAX_LABEL]
                found[_key(attributes)] = 1
        self._suspects.set(found)

    def close(self) -> None:
        self.provider.shutdown()
