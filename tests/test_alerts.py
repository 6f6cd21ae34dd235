"""The shipped alerts (collector-config/prometheus-alerts.yaml): their
promtool unit tests, and the rules run by a real Prometheus with the
shipped scrape config, scraping the real Collector that the export
sidecars of real processes send their metrics to: a hang pages once, for
the culprit, and turns into a death page when the job is killed, which
resolves, while the Collector's archive tells the same story as the trace
files (states, suspects, durations, the Chrome timeline); a kernel's first
failure and first NaN/Inf open tickets; a slow but healthy kernel pages
nothing; a crash outside any kernel call pages once, saying why."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.parse

import pytest
import yaml

from backends import BIN, CONFIG, Jaeger, Otelcol, Prometheus, clean_env, ensure_built, get, wait
from test_ranks import Job

HANG_SECONDS = 10  # the tests' sglang:kernel_hang_seconds (the shipped one is 300)


def promtool(*args: str) -> subprocess.CompletedProcess:
    ensure_built()
    return subprocess.run([os.path.join(BIN, "promtool"), *args], capture_output=True, text=True, timeout=300,
                          cwd=CONFIG)


def test_the_rules_pass_their_promtool_unit_tests():
    proc = promtool("test", "rules", "prometheus-alerts.test.yaml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "SUCCESS" in proc.stdout + proc.stderr


def test_the_shipped_scrape_config_and_its_rules_are_valid():
    proc = promtool("check", "config", "prometheus.yml")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    config = yaml.safe_load(open(os.path.join(CONFIG, "prometheus.yml")))
    # The exporter's `job` (the service) and `instance` stay as it sets them.
    assert all(job["honor_labels"] is True for job in config["scrape_configs"])


def _rules() -> list[dict]:
    groups = yaml.safe_load(open(os.path.join(CONFIG, "prometheus-alerts.yaml")))["groups"]
    return [rule for group in groups for rule in group["rules"]]


def test_every_alert_links_to_its_runbook_section_and_to_jaeger():
    runbook = open(os.path.join(os.path.dirname(CONFIG), "docs", "runbook.md")).read()
    sections = {line[3:].strip().lower() for line in runbook.splitlines() if line.startswith("## ")}
    alerts = [rule for rule in _rules() if "alert" in rule]
    assert len(alerts) >= 7
    for rule in alerts:
        annotations = rule["annotations"]
        assert annotations["runbook_url"].strip().endswith("#" + rule["alert"].lower()), rule["alert"]
        assert rule["alert"].lower() in sections, rule["alert"]
        assert "/search?" in annotations["jaeger"], rule["alert"]
        assert rule["labels"]["severity"] in ("page", "ticket")


def test_the_alertmanager_example_groups_by_job_and_names_only_real_alerts_and_receivers():
    config = yaml.safe_load(open(os.path.join(CONFIG, "alertmanager.yml")))
    names = {rule["alert"] for rule in _rules() if "alert" in rule}
    receivers = {receiver["name"] for receiver in config["receivers"]}
    routes = [config["route"], *config["route"].get("routes", [])]
    assert {route["receiver"] for route in routes} <= receivers
    assert "sglang_job" in config["route"]["group_by"]
    for rule in config["inhibit_rules"]:
        assert rule["equal"] == ["sglang_job"]
        for matcher in rule["source_matchers"] + rule["target_matchers"]:
            if matcher.startswith("alertname=~"):
                assert set(matcher.split('"')[1].split("|")) <= names, matcher


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    """Jaeger, the shipped Collector (its Prometheus endpoint's series
    expire after 15 s instead of 5 minutes) and Prometheus with the shipped
    rules, the hang threshold HANG_SECONDS and links to this Jaeger."""
    ensure_built()
    directory = tmp_path_factory.mktemp("alerts")
    jaeger = Jaeger(directory)
    collector = Otelcol(directory, "collector", "otel-collector.yaml", JAEGER_OTLP_ENDPOINT=jaeger.otlp,
                        SAMPLE_PERCENT="100", ARCHIVE_PATH=str(directory / "archive" / "kernels.jsonl"),
                        METRIC_EXPIRATION="15s")
    shipped = yaml.safe_load(open(os.path.join(CONFIG, "prometheus-alert-parameters.yaml")))
    for rule in shipped["groups"][0]["rules"]:
        if rule["record"] == "sglang:kernel_hang_seconds":
            rule["expr"] = f"vector({HANG_SECONDS})"
        else:
            rule["expr"] = rule["expr"].replace("http://127.0.0.1:16686", jaeger.query)
    parameters = directory / "parameters.yaml"
    parameters.write_text(yaml.safe_dump(shipped))
    prometheus = Prometheus(directory, [f"127.0.0.1:{collector.env['PROMETHEUS_PORT']}"], str(parameters))
    try:
        yield {"directory": directory, "jaeger": jaeger, "collector": collector, "prometheus": prometheus,
               "archive": str(directory / "archive")}
    finally:
        prometheus.close()
        collector.close()
        jaeger.close()


def _of(prometheus: Prometheus, service: str) -> list[dict]:
    """The alerts (pending or firing) of the processes of `service`."""
    return [alert for alert in prometheus.alerts() if alert["labels"].get("job") == service]


def _verdict(path) -> dict:
    """`report --json`'s verdict of the 4-rank job over `path` (its trace files, or an archive)."""
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path), "--json",
                           "--hang-seconds", str(HANG_SECONDS)], capture_output=True, text=True, timeout=120)
    [job] = [job for job in json.loads(proc.stdout)["cross_rank_jobs"] if len(job["ranks"]) == 4]
    return job


def _states(verdict: dict) -> dict:
    return {rank["rank"]: rank["state"] for rank in verdict["ranks"]}


def _suspects(verdict: dict) -> list:
    return [(suspect["rank"], suspect["reason"], suspect["call"]) for suspect in verdict["suspects"]]


def _stuck_seconds(verdict: dict) -> float:
    [rank] = [rank for rank in verdict["ranks"] if rank["rank"] == 2]
    return [call["seconds"] for call in rank["in_flight"] if call["name"] == "layer.stuck"][0]


def _firing(alerts: list[dict]) -> list[tuple]:
    return sorted((a["labels"]["alertname"], a["state"]) for a in alerts)


def test_a_hang_pages_once_for_the_culprit_then_its_kill_pages_the_death_and_both_resolve(stack, tmp_path):
    prometheus, jaeger = stack["prometheus"], stack["jaeger"]
    job = Job(tmp_path, "stuck", OTEL_EXPORTER_OTLP_ENDPOINT=stack["collector"].endpoint,
              OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_SERVICE_NAME="alerts-hang", OTEL_METRIC_EXPORT_INTERVAL="1000",
              SGLANG_KERNEL_API_HANG_SECONDS=str(HANG_SECONDS))
    try:
        job.wait_until("rank 2 stuck, the others in all_reduce", lambda: job.in_flight(2) == [("layer.stuck", None)]
                       and all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3)))
        [hang] = wait("KernelCallHung firing", lambda: [a for a in _of(prometheus, "alerts-hang")
                                                        if a["state"] == "firing"], timeout=180)
        labels = hang["labels"]
        assert (labels["alertname"], labels["severity"], labels["sglang_rank"], labels["sglang_kernel_name"]) == \
            ("KernelCallHung", "page", "2", "layer.stuck")
        assert labels["host_name"] == socket.gethostname() and labels["sglang_job"].startswith("tcp://127.0.0.1:")
        assert float(hang["value"]) > HANG_SECONDS
        # Ranks 0, 1 and 3 wait in all_reduce past the threshold too: victims, nothing pending for them.
        assert _firing(_of(prometheus, "alerts-hang")) == [("KernelCallHung", "firing")]
        # The alert's Jaeger link finds the hung call, exported early.
        link = urllib.parse.urlparse(hang["annotations"]["jaeger"])
        assert link.geturl().startswith(jaeger.query + "/search?")
        query = urllib.parse.parse_qs(link.query)
        found = wait("the hung call through the alert's link", lambda: get(
            f"{jaeger.query}/api/traces?" + urllib.parse.urlencode(
                {"service": query["service"][0], "tags": query["tags"][0], "lookback": "1h", "limit": 20}))["data"])
        assert any(span["operationName"] == "layer.stuck" for trace in found for span in trace["spans"])
        assert hang["annotations"]["runbook_url"] == "docs/runbook.md#kernelcallhung"
        # The Collector's archive tells the live hang as the trace files do: the same ranks running, the
        # same suspect (it holds the hung calls' early exports, not the calls' ends).
        files, archive = _verdict(tmp_path), _verdict(stack["archive"])
        assert _states(archive) == _states(files) == {0: "running", 1: "running", 2: "running", 3: "running"}
        assert _suspects(archive) == _suspects(files) == [(2, "missing", "layer.stuck")]

        job.kill()  # as a watchdog does
        died = wait("KernelProcessDied firing", lambda: [a for a in _of(prometheus, "alerts-hang")
                                                        if a["labels"]["alertname"] == "KernelProcessDied"
                                                        and a["state"] == "firing"], timeout=60)
        assert [(a["labels"]["sglang_rank"], a["labels"]["sglang_kernel_name"],
                 a["labels"]["sglang_process_fatal_signal"]) for a in died] == [("2", "layer.stuck", "none")]
        # The hang page resolved with its processes; the victims' deaths in all_reduce page nothing.
        wait("the hang page resolved", lambda: _firing(_of(prometheus, "alerts-hang"))
             == [("KernelProcessDied", "firing")], timeout=30)
        # After the kill too, with the time the stuck call ran, in the report and in the Chrome timeline.
        files = _verdict(tmp_path)
        archive = wait("the deaths in the archive", lambda: (lambda v: v if _states(v) == _states(files) else None)(
            _verdict(stack["archive"])), timeout=30)
        assert _states(files) == {0: "died", 1: "died", 2: "died", 3: "died"}
        assert _suspects(archive) == _suspects(files) == [(2, "killed_while_stuck", "layer.stuck")]
        stuck = _stuck_seconds(files)
        assert stuck > HANG_SECONDS and abs(_stuck_seconds(archive) - stuck) <= 2.0, (files, archive)
        for source in (tmp_path, stack["archive"]):
            chrome = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", "--format",
                                                "chrome", str(source)], capture_output=True, text=True, timeout=120).stdout)
            [drawn] = [event for event in chrome["traceEvents"] if event.get("name") == "layer.stuck [IN FLIGHT]"]
            assert abs(drawn["dur"] / 1e6 - stuck) <= 2.0, (source, drawn)
        # The death's page resolves once the sidecar's last report expires in the Collector.
        wait("every alert of the job resolved", lambda: not _of(prometheus, "alerts-hang"), timeout=90)
    finally:
        job.kill()


TICKETS = """
import time, torch, sglang_otel_kernels as sok

@sok.debug_kernel_api(op_name="layer.first")
def first(x, fail):
    if fail:
        raise RuntimeError("device-side assert triggered")
    return x * 1.0

@sok.debug_kernel_api(op_name="layer.inf")
def inf(x):
    return x / 0.0

@sok.debug_kernel_api(op_name="layer.slow")
def slow(x):
    time.sleep(6)  # under the threshold
    return x * 1.0

x = torch.ones(4)
try:
    first(x, True)  # the kernel's very first call fails
except RuntimeError:
    pass
for _ in range(3):
    first(x, False)
inf(x)
print("ready", flush=True)
slow(x)
print("slow done", flush=True)
time.sleep(600)
"""


def _ticket_worker(script: str, stack, tmp_path, service: str, **env) -> subprocess.Popen:
    """`script` exporting to the stack's Collector as `service`, its metrics each second."""
    return subprocess.Popen([sys.executable, "-c", script], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=stack["collector"].endpoint,
                                          OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_SERVICE_NAME=service,
                                          OTEL_METRIC_EXPORT_INTERVAL="1000", SGLANG_KERNEL_API_LOGDEST="off",
                                          SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"), **env))


FLAGGED = """
import time, torch, sglang_otel_kernels as sok

@sok.debug_kernel_api(op_name="layer.flagged")
def flagged(x, poison):
    return x / 0.0 if poison else x * 1.0

carriers = [("00-" + "c1" * 16 + "-" + "d1" * 8 + "-01", "r0"), ("00-" + "c2" * 16 + "-" + "d2" * 8 + "-01", "r1")]
for step in range(4):
    with sok.forward_batch(carriers, name="decode"):
        flagged(torch.ones(2, 3), step == 2)
print("ready", flush=True)
time.sleep(600)
"""


def test_a_first_nan_the_nan_flags_saw_at_level_1_opens_its_ticket(stack, tmp_path):
    """Level 1 with SGLANG_KERNEL_API_NAN_FLAGS: no statistics, and still the
    shipped KernelMadeNaN fires for the call the flags saw make Inf (its
    mark, sent after the call, counted by the sidecar), through the real
    Collector and Prometheus; its Jaeger tag finds the mark."""
    prometheus = stack["prometheus"]
    worker = _ticket_worker(FLAGGED, stack, tmp_path, "alerts-flags", SGLANG_KERNEL_API_LOGLEVEL="1",
                            SGLANG_KERNEL_API_NAN_FLAGS="1")
    try:
        assert worker.stdout.readline() == "ready\n", worker.stderr.read()

        def ticket():
            firing = {(a["labels"]["alertname"], a["labels"]["sglang_kernel_name"], a["labels"]["severity"])
                      for a in _of(prometheus, "alerts-flags") if a["state"] == "firing"}
            return firing or None

        assert wait("the NaN ticket", ticket, timeout=90) == {("KernelMadeNaN", "layer.flagged", "ticket")}
        marks = wait("the mark in Jaeger", lambda: stack["jaeger"].search(
            "alerts-flags", {"sglang.kernel.nonfinite_flag": "true"}) or None, timeout=60)
        assert int("c1" * 16, 16) in marks or int("c2" * 16, 16) in marks  # a request's trace holds it
    finally:
        worker.kill()
        worker.wait(timeout=30)


def test_a_first_failure_and_a_first_nan_open_tickets_and_a_slow_healthy_kernel_pages_nothing(stack, tmp_path):
    prometheus = stack["prometheus"]
    worker = _ticket_worker(TICKETS, stack, tmp_path, "alerts-tickets", SGLANG_KERNEL_API_LOGLEVEL="5")
    try:
        assert worker.stdout.readline() == "ready\n", worker.stderr.read()
        seen = []

        def tickets():
            alerts = _of(prometheus, "alerts-tickets")
            seen.extend(_firing(alerts))
            firing = {(a["labels"]["alertname"], a["labels"]["sglang_kernel_name"], a["labels"]["severity"])
                      for a in alerts if a["state"] == "firing"}
            return firing if len(firing) == 2 else None

        assert wait("the two tickets", tickets, timeout=90) == {("KernelCallsFailing", "layer.first", "ticket"),
                                                                 ("KernelMadeNaN", "layer.inf", "ticket")}
        # Each ticket's Jaeger link finds its kernel's calls (the failed one, the one that made Inf).
        for alert in _of(prometheus, "alerts-tickets"):
            link = urllib.parse.parse_qs(urllib.parse.urlparse(alert["annotations"]["jaeger"]).query)
            found = wait(f"{alert['labels']['alertname']}'s Jaeger link", lambda: get(
                f"{stack['jaeger'].query}/api/traces?" + urllib.parse.urlencode(
                    {"service": link["service"][0], "tags": link["tags"][0], "lookback": "1h", "limit": 20}))["data"])
            calls = [span for trace in found for span in trace["spans"]
                     if span["operationName"] == alert["labels"]["sglang_kernel_name"]]
            flag = "error" if alert["labels"]["alertname"] == "KernelCallsFailing" else "sglang.kernel.has_inf"
            assert any({"key": flag, "type": "bool", "value": True} in span["tags"] for span in calls), calls
        assert worker.stdout.readline() == "slow done\n"
        time.sleep(3)  # the last scrape of the slow call's 6 s
        tickets()
        assert {name for name, _ in seen} == {"KernelCallsFailing", "KernelMadeNaN"}, seen
        # The slow call was seen by Prometheus, under the threshold.
        longest = prometheus.query('max_over_time(sglang_kernel_in_flight_longest_seconds'
                                   '{job="alerts-tickets",sglang_kernel_name="layer.slow"}[5m])')
        assert longest and 3 <= float(longest[0]["value"][1]) < HANG_SECONDS, longest
    finally:
        worker.kill()
        worker.wait(timeout=30)


CRASHES = """
import os, sys, time, torch
if sys.argv[1] == "kill-own":  # the application's own provider, exporting every span itself (SGLang's --enable-trace)
    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    trace.set_tracer_provider(provider)
import sglang_otel_kernels as sok

@sok.debug_kernel_api(op_name="layer.last")
def last(x):
    return x * 1.0

x = torch.ones(4)
for _ in range(3):
    last(x)
print("ready", flush=True)
if sys.argv[1] == "raise":  # a device error raised by a later synchronisation, after its kernel call returned
    time.sleep(2)
    raise RuntimeError("CUDA error: device-side assert triggered")
time.sleep(600)  # killed here, between kernels (the OOM killer's way)
"""


def test_a_crash_outside_any_kernel_call_pages_once_with_why(stack, tmp_path):
    """A process that ends after an exception no code caught, and one killed
    between kernel calls, also where the application's own provider exports
    its kernel spans (only how it ended is read, by `follow --ending-only`):
    each pages ProcessCrashed, saying why and naming its last kernel call,
    and nothing else fires for them."""
    prometheus = stack["prometheus"]
    workers = {}
    for how in ("raise", "kill", "kill-own"):
        (tmp_path / how).mkdir()
        workers[how] = subprocess.Popen(
            [sys.executable, "-c", CRASHES, how], cwd=tmp_path / how, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            text=True, env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=stack["collector"].endpoint,
                                     OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_SERVICE_NAME=f"alerts-{how}",
                                     OTEL_METRIC_EXPORT_INTERVAL="1000", SGLANG_KERNEL_API_LOGLEVEL="1",
                                     SGLANG_KERNEL_API_LOGDEST="off",
                                     SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / how / "trace_%i.sgltrace")))
    try:
        for worker in workers.values():
            assert worker.stdout.readline() == "ready\n", worker.stderr.read()
        workers["raise"].wait(timeout=60)
        assert "device-side assert" in workers["raise"].stderr.read()
        for how in ("kill", "kill-own"):
            workers[how].kill()  # asleep, between kernel calls
            workers[how].wait(timeout=30)
        seen = []

        def pages():
            alerts = [a for how in workers for a in _of(prometheus, f"alerts-{how}")]
            seen.extend(_firing(alerts))
            firing = {(a["labels"]["job"], a["labels"]["alertname"], a["labels"]["severity"],
                       a["labels"]["sglang_process_reason"], a["labels"]["sglang_kernel_name"])
                      for a in alerts if a["state"] == "firing"}
            return firing if len(firing) == 3 else None

        assert wait("the three crash pages", pages, timeout=90) == {
            ("alerts-raise", "ProcessCrashed", "page", "RuntimeError", "layer.last"),
            ("alerts-kill", "ProcessCrashed", "page", "killed", "layer.last"),
            ("alerts-kill-own", "ProcessCrashed", "page", "killed", "layer.last")}
        for alert in [a for how in workers for a in _of(prometheus, f"alerts-{how}")]:
            assert alert["labels"]["host_name"] == socket.gethostname()
            assert alert["annotations"]["runbook_url"] == "docs/runbook.md#processcrashed"
        assert {name for name, _ in seen} == {"ProcessCrashed"}, seen
        # The page renders the verdict `report` reads of the same file: one decision, one ending.
        for how, reason in (("raise", "RuntimeError"), ("kill", "killed"), ("kill-own", "killed")):
            report = json.loads(subprocess.run(
                [sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / how), "--json"],
                capture_output=True, text=True, timeout=120).stdout)
            [ending] = [info["ending"] for info in report["files"]]
            assert (ending["why"], ending["call"], ending["pages"]) == (reason, "layer.last", True), ending
        wait("both resolved", lambda: not any(_of(prometheus, f"alerts-{how}") for how in workers), timeout=90)
    finally:
        for worker in workers.values():
            worker.kill()
            worker.wait(timeout=30)
