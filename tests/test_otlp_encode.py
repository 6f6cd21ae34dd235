"""The sidecar's own OTLP encoding gives the message the SDK's encoder gives,
field for field, for every kind of span and attribute the files hold."""

import math

from opentelemetry.exporter.otlp.proto.common._internal.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import Event, ReadableSpan
from opentelemetry.sdk.util.instrumentation import InstrumentationScope
from opentelemetry.trace import Link, SpanContext, SpanKind, Status, StatusCode, TraceFlags

from sglang_otel_kernels.record.otlp_encode import DirectGrpcExporter, encode_request

TRACE = 0x0AF7651916CD43DD8448EB211C80319C


def spans():
    resource = Resource({"service.name": "sérvice", "process.pid": 4242, "ranks": (0, 1)})
    other = Resource({"service.name": "other"}, "https://schema.example/1")
    kernels = InstrumentationScope("sglang_otel_kernels", "0.1.0")
    app = InstrumentationScope("app", None, "https://schema.example/scope")
    attributes = {
        "sglang.kernel.name": "sglang.custom_op.rmsnorm", "sglang.kernel.level": 5, "sglang.kernel.seq": 2**62,
        "negative": -3, "flag": True, "off": False, "ratio": 0.25, "huge": 1e308, "not a number": math.nan,
        "sglang.kernel.input.arg0.shape": (4, 4096), "empty": (), "names": ("a", "ü"), "bools": (True, False),
        "floats": (1.5, -0.0), "nested": {"inner": 1, "deeper": {"x": "y"}}, "texts ✓": "ünïcode ✓",
    }
    remote = SpanContext(TRACE, 0x1111, is_remote=True, trace_flags=TraceFlags(1))
    local = SpanContext(TRACE, 0x2222, is_remote=False, trace_flags=TraceFlags(0))
    made = []
    for index, (parent, kind, status, scope, owner) in enumerate([
        (None, SpanKind.INTERNAL, Status(StatusCode.UNSET), kernels, resource),
        (remote, SpanKind.SERVER, Status(StatusCode.ERROR, "IndexError: index out of range"), app, resource),
        (local, SpanKind.CLIENT, Status(StatusCode.OK), kernels, resource),
        (local, SpanKind.PRODUCER, Status(StatusCode.ERROR), None, other),
        (remote, SpanKind.CONSUMER, Status(StatusCode.UNSET), kernels, other),
    ]):
        made.append(ReadableSpan(
            name=f"span {index} ✓",
            context=SpanContext(TRACE, 0xABCDEF00 + index, is_remote=False, trace_flags=TraceFlags(1)),
            parent=parent, resource=owner, attributes=attributes if index % 2 == 0 else {"k": index},
            events=[Event("exception", {"exception.type": "IndexError", "exception.escaped": "True"}, 1_000 + index),
                    Event("nonfinite_output", {"sglang.kernel.nonfinite_inputs": ("output",)}, 2_000)][: index % 3],
            links=[Link(remote, {"sglang.link": "request"}), Link(local)][: index % 3],
            kind=kind, status=status, start_time=1_700_000_000_000_000_000 + index,
            end_time=1_700_000_000_000_100_000 + index, instrumentation_scope=scope))
    return made


def sdk_encoding(batch) -> ExportTraceServiceRequest:
    """The SDK's encoding of `batch`, with the scope schema URLs OpenTelemetry
    before 1.31 left out (the proto has the field; ours fills it)."""
    request = encode_spans(batch)
    for resource in request.resource_spans:
        for scope in resource.scope_spans:
            if scope.scope.name == "app":
                scope.schema_url = "https://schema.example/scope"
    return request


def test_the_request_is_the_one_the_sdk_encodes():
    batch = spans()
    ours = ExportTraceServiceRequest.FromString(encode_request(batch))
    assert ours == sdk_encoding(batch)
    assert len(ours.resource_spans) == 2 and [len(r.scope_spans) for r in ours.resource_spans] == [2, 2]
    # The cached encodings of repeated attributes give the same bytes the second time.
    assert encode_request(batch) == encode_request(spans())


def test_what_the_encoder_does_not_expect_goes_through_the_sdks_encoder():
    batch = spans()
    span = batch[0]
    odd = ReadableSpan(name="bytes", context=span.context, resource=span.resource, attributes={"raw": b"\x00\x01"},
                       start_time=1, end_time=2, instrumentation_scope=span.instrumentation_scope)
    exporter = DirectGrpcExporter(endpoint="http://127.0.0.1:9", insecure=True, timeout=1)
    try:
        assert ExportTraceServiceRequest.FromString(exporter._translate_data([odd])) == encode_spans([odd])
        # That span alone: the others of its batch are still encoded here, in the same request.
        mixed = [*batch, odd]
        assert ExportTraceServiceRequest.FromString(exporter._translate_data(mixed)) == sdk_encoding(mixed)
        # The request goes out as written: the client serializes bytes as they are.
        assert type(exporter._client).__name__ == "_WireStub"
    finally:
        exporter.shutdown()


def test_spans_an_sdk_provider_made_encode_as_the_sdk_encodes_them():
    # In-process export hands the exporter the provider's own spans (BoundedAttributes, event and link lists).
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    exported = InMemorySpanExporter()
    provider = TracerProvider(resource=Resource({"service.name": "app"}))
    provider.add_span_processor(SimpleSpanProcessor(exported))
    tracer = provider.get_tracer("app", "1.0")
    with tracer.start_as_current_span("POST /generate", kind=SpanKind.SERVER, attributes={"http.status": 500}) as root:
        link = Link(root.get_span_context(), {"request": "req-1"})
        with tracer.start_as_current_span("decode_batch", links=[link]) as batch:
            batch.set_attribute("batch.size", 4)
            batch.set_attribute("batch.requests", ("req-1", "req-2"))
            batch.add_event("scheduled", {"queue": 3})
            batch.record_exception(IndexError("index out of range"))
            batch.set_status(Status(StatusCode.ERROR, "IndexError"))
    finished = exported.get_finished_spans()
    assert ExportTraceServiceRequest.FromString(encode_request(finished)) == encode_spans(finished)


def test_values_that_compare_equal_keep_their_own_encoding():
    """The encoder keeps repeated attributes' encodings: never one value's
    for another that compares equal to it (1, True and 1.0; -0.0 and 0.0;
    shapes of ints and of floats)."""
    span = spans()[0]
    values = [1, True, 1.0, (1, 2), (True, 2), (1.0, 2.0), ("1", 2), 0.0, -0.0, (0.0,), (-0.0,), 1, (1, 2)]
    batch = [ReadableSpan(name="kernel", context=span.context, resource=span.resource, attributes={"value": value},
                          start_time=1, end_time=2, instrumentation_scope=span.instrumentation_scope)
             for value in values]
    for _ in range(2):  # the second time from the kept encodings; as bytes, since -0.0 == 0.0
        ours = ExportTraceServiceRequest.FromString(encode_request(batch))
        assert ours.SerializeToString(deterministic=True) == encode_spans(batch).SerializeToString(deterministic=True)
