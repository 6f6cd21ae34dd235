"""The collector and compose files hold together: every pipeline names only
components the file defines, and everything listens on, or is published to,
localhost. (The real Collector binary validates and runs the file in
tests/test_backends.py.)"""

import re
from pathlib import Path

import pytest
import yaml

CONFIG = Path(__file__).parent.parent / "collector-config"
_ENV = re.compile(r"\$\{env:([A-Z_]+):-([^}]*)\}")


def with_defaults(text: str) -> str:
    """${env:NAME:-default} as the collector resolves it with NAME unset."""
    return _ENV.sub(lambda match: match.group(2), text)


def load_collector(name: str = "otel-collector.yaml"):
    return yaml.safe_load(with_defaults((CONFIG / name).read_text()))


COLLECTORS = ["otel-collector.yaml", "gateway/agent.yaml", "gateway/gateway.yaml"]


@pytest.mark.parametrize("name", COLLECTORS)
def test_pipelines_name_only_defined_components(name):
    config = load_collector(name)
    pipelines = config["service"]["pipelines"]
    assert pipelines
    for name, pipeline in pipelines.items():
        assert name.split("/")[0] in ("traces", "metrics")
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"{name} uses undefined {kind[:-1]} {component}"
    used = {c for p in pipelines.values() for kind in ("receivers", "processors", "exporters") for c in p.get(kind, [])}
    defined = {c for kind in ("receivers", "processors", "exporters") for c in config[kind]}
    assert defined == used, f"defined but unused: {defined - used}"


@pytest.mark.parametrize("name", ["otel-collector.yaml", "gateway/agent.yaml"])
def test_metrics_are_served_to_prometheus_on_localhost_by_default(name):
    config = load_collector(name)
    assert config["service"]["pipelines"]["metrics"]["exporters"] == ["prometheus"]
    assert config["exporters"]["prometheus"]["endpoint"] == "127.0.0.1:9464"
    readers = config["service"]["telemetry"]["metrics"]["readers"]
    assert readers[0]["pull"]["exporter"]["prometheus"]["host"] == "127.0.0.1"  # METRICS_BIND's default


def test_the_compose_files_run_the_versions_the_repository_builds():
    """The images are those of the Collector and Jaeger that .ci/backends builds from the go.mod
    files (Jaeger tags each release twice: v1.(N+63).0 for its module, v2.N.0 for the binary)."""
    collector = re.search(r"go.opentelemetry.io/collector/otelcol v(\S+)", (CONFIG / "collector" / "go.mod").read_text())
    jaeger = re.search(r"github.com/jaegertracing/jaeger v1\.(\d+)\.(\d+)", (CONFIG / "jaeger" / "go.mod").read_text())
    want = {"otel/opentelemetry-collector-contrib": collector.group(1),
            "jaegertracing/jaeger": f"2.{int(jaeger.group(1)) - 63}.{jaeger.group(2)}"}
    for compose in ("docker-compose.yaml", "gateway/compose.yaml"):
        for service in yaml.safe_load((CONFIG / compose).read_text())["services"].values():
            image, tag = service["image"].rsplit(":", 1)
            assert want[image] == tag, (compose, service["image"])


@pytest.mark.parametrize("name, ports", [("otel-collector.yaml", (4317, 4318)), ("gateway/agent.yaml", (4317, 4318)),
                                         ("gateway/gateway.yaml", (14327, 14328))])
def test_receivers_listen_on_localhost_by_default(name, ports):
    protocols = load_collector(name)["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == f"127.0.0.1:{ports[0]}"
    assert protocols["http"]["endpoint"] == f"127.0.0.1:{ports[1]}"


def test_jaeger_configs_listen_on_localhost_and_do_not_trace_themselves():
    for name in ("jaeger.yaml", "gateway/jaeger-badger.yaml"):
        config = load_collector(name)
        assert config["receivers"]["otlp"]["protocols"]["grpc"]["endpoint"].startswith("127.0.0.1:")
        assert config["extensions"]["jaeger_query"]["enable_tracing"] is False
    badger = load_collector("gateway/jaeger-badger.yaml")["extensions"]["jaeger_storage"]["backends"]["badger_store"]
    assert badger["badger"]["ephemeral"] is False and badger["badger"]["ttl"]["spans"]


def test_the_agent_routes_by_trace_id_with_a_queue_and_retries():
    exporter = load_collector("gateway/agent.yaml")["exporters"]["load_balancing"]
    assert exporter["routing_key"] == "traceID"
    otlp = exporter["protocol"]["otlp"]
    assert otlp["sending_queue"]["enabled"] and otlp["retry_on_failure"]["enabled"]
    assert otlp["tls"]["insecure"] is True  # plain text between the tiers unless GATEWAY_TLS_INSECURE=false
    assert "${env:GATEWAYS:-[]}" in (CONFIG / "gateway" / "agent.yaml").read_text()


@pytest.mark.parametrize("name", ["otel-collector.yaml", "gateway/gateway.yaml"])
def test_tail_sampling_keeps_errors_nonfinite_values_and_hung_calls(name):
    config = load_collector(name)
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    flagged = [p["boolean_attribute"]["key"] for p in config["processors"]["tail_sampling"]["policies"]
               if p["type"] == "boolean_attribute"]
    assert sorted(flagged) == ["sglang.kernel.has_inf", "sglang.kernel.has_nan", "sglang.kernel.hung"]
    assert 0 < float(policies["probabilistic"]["probabilistic"]["sampling_percentage"]) <= 100
    sampled = config["service"]["pipelines"]["traces/sampled"]
    assert "tail_sampling" in sampled["processors"] and sampled["exporters"] == ["otlp_grpc/jaeger"]
    archive = config["exporters"]["file/archive"]
    assert archive["format"] == "json" and archive["rotation"]["max_megabytes"] > 0


def test_the_gateway_compose_publishes_on_loopback_and_mounts_the_configs():
    services = yaml.safe_load((CONFIG / "gateway" / "compose.yaml").read_text())["services"]
    assert set(services) == {"jaeger", "gateway-1", "gateway-2", "agent"}
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
    assert services["agent"]["environment"]["GATEWAYS"] == "[gateway-1:14327, gateway-2:14327]"
    assert any(volume.startswith("./gateway.yaml:") for volume in services["gateway-2"]["volumes"])
    assert services["gateway-2"]["environment"]["ARCHIVE_PATH"] != services["gateway-1"]["environment"]["ARCHIVE_PATH"]


def test_compose_publishes_on_loopback_and_mounts_the_config():
    compose = yaml.safe_load((CONFIG / "docker-compose.yaml").read_text())
    services = compose["services"]
    assert set(services) == {"jaeger", "collector"}
    for service in services.values():
        for port in service.get("ports", []):
            assert port.startswith("127.0.0.1:"), port
    collector = services["collector"]
    assert any(volume.startswith("./otel-collector.yaml:") for volume in collector["volumes"])
    assert collector["environment"]["JAEGER_OTLP_ENDPOINT"] == "jaeger:4317"
    assert "16686" in services["jaeger"]["ports"][0]


def test_the_alert_rules_use_the_metrics_the_collector_serves():
    """Every metric a rule reads is one the sidecars or watch export, under Prometheus's name for it
    (tests/test_alerts.py reads the same names off the real Collector), or a recording rule of the
    rules and their parameters."""
    groups = [group for name in ("prometheus-alerts.yaml", "prometheus-alert-parameters.yaml")
              for group in yaml.safe_load((CONFIG / name).read_text())["groups"]]
    rules = [rule for group in groups for rule in group["rules"]]
    served = {"sglang_kernel_in_flight_longest_seconds", "sglang_kernel_in_flight_at_death", "sglang_job_suspect",
              "sglang_kernel_failures_total", "sglang_kernel_nonfinite_total", "sglang_kernel_calls_total",
              "sglang_process_crashed"}
    recorded = {rule["record"] for rule in rules if "record" in rule}
    names = set()
    for rule in rules:
        assert rule.get("alert") or rule.get("record")
        assert "alert" not in rule or rule["annotations"]["summary"]
        # What `by (...)`, `on (...)` and `{...}` name are labels and values, the rest are metrics.
        expr = re.sub(r"{[^}]*}", "", re.sub(r'"[^"]*"', "", rule["expr"]))
        labels = {label.strip() for group in re.findall(r"(?:by|on) \(([^)]*)\)", expr) for label in group.split(",")}
        names.update(set(re.findall(r"\b(sglang(?:_|:)[a-z_:]+)\b", expr)) - labels)
    assert names and names <= served | recorded, names - served - recorded
    assert {"sglang:kernel_hang_seconds", "sglang:alert_links"} <= recorded
