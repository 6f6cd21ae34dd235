"""The sidecar's straight path for plain kernel calls (live/wire.py): the
bytes it sends are the bytes the general path (reader -> ReadableSpan ->
encoder) gives for the same call, and every call that is not plain is left
to the general path."""

import random
import struct

import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

from conftest import run_python
from sglang_otel_kernels.record import otlp_encode
from sglang_otel_kernels.record.export import ExportSampler
from sglang_otel_kernels.record.otlp_encode import EncodedSpan, _span, encode_request
from sglang_otel_kernels.record import reader
from sglang_otel_kernels.live import wire as wire_path
from sglang_otel_kernels.recover.otlp_json import resource_attributes
from sglang_otel_kernels.recover.resend import FileResource, readable
from sglang_otel_kernels.live.wire import KernelWire

APP = r"""
import threading, torch, sglang_otel_kernels as sok
from opentelemetry import context, trace
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags

rms = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x * w)
fill = sok.debug_kernel_api(op_name="sglang.custom_op.fill")(lambda x: None)  # no outputs: a COMPACT_END


@sok.debug_kernel_api(op_name="sglang.custom_op.outer")
def outer(x, w):
    return rms(x, w)  # nested: its parent is a kernel call


@sok.debug_kernel_api(op_name="sglang.custom_op.boom")
def boom(x):
    raise IndexError("index 9 is out of bounds")


x, w = torch.randn(2, 4), torch.ones(4)
for _ in range(3):
    rms(x, w, eps=1e-5)
fill(x)
outer(x, w)
try:
    boom(x)
except IndexError:
    pass
worker = threading.Thread(target=rms, args=(x, w), name="worker")
worker.start()
worker.join()
with trace.get_tracer("app").start_as_current_span("batch"):
    rms(x, w)
for sampled in (1, 0):  # a client's traceparent, sampled and not
    remote = SpanContext(0xABC, 0xDEF, is_remote=True, trace_flags=TraceFlags(sampled))
    token = context.attach(trace.set_span_in_context(NonRecordingSpan(remote)))
    rms(x, w)
    context.detach(token)
sok.configure(level=5)
stats = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x, w, eps=1e-6: x * w)
stats(torch.full((2, 4), float("nan")), w)  # statistics after the start, NaN flags: not plain
stats(x, w)
print(sok.trace_file_path())
"""


def _file(tmp_path) -> str:
    proc = run_python(APP, tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "3", "SGLANG_KERNEL_API_LOGDEST": "off",
                                      "SGLANG_KERNEL_API_TRACEFILE": str(tmp_path / "trace_%i.sgltrace")})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()[-1]


try:  # the compiled core as built, whichever core records here (SGLANG_KERNEL_API_NATIVE)
    from sglang_otel_kernels import _native as native
except ImportError:
    native = None
# The compiled core's encoder of a plain call and its Python twin (None where the core is not built: a failure).
ENCODERS = {"compiled": getattr(native, "counter_span", None), "python": otlp_encode.python_counter_span}


@pytest.mark.parametrize("core", sorted(ENCODERS))
def test_plain_kernel_calls_go_straight_to_the_wire_as_the_general_path_encodes_them(tmp_path, monkeypatch, core):
    assert ENCODERS[core] is not None, "the compiled core is not built"
    monkeypatch.setattr(wire_path, "counter_span", ENCODERS[core])
    path = _file(tmp_path)
    data = reader.map_trace_file(path)
    metadata, base, end, _ = reader.read_header(path, data)
    entries, _ = reader.scan(data, base, end)
    resource = FileResource(resource_attributes(metadata))
    assembler = reader.Assembler()
    taken: list = []
    counted: list = []

    class Metrics:  # what the sidecar's metrics are told
        def call(self, name, failed, nonfinite):
            counted.append((name, failed, nonfinite))

    wire = KernelWire(assembler, resource, ExportSampler({"OTEL_TRACES_SAMPLER": "parentbased_always_on"}),
                      lambda span, span_id: taken.append((span, span_id)), Metrics())
    straight, general = [], []
    for _, _, record in entries:
        pair = assembler.add(record)
        if pair is None:
            continue
        before = len(taken)
        took = wire.take(*pair)
        span = assembler.span(*pair)
        if not took:
            general.append(span)
            continue
        if len(taken) == before:  # sampled out, as the sampler says of the general path's span
            assert not ExportSampler({}).keep(readable(span, resource, 0))
            straight.append((span, None))
            continue
        encoded, span_id = taken[-1]
        assert isinstance(encoded, EncodedSpan) and span_id == span.span_id
        assert encoded.encoded == _span(readable(span, resource, 0)), span.name
        straight.append((span, encoded))
    data.close()
    names = [span.name for span, _ in straight]
    # The 3 calls, the nested one, the worker's, the one in a batch, both under a traceparent; the call with no
    # outputs (a COMPACT_END), the outer call.
    assert names.count("sglang.custom_op.rmsnorm") == 8 and names.count("sglang.custom_op.fill") == 1
    assert names.count("sglang.custom_op.outer") == 1 and len(names) == 10
    assert [span.name for span, encoded in straight if encoded is None] == ["sglang.custom_op.rmsnorm"]  # not sampled
    assert {span.thread_name for span, _ in straight} == {"MainThread", "worker"}
    assert sorted(counted) == sorted((name, False, False) for name in names)  # the call sampled out too
    assert any(span.parent_is_remote for span, encoded in straight if encoded is not None)
    assert sum(1 for span, _ in straight if span.parent_span_id) == 4  # nested, in the batch, two remote
    # Left to the general path: the application's span, the error, the calls at level 5.
    left = sorted(span.name for span in general)
    assert left == ["batch", "sglang.custom_op.boom", "sglang.custom_op.rmsnorm", "sglang.custom_op.rmsnorm"], left
    assert [span for span in general if span.name == "sglang.custom_op.rmsnorm"][0].attributes.get(
        "sglang.kernel.output.has_nan") is True
    # A request of both kinds of span is the one the general path makes.
    mixed = [encoded for _, encoded in straight if encoded is not None] + [readable(s, resource, 0) for s in general]
    ordinary = [readable(span, resource, 0) for span, encoded in straight if encoded is not None] + mixed[-len(general):]
    assert ExportTraceServiceRequest.FromString(encode_request(mixed)) == \
        ExportTraceServiceRequest.FromString(encode_request(ordinary))


def test_the_compiled_encoder_of_a_plain_call_gives_its_python_twins_bytes_at_every_edge():
    """Ids at their limits, no parent, call numbers of every varint length
    (negative: int64's two's complement; beyond 64 bits: masked), keys and
    tails whose lengths take 1 to 3 length bytes; and the same refusal of
    ids out of range."""
    assert native is not None, "the compiled core is not built"
    rng = random.Random(7)
    keys = [otlp_encode.counter_key("sglang.kernel.seq"), otlp_encode.counter_key("k" * 300)]
    for trace_id in (1, (1 << 128) - 1, 0xABC, rng.getrandbits(128)):
        for parent in (0, 1, (1 << 64) - 1):
            for counter in (0, 1, 127, 128, 16383, 16384, (1 << 63) - 1, -1, -(1 << 63), 1 << 70):
                for tail in (b"", b"t" * 200, b"u" * 20000):
                    for key in keys:
                        args = (trace_id, rng.getrandbits(64), parent, otlp_encode.name_and_kind("sglang.op", 0),
                                rng.getrandbits(64), (1 << 64) - 1, b"h" * 5, key, counter, tail)
                        assert native.counter_span(*args) == otlp_encode.python_counter_span(*args), args
    for trace_id, span_id in ((-1, 1), (1 << 128, 1), (1, -1), (1, 1 << 64)):
        for encoder in ENCODERS.values():
            with pytest.raises((OverflowError, struct.error)):
                encoder(trace_id, span_id, 0, b"", 1, 2, b"", keys[0], 1, b"")
