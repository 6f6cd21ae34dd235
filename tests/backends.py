"""The real back ends the end-to-end tests run, built from source by
.ci/backends: Jaeger v2 (collector-config/jaeger.yaml, in-memory storage,
checked through its query HTTP API, what its UI renders), the
OpenTelemetry Collector (collector-config/otel-collector.yaml) and
Prometheus (collector-config/prometheus.yml and the alert rules), each on
free loopback ports."""

import fcntl
import json
import os
import random
import re
import signal
import socket
import subprocess
import tempfile
import time
import urllib.parse
import urllib.request

from conftest import clean_env  # noqa: F401  (the tests import it from here too)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, ".backends", "bin")
CONFIG = os.path.join(ROOT, "collector-config")


def ensure_built() -> None:
    if not all(os.access(os.path.join(BIN, name), os.X_OK) for name in ("jaeger", "otelcol", "prometheus", "promtool")):
        subprocess.run(["bash", os.path.join(ROOT, ".ci", "backends")], check=True, timeout=3600)


def operation(name: str) -> str:
    """A span's name, the example service's request spans read as one
    (`POST /generate req-0003`: each names its request)."""
    return re.sub(r"^POST /generate req-\d{4}$", "POST /generate req-N", name)


def _ephemeral_low() -> int:
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as ranges:
            return int(ranges.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


# Ports this process holds: a lock file each, kept open while it lives, so
# that no other test process (xdist's workers, the compat suites running at
# once) and no later call here hands out the same one before its back end binds.
_held: dict[int, object] = {}
_LOCKS = os.path.join(tempfile.gettempdir(), f"sglang-otel-kernels-ports-{os.getuid()}")


def port() -> int:
    """A free loopback port below the kernel's ephemeral range: a port the
    kernel gave out (bind to 0) may be given again to any outgoing connection
    (a server's, a client's) before the back end that was to listen on it
    starts, which then fails with "address already in use"."""
    low = _ephemeral_low()
    os.makedirs(_LOCKS, exist_ok=True)
    for _ in range(200):
        candidate = random.randrange(10000, max(low, 10001))
        if candidate in _held:
            continue
        lock = open(os.path.join(_LOCKS, str(candidate)), "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", candidate))
        except OSError:
            lock.close()
            continue
        _held[candidate] = lock
        return candidate
    with socket.socket() as probe:  # all taken: the kernel's choice
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def get(url: str):
    with urllib.request.urlopen(url, timeout=10) as response:
        return json.loads(response.read())


def wait(what: str, probe, timeout: float = 60.0, detail=None):
    """`probe()`'s first true answer, polled until `timeout`; else an
    AssertionError naming `what` (and `detail`, as it then reads: called
    then, where it is a function)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            result = probe()
            if result:
                return result
        except (OSError, ValueError, KeyError):
            pass
        if time.monotonic() > deadline:
            if callable(detail):
                detail = detail()
            raise AssertionError(f"{what}: not within {timeout} s" + (f"; {detail}" if detail is not None else ""))
        time.sleep(0.25)


def running(what: str, process: subprocess.Popen, log) -> None:
    """Raises, with the end of its log, where a back end has exited (a port
    taken, a bad config) rather than waiting out a probe's timeout."""
    if process.poll() is not None:
        with open(log.name) as text:
            raise AssertionError(f"{what} exited: {text.read()[-2000:]}")


class Jaeger:
    """Jaeger v2 on free loopback ports; `config`: a file of collector-config/
    (in-memory storage by default; gateway/jaeger-badger.yaml persists);
    `ui`: the folder of a built Jaeger UI to serve."""

    def __init__(self, log_dir, config: str = "jaeger.yaml", ui: str | None = None, **env) -> None:
        self.otlp = f"127.0.0.1:{port()}"
        self.query = f"http://127.0.0.1:{port()}"
        self.config = os.path.join(CONFIG, config)
        if ui:
            env["JAEGER_UI_ASSETS"] = os.path.realpath(ui)
        self.env = clean_env(JAEGER_OTLP_GRPC=self.otlp, JAEGER_QUERY_HTTP=self.query[7:],
                             JAEGER_QUERY_GRPC=f"127.0.0.1:{port()}", **env)
        self.log = open(os.path.join(log_dir, f"jaeger-{os.path.basename(config)}.log"), "a")
        self.start()

    def start(self) -> None:
        """Starts it (again, after `stop`: same ports, same storage)."""
        self.process = subprocess.Popen([os.path.join(BIN, "jaeger"), "--config", self.config],
                                        env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait("Jaeger's query API", self._serving)

    def _serving(self) -> bool:
        running("Jaeger", self.process, self.log)
        return get(f"{self.query}/api/services") is not None

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

    def close(self) -> None:
        self.stop()
        self.log.close()


class Otelcol:
    """Our Collector build with a file of collector-config/ and its
    environment, its OTLP/gRPC port free on loopback (OTLP_GRPC_PORT)."""

    def __init__(self, log_dir, name: str, config: "str | list[str]", **env) -> None:
        self.grpc = port()
        # Several files: the Collector merges them in order (an overlay such as gateway/agent-dns.yaml).
        self.configs = [os.path.join(CONFIG, each) for each in ([config] if isinstance(config, str) else config)]
        self.env = clean_env(OTLP_GRPC_PORT=str(self.grpc), OTLP_HTTP_PORT=str(port()), METRICS_PORT=str(port()),
                             PROMETHEUS_PORT=str(port()), **env)
        if "ARCHIVE_PATH" in env:
            os.makedirs(os.path.dirname(env["ARCHIVE_PATH"]), exist_ok=True)  # the file exporter makes no directory
        self.log = open(os.path.join(log_dir, f"{name}.log"), "a")
        self.start()

    def start(self) -> None:
        """Starts it (again, after `stop` or `kill`: same ports)."""
        self.process = subprocess.Popen([os.path.join(BIN, "otelcol")] + [f"--config={path}" for path in self.configs],
                                        env=self.env, stdout=self.log, stderr=subprocess.STDOUT)
        wait("the Collector's OTLP port", self._listening)

    def _listening(self) -> bool:
        running("the Collector", self.process, self.log)
        socket.create_connection(("127.0.0.1", self.grpc), 1).close()
        return True

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.grpc}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.grpc}"

    def samples(self, prefix: str = "otelcol_", port_variable: str = "METRICS_PORT") -> list[str]:
        """Prometheus samples (`name{labels} value`) whose name starts with `prefix`: its own
        (METRICS_PORT), or with PROMETHEUS_PORT those it received and serves."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.env[port_variable]}/metrics", timeout=10) as response:
            text = response.read().decode()
        return [line for line in text.splitlines() if line.startswith(prefix)]

    def metrics(self) -> dict[str, float]:
        """Its own Prometheus metrics, summed over their labels, by name."""
        totals: dict[str, float] = {}
        for line in self.samples():
            name, value = line.split("{")[0].split()[0], line.rsplit(" ", 1)[1]
            totals[name] = totals.get(name, 0.0) + float(value)
        return totals

    def kill(self) -> None:
        self.process.kill()
        self.process.wait(timeout=30)

    def stop(self) -> None:
        self.process.send_signal(signal.SIGTERM)  # flushes the batch processor and the file exporter
        self.process.wait(timeout=60)

    def close(self) -> None:
        if self.process.poll() is None:
            self.stop()
        self.log.close()


class Collector(Otelcol):
    """collector-config/otel-collector.yaml: the single Collector of one machine."""

    def __init__(self, log_dir, jaeger: Jaeger, sample_percent: int, archive: str) -> None:
        self.archive = archive
        super().__init__(log_dir, f"collector-{sample_percent}", "otel-collector.yaml", JAEGER_OTLP_ENDPOINT=jaeger.otlp,
                         SAMPLE_PERCENT=str(sample_percent), ARCHIVE_PATH=archive)


class Prometheus:
    """Prometheus with the shipped scrape config (collector-config/prometheus.yml)
    and alert rules, scraping `targets` and evaluating every second (the
    shipped config says 15 s), with `parameters` for the rules' own
    (collector-config/prometheus-alert-parameters.yaml by default). No
    Alertmanager: the alerts are read from its API."""

    def __init__(self, log_dir, targets: list[str], parameters: "str | None" = None) -> None:
        import yaml

        with open(os.path.join(CONFIG, "prometheus.yml")) as shipped:
            config = yaml.safe_load(shipped)
        config["global"].update(scrape_interval="1s", evaluation_interval="1s")
        config["rule_files"] = [os.path.join(CONFIG, "prometheus-alerts.yaml"),
                                parameters or os.path.join(CONFIG, "prometheus-alert-parameters.yaml")]
        del config["alerting"]
        for job in config["scrape_configs"]:
            job["static_configs"] = [{"targets": targets}]
        path = os.path.join(log_dir, "prometheus.yml")
        with open(path, "w") as out:
            yaml.safe_dump(config, out)
        self.url = f"http://127.0.0.1:{port()}"
        self.log = open(os.path.join(log_dir, "prometheus.log"), "a")
        self.process = subprocess.Popen([os.path.join(BIN, "prometheus"), f"--config.file={path}",
                                         f"--storage.tsdb.path={os.path.join(log_dir, 'prometheus-data')}",
                                         f"--web.listen-address={self.url.split('//')[1]}"],
                                        stdout=self.log, stderr=subprocess.STDOUT)
        wait("Prometheus ready", self._ready)

    def _ready(self) -> bool:
        running("Prometheus", self.process, self.log)
        with urllib.request.urlopen(f"{self.url}/-/ready", timeout=5) as response:
            return response.status == 200

    def alerts(self) -> list[dict]:
        """The alerts pending or firing now (/api/v1/alerts)."""
        return get(f"{self.url}/api/v1/alerts")["data"]["alerts"]

    def query(self, expression: str) -> list[dict]:
        return get(f"{self.url}/api/v1/query?" + urllib.parse.urlencode({"query": expression}))["data"]["result"]

    def close(self) -> None:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            self.process.wait(timeout=60)
        self.log.close()
