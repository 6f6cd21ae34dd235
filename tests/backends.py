"""The real back ends the end-to-end tests run, built from source by
.ci/backends: Jaeger v2 (collector-config/jaeger.yaml, in-memory storage,
checked through its query HTTP API, what its UI renders) and the
OpenTelemetry Collector (collector-config/otel-collector.yaml), each on free
loopback ports."""

import json
import os
import signal
import socket
import subprocess
import time
import urllib.parse
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".backends", "bin")
CONFIG = os.path.join(ROOT, "collector-config")


def ensure_built() -> None:
    if not all(os.access(os.path.join(BIN, name), os.X_OK) for name in ("jaeger", "otelcol")):
        subprocess.run(["bash", os.path.join(ROOT, ".ci", "backends")], check=True, timeout=3600)


def port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait(what: str, probe, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = probe()
            if result:
                return result
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.25)


def clean_env(**settings) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
    env.update(settings)
    return env


class Jaeger:
    def __init__(self, log_dir, **env) -> None:
        self.otlp = f"127.0.0.1:{port()}"
        self.query = f"http://127.0.0.1:{port()}"
        env = clean_env(JAEGER_OTLP_GRPC=self.otlp, JAEGER_QUERY_HTTP=self.query[7:],
                        JAEGER_QUERY_GRPC=f"127.0.0.1:{port()}", **env)
        self.log = open(os.path.join(log_dir, "jaeger.log"), "w")
        self.process = subprocess.Popen([os.path.join(BIN, "jaeger"), "--config", os.path.join(CONFIG, "jaeger.yaml")],
                                        env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait("Jaeger's query API", lambda: get(f"{self.query}/api/services") is not None)

    def trace(self, trace_id: int) -> dict:
        [trace] = get(f"{self.query}/api/traces/{trace_id:032x}")["data"]
        return trace

    def search(self, service: str, tags: dict | None = None) -> set[int]:
        query = {"service": service, "limit": "1000", "lookback": "1h"}
        if tags:
            query["tags"] = json.dumps(tags)
        found = get(f"{self.query}/api/traces?{urllib.parse.urlencode(query)}")["data"] or []
        return {int(trace["traceID"], 16) for trace in found}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


class Collector:
    def __init__(self, log_dir, jaeger: Jaeger, sample_percent: int, archive: str) -> None:
        self.grpc = port()
        self.archive = archive
        os.makedirs(os.path.dirname(archive), exist_ok=True)  # the file exporter makes no directory
        env = clean_env(OTLP_GRPC_PORT=str(self.grpc), OTLP_HTTP_PORT=str(port()), METRICS_PORT=str(port()),
                         JAEGER_OTLP_ENDPOINT=jaeger.otlp, SAMPLE_PERCENT=str(sample_percent), ARCHIVE_PATH=archive)
        self.log = open(os.path.join(log_dir, f"collector-{sample_percent}.log"), "w")
        self.process = subprocess.Popen(
            [os.path.join(BIN, "otelcol"), "--config", os.path.join(CONFIG, "otel-collector.yaml")],
            env=env, stdout=self.log, stderr=subprocess.STDOUT)
        wait("the Collector's OTLP port", self._listening)

    def _listening(self) -> bool:
        if self.process.poll() is not None:
            raise AssertionError(f"the Collector exited: {open(self.log.name).read()[-2000:]}")
        socket.create_connection(("127.0.0.1", self.grpc), 1).close()
        return True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc}"

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)  # flushes the batch processor and the file exporter
        self.process.wait(timeout=60)
        self.log.close()


