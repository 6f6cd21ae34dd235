"""The SDK internals the recorder relies on, checked one by one: if an SDK
release moves one, this fails with its name, not a silent loss of records."""

from opentelemetry.attributes import BoundedAttributes
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.util import BoundedList
from opentelemetry.trace import Link, SpanKind

from sglang_otel_kernels.record.processor import TraceFileProcessor


def test_span_fields_read_by_the_trace_file_processor():
    provider = TracerProvider()
    tracer = provider.get_tracer("t", "1")
    with tracer.start_as_current_span("parent") as parent:
        span = tracer.start_span("s", attributes={"a": 1}, links=[Link(parent.get_span_context(), {"l": 1})])
        span.add_event("e", {"x": 1})
        span.end()
    assert span._context is span.get_span_context()
    assert span._parent == parent.get_span_context()
    assert type(span._attributes) is BoundedAttributes and span._attributes._dict == {"a": 1}
    assert isinstance(span._events, BoundedList) and [e.name for e in span._events._dq] == ["e"]
    assert isinstance(span._links, BoundedList) and len(span._links._dq) == 1
    assert (span._name, span._kind._value_) == ("s", SpanKind.INTERNAL.value)
    assert span._start_time <= span._end_time
    assert span._instrumentation_scope.name == "t"
    assert span._status._status_code._value_ == 0 and span._status._description is None
    assert tuple(span._context)[1] == span._context.span_id and tuple(span._parent)[2] is False


def test_provider_fields_used_to_hand_kernel_spans_to_its_processors():
    provider = TracerProvider()
    provider.add_span_processor(TraceFileProcessor())
    processors = provider._active_span_processor
    assert isinstance(processors._span_processors, tuple)
    assert [type(p) for p in processors._span_processors] == [TraceFileProcessor]
    before = processors._span_processors
    provider.add_span_processor(TraceFileProcessor())
    assert processors._span_processors is not before  # a new tuple: a change is seen by identity
    processors.on_end(ReadableSpan("x"))  # and it takes a finished span


def test_span_context_is_the_tuple_the_kernel_path_unpacks():
    from opentelemetry.trace import SpanContext, TraceFlags

    context = SpanContext(7, 9, True, TraceFlags(1))
    trace_id, span_id, remote, flags, _, valid = context
    assert (trace_id, span_id, remote, flags, valid) == (7, 9, True, 1, True)
    assert tuple(SpanContext(0, 0, False))[5] is False


def test_the_global_provider_guard_a_hand_over_resets():
    from opentelemetry import trace

    assert type(trace._TRACER_PROVIDER_SET_ONCE).__name__ == "Once"
    assert hasattr(trace._TRACER_PROVIDER_SET_ONCE, "do_once") and hasattr(trace, "_TRACER_PROVIDER")
    fresh = type(trace._TRACER_PROVIDER_SET_ONCE)()
    ran = []
    assert fresh.do_once(lambda: ran.append(1)) and ran == [1]


def test_a_file_resource_hashes_and_compares_as_the_sdks_resource():
    from opentelemetry.sdk.resources import Resource

    from sglang_otel_kernels.recover.replay import FileResource

    attributes = {"service.name": "s", "process.pid": 7}
    assert hash(FileResource(attributes)) == hash(Resource(attributes))
    assert FileResource(attributes) == Resource(attributes) and FileResource(attributes) != Resource({"a": 1})
    assert FileResource(attributes).attributes == attributes


def test_the_grpc_exporter_still_encodes_through_the_hook_our_encoder_overrides():
    import inspect

    from opentelemetry.exporter.otlp.proto.grpc.exporter import OTLPExporterMixin
    from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter

    from sglang_otel_kernels.record.otlp_encode import DirectGrpcExporter

    assert "_translate_data" in vars(OTLPSpanExporter)
    assert DirectGrpcExporter._translate_data is not OTLPSpanExporter._translate_data
    assert "self._translate_data(" in inspect.getsource(OTLPExporterMixin._export)
