"""The collector and compose files hold together: every pipeline names only
components the file defines, and everything listens on, or is published to,
localhost. (The real Collector binary validates and runs the file in
tests/test_backends.py.)"""

import re
from pathlib import Path

import yaml

CONFIG = Path(__file__).parent.parent / "collector-config"
_ENV = re.compile(r"\$\{env:([A-Z_]+):-([^}]*)\}")


def with_defaults(text: str) -> str:
    """${env:NAME:-default} as the collector resolves it with NAME unset."""
    return _ENV.sub(lambda match: match.group(2), text)


def load_collector():
    return yaml.safe_load(with_defaults((CONFIG / "otel-collector.yaml").read_text()))


def test_pipelines_name_only_defined_components():
    config = load_collector()
    pipelines = config["service"]["pipelines"]
    assert pipelines
    for name, pipeline in pipelines.items():
        assert name.split("/")[0] == "traces"
        for kind in ("receivers", "processors", "exporters"):
            for component in pipeline.get(kind, []):
                assert component in config[kind], f"{name} uses undefined {kind[:-1]} {component}"
    used = {c for p in pipelines.values() for kind in ("receivers", "processors", "exporters") for c in p.get(kind, [])}
    defined = {c for kind in ("receivers", "processors", "exporters") for c in config[kind]}
    assert defined == used, f"defined but unused: {defined - used}"


def test_receivers_listen_on_localhost_by_default():
    protocols = load_collector()["receivers"]["otlp"]["protocols"]
    assert protocols["grpc"]["endpoint"] == "127.0.0.1:4317"
    assert protocols["http"]["endpoint"] == "127.0.0.1:4318"


def test_tail_sampling_keeps_errors_nonfinite_values_and_hung_calls():
    config = load_collector()
    policies = {p["type"]: p for p in config["processors"]["tail_sampling"]["policies"]}
    assert policies["status_code"]["status_code"]["status_codes"] == ["ERROR"]
    flagged = [p["boolean_attribute"]["key"] for p in config["processors"]["tail_sampling"]["policies"]
               if p["type"] == "boolean_attribute"]
    assert sorted(flagged) == ["sglang.kernel.has_inf", "sglang.kernel.has_nan", "sglang.kernel.hung"]
    assert 0 < float(policies["probabilistic"]["probabilistic"]["sampling_percentage"]) <= 100
    sampled = config["service"]["pipelines"]["traces/sampled"]
    assert "tail_sampling" in sampled["processors"] and sampled["exporters"] == ["otlp/jaeger"]
    archive = config["exporters"]["file/archive"]
    assert archive["format"] == "json" and archive["rotation"]["max_megabytes"] > 0


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
