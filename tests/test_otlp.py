"""OTLP export over real sockets on loopback, gRPC and HTTP/protobuf, into
receivers built on the official messages; the trace file and the back end
must agree."""

import subprocess
import sys
import time

import pytest

import sglang_otel_kernels as sok
from otlp_receivers import GrpcReceiver, HttpReceiver
from conftest import clean_env

CLIENT_TRACES = [0x1000 + i for i in range(3)]
CLIENT_PARENTS = [0x2000 + i for i in range(3)]

SERVER = """
import sys, torch, sglang_otel_kernels as sok
from opentelemetry import trace
from opentelemetry.trace import SpanKind
sok.configure(level=3, log_dest="off", trace_file="t.sgltrace")
kernel = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x: x * 2)
tracer = trace.get_tracer("example.server")
clients = [(int(t), int(p)) for t, p in (pair.split(":") for pair in sys.argv[1:])]
requests = []
for index, (trace_id, parent_id) in enumerate(clients):
    traceparent = f"00-{trace_id:032x}-{parent_id:016x}-01"
    with tracer.start_as_current_span(f"Req r{index}", kind=SpanKind.SERVER, context=sok.extract(traceparent)):
        requests.append((sok.inject(), f"r{index}"))
with sok.forward_batch(requests, name="decode_batch"):
    kernel(torch.ones(4))
with sok.forward_batch(requests[:1], name="prefill_batch"):
    kernel(torch.ones(2))
print(sok.trace_file_path())
"""


def run_server(tmp_path, env):
    pairs = [f"{t}:{p}" for t, p in zip(CLIENT_TRACES, CLIENT_PARENTS)]
    return subprocess.run(
        [sys.executable, "-c", SERVER, *pairs], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_request_traces_hold_their_kernels(tmp_path, protocol):
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_EXPORTER_OTLP_PROTOCOL=protocol,
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_SERVICE_NAME="test-sglang",
        )
        proc = run_server(tmp_path, env)
        assert proc.returncode == 0, proc.stderr
        # 3 requests, 2 batches, 3 batch-membership spans, 2 kernels.
        spans = receiver.wait_for(lambda got: len(got) >= 10)
    finally:
        receiver.stop()
    assert len(spans) == 10
    by_id = {s["span_id"]: s for s in spans}
    names = sorted(s["name"] for s in spans)
    assert names.count("sglang.custom_op.rmsnorm") == 2
    assert spans[0]["resource"]["service.name"] == "test-sglang"

    requests = {s["name"]: s for s in spans if s["name"].startswith("Req ")}
    for index, request in enumerate(sorted(requests.values(), key=lambda s: s["name"])):
        # Each request continues its client's trace.
        assert request["trace_id"] == CLIENT_TRACES[index]
        assert request["parent_span_id"] == CLIENT_PARENTS[index]

    decode = next(s for s in spans if s["name"] == "decode_batch")
    assert decode["attributes"]["sglang.batch.size"] == 3
    assert decode["attributes"]["sglang.batch.request_ids"] == ("r0", "r1", "r2")
    assert sorted(decode["links"]) == sorted((r["trace_id"], r["span_id"]) for r in requests.values())
    members = [s for s in spans if s["name"] == "decode_batch.request"]
    assert sorted(m["trace_id"] for m in members) == CLIENT_TRACES
    assert all(m["links"] == [(decode["trace_id"], decode["span_id"])] for m in members)

    kernels = [s for s in spans if s["name"] == "sglang.custom_op.rmsnorm"]
    in_decode = next(k for k in kernels if k["parent_span_id"] == decode["span_id"])
    assert in_decode["attributes"]["sglang.kernel.input.arg0.shape"] == (4,)
    assert in_decode["attributes"]["sglang.kernel.output.dtype"] == "torch.float32"
    # The single-request batch sits inside that request's own trace, kernel included.
    prefill = next(s for s in spans if s["name"] == "prefill_batch")
    in_prefill = next(k for k in kernels if k["parent_span_id"] == prefill["span_id"])
    assert by_id[prefill["parent_span_id"]]["name"] == "Req r0"
    assert in_prefill["trace_id"] == CLIENT_TRACES[0]

    # The trace file and the back end agree on every id.
    recovered = sok.read_trace(tmp_path / "t.sgltrace")
    assert {(s.trace_id, s.span_id, s.parent_span_id) for s in recovered} == {
        (s["trace_id"], s["span_id"], s["parent_span_id"]) for s in spans
    }


def test_sampler_drops_from_otlp_but_the_file_keeps_everything(tmp_path):
    receiver = GrpcReceiver()
    try:
        env = clean_env(
            OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint,
            OTEL_EXPORTER_OTLP_INSECURE="true",
            OTEL_TRACES_SAMPLER="traceidratio",
            OTEL_TRACES_SAMPLER_ARG="0",
        )
        proc = run_server(tmp_path, env)
        assert proc.returncode == 0, proc.stderr
        time.sleep(0.5)
    finally:
        receiver.stop()
    assert receiver.spans == []
    assert len(sok.read_trace(tmp_path / "t.sgltrace")) == 10


def test_dead_endpoint_costs_the_kernels_nothing_and_is_reported_once(tmp_path):
    import socket

    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    script = (
        "import time, torch, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file='t.sgltrace')\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda x: x)\n"
        "x = torch.ones(2)\n"
        "start = time.perf_counter()\n"
        "for _ in range(3000): k(x)\n"
        "print(time.perf_counter() - start)\n"
    )
    env = clean_env(
        SGLANG_KERNEL_API_EXPORT_SIDECAR="0",  # the exporter in this process is what is tested
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{port}",
        OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
        OTEL_EXPORTER_OTLP_TIMEOUT="1",
        OTEL_BSP_MAX_QUEUE_SIZE="256",
        OTEL_BSP_MAX_EXPORT_BATCH_SIZE="64",
        OTEL_BSP_SCHEDULE_DELAY="50",
    )
    proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=180)
    assert proc.returncode == 0, proc.stderr
    assert float(proc.stdout) < 30  # 3000 calls never wait on the network
    # Said once, as it happened first: a full queue (while the first export waits on the dead endpoint) or the
    # failed export (refused at once, then the pause drops the rest unqueued); each cause at most once.
    full, failed = proc.stderr.count("the OTLP export queue is full"), proc.stderr.count("OTLP export failed:")
    assert full <= 1 and failed <= 1 and full + failed >= 1, proc.stderr
    assert "span(s) dropped (full queue, or paused after a failure)" in proc.stderr  # the count, at shutdown
    assert len(sok.read_trace(tmp_path / "t.sgltrace")) == 3000


@pytest.mark.parametrize("sidecar", ["1", "0"])
def test_second_configure_and_fork_export_each_span_once(tmp_path, sidecar):
    receiver = HttpReceiver()
    script = (
        "import os, sys, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file='t_%i.sgltrace')\n"
        "sok.configure(level=1, log_dest='off')  # again: no second exporter\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda who: None)\n"
        "k('parent')\n"
        "pid = os.fork()\n"
        "if pid == 0:\n"
        "    for _ in range(3): k('child')\n"
        "    sys.exit(0)  # a normal exit flushes the child's queue\n"
        "os.waitpid(pid, 0)\n"
        "k('parent')\n"
    )
    try:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_EXPORTER_OTLP_PROTOCOL="http/protobuf",
                        SGLANG_KERNEL_API_EXPORT_SIDECAR=sidecar)
        proc = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=120)
        assert proc.returncode == 0, proc.stderr
        spans = receiver.wait_for(lambda got: len(got) >= 5)
        time.sleep(0.5)
    finally:
        receiver.stop()
    assert len(receiver.spans) == 5
    assert len({s["span_id"] for s in receiver.spans}) == 5
    pids = {s["resource"]["process.pid"] for s in spans}
    assert len(pids) == 2  # the child reports its own pid
    files = sorted(tmp_path.glob("t_*.sgltrace"))
    assert sorted(len(sok.read_trace(f)) for f in files) == [2, 3]


HAND_OVER = """
import sys, torch, sglang_otel_kernels as sok
from opentelemetry import trace
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
sok.configure(level=1, log_dest="off")  # tracing set up first: this package's provider is the global one
step = sok.debug_kernel_api(op_name="sglang.custom_op.step")(lambda x: x + 1)
step(torch.ones(2))  # before the application's provider: the sidecar's (or in-memory) business
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(OTLPSpanExporter(endpoint=sys.argv[1], insecure=True)))
trace.set_tracer_provider(provider)  # then the application installs its own, as SGLang does
assert trace.get_tracer_provider() is provider
with trace.get_tracer("app").start_as_current_span("request"):
    for _ in range(3):
        step(torch.ones(2))
print(sok.trace_file_path())
"""


@pytest.mark.parametrize("sidecar", ["1", "0"])
def test_an_application_provider_installed_after_ours_takes_its_place(tmp_path, sidecar):
    application, ours = GrpcReceiver(), GrpcReceiver()
    try:
        env = clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=ours.endpoint, SGLANG_KERNEL_API_EXPORT_SIDECAR=sidecar,
                        SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"))
        proc = subprocess.run([sys.executable, "-c", HAND_OVER, application.endpoint], cwd=tmp_path, env=env,
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        assert "Overriding of current TracerProvider is not allowed" not in proc.stderr
        own = application.wait_for(lambda got: len(got) >= 1)
        time.sleep(2.0)  # the sidecar's last poll, and nothing twice
        own, by_us = application.spans, ours.spans
    finally:
        application.stop()
        ours.stop()
    names = lambda spans: sorted(s["name"] for s in spans)  # noqa: E731
    # The application exports its own span; the kernel calls inside it go, once each, to the
    # application's exporter, or (a sidecar already following the file) to the sidecar.
    if sidecar == "1":
        assert names(own) == ["request"]
        assert names(by_us) == ["sglang.custom_op.step"] * 4
    else:
        assert names(own) == ["request"] + ["sglang.custom_op.step"] * 3
        assert names(by_us) == ["sglang.custom_op.step"]  # the call before the hand-over, by our exporter
    [request] = [s for s in own if s["name"] == "request"]
    inside = [s for s in own + by_us if s["parent_span_id"] == request["span_id"]]
    assert len(inside) == 3
    spans = sok.read_trace(proc.stdout.strip().splitlines()[-1])
    assert names([{"name": s.name} for s in spans]) == ["request"] + ["sglang.custom_op.step"] * 4
