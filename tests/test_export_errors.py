"""An export that fails says why, once per cause, and a run that delivered
nothing exits non-zero: `follow` (the export sidecar) and `replay` against
real failures on loopback: nothing listening, a TLS certificate that does
not verify, an HTTP 401, a name that does not resolve."""

import contextlib
import socket
import subprocess
import sys

import pytest

from conftest import clean_env, run_python
from otlp_receivers import HttpReceiver
from sglang_otel_kernels.record.export_errors import cause

WRITES = """
import time, torch, sglang_otel_kernels as sok
sok.configure(level=3, log_dest="off", trace_file="t.sgltrace")
kernel = sok.debug_kernel_api(op_name="k")(lambda x: x + 1)
deadline = time.monotonic() + float({seconds})
kernel(torch.ones(2))
while time.monotonic() < deadline:
    kernel(torch.ones(2))
    time.sleep(0.05)
"""


@contextlib.contextmanager
def _closed_port():
    """A port nothing listens on, held bound (not listening) while the test
    runs: no other socket takes it meanwhile. (Let go, it could become a
    client's ephemeral port, even the exporter's own, which then connects to
    itself and reads 'connection reset by peer'.)"""
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        yield held.getsockname()[1]


def _env(**more) -> dict:
    env = clean_env()
    for variable in ("REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE"):
        env.pop(variable, None)
    env.update(more)
    return env


def _follow(path, endpoint: str, protocol: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "follow", str(path), "--endpoint", endpoint,
                           "--protocol", protocol, "--timeout", "2", "--interval", "0.1"],
                          env=_env(**env), capture_output=True, text=True, timeout=180)


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for 127.0.0.1, and its key (files)."""
    folder = tmp_path_factory.mktemp("tls")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(folder / "key.pem"),
                    "-out", str(folder / "cert.pem"), "-days", "2", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1"], check=True, capture_output=True, timeout=60)
    return str(folder / "cert.pem"), str(folder / "key.pem")


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_a_collector_that_is_down_is_said_once_and_the_run_exits_1(tmp_path, protocol):
    """A live writer for 3 s: the follower tries batch after batch, and says the cause once."""
    writer = subprocess.Popen([sys.executable, "-c", WRITES.format(seconds=3)], cwd=tmp_path, env=_env())
    try:
        with _closed_port() as port:
            path = f"http://127.0.0.1:{port}" + ("/v1/traces" if protocol == "http/protobuf" else "")
            proc = _follow(tmp_path / "t.sgltrace", path, protocol)
    finally:
        writer.wait(timeout=60)
    said = [line for line in proc.stderr.splitlines() if "did not take" in line]
    assert len(said) == 1 and said[0].endswith("connection refused: nothing listens there (is the Collector "
                                               "running?); retrying"), proc.stderr
    assert proc.returncode == 1 and ": 0 spans sent to" in proc.stdout, proc.stdout + proc.stderr


def test_a_certificate_that_does_not_verify_is_named_and_the_ca_variable_fixes_it(tmp_path, certificate):
    assert run_python(WRITES.format(seconds=0), tmp_path).returncode == 0
    receiver = HttpReceiver(tls=certificate)
    try:
        endpoint = receiver.endpoint + "/v1/traces"
        proc = _follow(tmp_path / "t.sgltrace", endpoint, "http/protobuf")
        assert proc.returncode == 1, proc.stderr
        assert "TLS certificate verification failed (self-signed certificate)" in proc.stderr, proc.stderr
        assert proc.stderr.count("did not take") == 1
        # The CA the back end's certificate comes from: delivered.
        proc = _follow(tmp_path / "t.sgltrace", endpoint, "http/protobuf",
                       OTEL_EXPORTER_OTLP_CERTIFICATE=certificate[0])
        assert proc.returncode == 0 and "did not take" not in proc.stderr, proc.stderr
        receiver.wait_for(lambda spans: any(span["name"] == "k" for span in spans))
        # requests' REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) overrides it in the SDK's HTTP exporter
        # (docs/troubleshooting.md).
        import certifi  # requests' own bundle: no CA of ours in it

        proc = _follow(tmp_path / "t.sgltrace", endpoint, "http/protobuf",
                       OTEL_EXPORTER_OTLP_CERTIFICATE=certificate[0], REQUESTS_CA_BUNDLE=certifi.where())
        assert proc.returncode == 1 and "TLS certificate verification failed" in proc.stderr, proc.stderr
    finally:
        receiver.stop()


def test_an_http_status_is_said_with_what_it_means(tmp_path):
    assert run_python(WRITES.format(seconds=0), tmp_path).returncode == 0
    receiver = HttpReceiver(status=401)
    try:
        proc = _follow(tmp_path / "t.sgltrace", receiver.endpoint + "/v1/traces", "http/protobuf")
    finally:
        receiver.stop()
    assert proc.returncode == 1
    assert proc.stderr.rstrip().endswith("HTTP 401: the back end wants credentials (OTEL_EXPORTER_OTLP_HEADERS)")


def test_replay_says_why_in_its_one_line(tmp_path):
    assert run_python(WRITES.format(seconds=0), tmp_path).returncode == 0
    with _closed_port() as port:
        for endpoint, said in ((f"http://127.0.0.1:{port}", "connection refused"),
                               ("http://no-such-host.invalid:4317", "the host name is not resolved")):
            proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", str(tmp_path / "t.sgltrace"),
                                   "--endpoint", endpoint, "--timeout", "2"], env=_env(), capture_output=True,
                                  text=True, timeout=180)
            assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and said in proc.stderr, proc.stderr


@pytest.mark.parametrize("messages, said", [
    (["Failed to export spans batch code: 403, reason: Forbidden"], "HTTP 403: the credentials were refused"),
    (["Failed to export traces to x:4317, error code: StatusCode.UNAUTHENTICATED, error details: no token"],
     "UNAUTHENTICATED: the back end wants credentials"),
    (["Dropping span batch: serialized size 9 bytes exceeds max_request_size 1 bytes."],
     "the batch is too large for the back end"),
    (["Failed to export spans batch code: 413, reason: Payload Too Large"], "HTTP 413: the batch is too large"),
    (["Failed to export traces to 127.0.0.1:4317, error code: StatusCode.UNAVAILABLE, error details: failed to "
      "connect to all addresses; last error: UNAVAILABLE: ipv4:127.0.0.1:4317: recvmsg:Connection reset by peer"],
     "the connection was reset"),
    (["something new"], "the exporter said: something new"),
    ([], "the exporter gave no reason"),
])
def test_other_causes_in_the_words_of_either_exporter(messages, said):
    assert cause(messages).startswith(said)


def test_an_application_exporting_in_process_says_the_cause_once_and_its_kernels_go_on(tmp_path):
    script = WRITES.format(seconds=2) + "print('done', flush=True)\n"
    with _closed_port() as port:
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180, env=_env(OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
                                                    OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_BSP_SCHEDULE_DELAY="200",
                                                    OTEL_EXPORTER_OTLP_TIMEOUT="1", SGLANG_KERNEL_API_EXPORT_SIDECAR="0"))
    assert proc.returncode == 0 and proc.stdout == "done\n", proc.stderr
    said = [line for line in proc.stderr.splitlines() if "OTLP export failed" in line]
    assert len(said) == 1 and "OTLP export failed: connection refused" in said[0], proc.stderr
    assert "Transient error" not in proc.stderr  # the exporter's own retries, kept out of the application's stderr
