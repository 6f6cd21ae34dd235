"""The example service end to end: HTTP requests with the client's
traceparent, batched forward passes, OTLP to a real receiver on loopback."""

import json
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import sglang_otel_kernels as sok
from otlp_receivers import GrpcReceiver
from conftest import clean_env

KERNELS = {"sglang.custom_op.embedding", "sglang.custom_op.rmsnorm", "sglang.quant_method.UnquantizedLinearMethod.apply"}


def post(port, tokens, trace_id, parent_id):
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}/generate",
        data=json.dumps({"tokens": tokens}).encode(),
        headers={"traceparent": f"00-{trace_id:032x}-{parent_id:016x}-01", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def kernels_serving(trace_id, spans):
    """The kernel spans that served the request whose client trace is `trace_id`."""
    by_id = {s["span_id"]: s for s in spans}
    batches = set()
    for span in spans:
        if span["trace_id"] != trace_id:
            continue
        if span["name"] == "decode_batch":  # a batch of one: inside the request's trace
            batches.add(span["span_id"])
        if span["name"] == "decode_batch.request":  # one of several: a link to the batch
            batches.update(span_id for _, span_id in span["links"])
    assert all(by_id[b]["name"] == "decode_batch" for b in batches)
    return [s for s in spans if s["name"] in KERNELS and s["parent_span_id"] in batches]


def test_requests_reach_their_kernels_in_the_back_end(tmp_path):
    receiver = GrpcReceiver()
    env = clean_env()
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true",
               OTEL_SERVICE_NAME="example", OTEL_BSP_SCHEDULE_DELAY="100")
    server = subprocess.Popen(
        [sys.executable, "-m", "sglang_otel_kernels.example.server", "--port", "0"],
        cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )
    try:
        line = server.stdout.readline()
        assert line.startswith("listening on http://127.0.0.1:"), line + server.stderr.read()
        port = int(line.split(":")[2].split()[0])
        good = [(0x100 + i, 0x200 + i) for i in range(6)]
        results = {}

        def client(index, trace_id, parent_id):
            results[index] = post(port, [1 + index, 2, 3], trace_id, parent_id)

        threads = [threading.Thread(target=client, args=(i, *ids)) for i, ids in enumerate(good)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        bad_status, bad_body = post(port, [5, 99], 0x999, 0x998)
        assert bad_status == 500
        assert all(status == 200 for status, _ in results.values()), results
        assert bad_body["error"] == "IndexError: index out of range in self"
    finally:
        server.send_signal(signal.SIGTERM)
        server.wait(timeout=60)
    try:
        spans = receiver.wait_for(lambda got: sum(s["name"].startswith("POST /generate ") for s in got) == 7)
    finally:
        receiver.stop()
    assert server.returncode == 0, server.stderr.read()

    answers = [results[i] for i in range(len(good))] + [(bad_status, bad_body)]
    for (trace_id, parent_id), (status, body) in zip(good + [(0x999, 0x998)], answers):
        # The request's span is named by the id its answer gave (what Jaeger's search list shows of a trace).
        (request,) = [s for s in spans if s["trace_id"] == trace_id and s["kind"] == 2]
        assert request["name"] == f"POST /generate {body['id']}"
        assert request["attributes"]["sglang.request.id"] == body["id"]
        assert request["attributes"]["http.status_code"] == status
        assert request["status"] == (2 if status == 500 else 0)
        assert request["parent_span_id"] == parent_id  # the client's traceparent was honoured
        served = kernels_serving(trace_id, spans)
        assert {k["name"] for k in served} >= {"sglang.custom_op.embedding"}, trace_id
    (failed,) = [k for k in kernels_serving(0x999, spans) if k["status"] == 2]
    assert failed["name"] == "sglang.custom_op.embedding"
    assert failed["attributes"]["sglang.kernel.input.arg0.shape"] == (1, 2)
    # The file the service left agrees with the back end on every id.
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    recovered = sok.read_trace(trace_file)
    assert {(s.trace_id, s.span_id) for s in recovered} == {(s["trace_id"], s["span_id"]) for s in spans}


def _raw_post(port, body: bytes, headers=None):
    request = urllib.request.Request(f"http://127.0.0.1:{port}/generate", data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as error:
        return error.code, json.loads(error.read())


def start_service(tmp_path, env_settings: dict, *options: str):
    env = clean_env()
    env.update(env_settings)
    server = subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels.example.server", "--port", "0", *options],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = server.stdout.readline()
    assert line.startswith("listening on http://127.0.0.1:"), line + server.stderr.read()
    return server, int(line.split(":")[2].split()[0])


def stop_service(server):
    server.send_signal(signal.SIGTERM)
    server.wait(timeout=60)
    assert server.returncode == 0, server.stderr.read()


def test_malformed_bodies_get_a_4xx_at_once_and_the_service_keeps_serving(tmp_path):
    server, port = start_service(tmp_path, {})
    try:
        for body, status in [
            (b'{"tokens": [99999999999999999999]}', 400),  # overflowed torch.tensor and killed the scheduler
            (b"not json", 400), (b"\xff\xfe", 400), (b'"tokens"', 400), (b'{"tokens": 5}', 400),
            (b'{"tokens": []}', 400), (b'{"tokens": [1.5]}', 400), (b'{"tokens": [true]}', 400),
            (b'{"tokens": [-1]}', 400), (b'{"tokens": {"a": 1}}', 400), (b'{}', 400),
            (json.dumps({"tokens": [1] * 5000}).encode(), 413),
        ]:
            code, answer = _raw_post(port, body)
            assert code == status and answer["error"], (body[:40], code, answer)
        assert _raw_post(port, b"x" * 10, {"Content-Length": str(2 << 20)})[0] == 413
        for rid in ["", "a b", "x" * 65, "req\u00e9"]:  # not a printable id of 64 characters at most
            code, answer = _raw_post(port, b'{"tokens": [1]}', {"X-Request-Id": rid.encode("utf-8").decode("latin-1")})
            assert code == 400 and "X-Request-Id" in answer["error"], (rid, code, answer)
        # A client's own request id names the request (its span, its batch, its answer).
        code, answer = _raw_post(port, b'{"tokens": [1]}', {"X-Request-Id": "cust-42:a.b_c"})
        assert code == 200 and answer["id"] == "cust-42:a.b_c", answer
        # Still serving, for well-formed requests and kernel failures alike.
        assert _raw_post(port, b'{"tokens": [1, 2, 3]}')[0] == 200
        assert _raw_post(port, b'{"tokens": [1, 4000000]}')[0] == 500
        assert _raw_post(port, b'{"tokens": [3, 2]}')[0] == 200
    finally:
        stop_service(server)


def test_the_environment_decides_level_and_text_log(tmp_path):
    server, port = start_service(tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "5",
                                            "SGLANG_KERNEL_API_LOGDEST": str(tmp_path / "kernels.log")})
    try:
        assert _raw_post(port, b'{"tokens": [1, 31]}')[0] == 200  # the NaN token: the request itself succeeds
    finally:
        stop_service(server)
    log = (tmp_path / "kernels.log").read_text()
    assert "SGLang Kernel API Call: sglang.custom_op.rmsnorm" in log and "nan_count=" in log
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    norm = [s for s in sok.read_trace(trace_file) if s.name == "sglang.custom_op.rmsnorm"]
    assert norm[0].attributes["sglang.kernel.level"] == 5
    assert norm[0].attributes["sglang.kernel.has_nan"] is True


def test_without_the_variables_the_service_defaults_to_level_3_and_no_text_log(tmp_path):
    server, port = start_service(tmp_path, {})
    try:
        assert _raw_post(port, b'{"tokens": [1]}')[0] == 200
    finally:
        stop_service(server)
    assert not list(tmp_path.glob("*.log")) and not (tmp_path / "off").exists()
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    assert {s.attributes["sglang.kernel.level"] for s in sok.read_trace(trace_file)
            if s.name.startswith("sglang.custom_op")} == {3}
