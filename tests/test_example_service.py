"""The example service end to end: HTTP requests with the client's
traceparent, batched forward passes, OTLP to a real receiver on loopback."""

import json
import os
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import sglang_otel_kernels as sok
from otlp_receivers import GrpcReceiver

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
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_KERNEL_API", "OTEL_"))}
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
        spans = receiver.wait_for(lambda got: sum(s["name"] == "POST /generate" for s in got) == 7)
    finally:
        receiver.stop()
    assert server.returncode == 0, server.stderr.read()

    for trace_id, parent_id in good + [(0x999, 0x998)]:
        (request,) = [s for s in spans if s["trace_id"] == trace_id and s["name"] == "POST /generate"]
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
