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

    from sglang_otel_kernels.recover.resend import FileResource

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


def test_this_sdk_takes_the_private_field_fast_paths():
    from sglang_otel_kernels.record import processor

    assert processor.private_fields_present()


def _record_spans(tmp_path, name: str, private: bool) -> list:
    """Application spans of every shape on_start and on_end see, recorded by
    a processor that reads private fields or the public API."""
    from opentelemetry.trace import Status, StatusCode

    import sglang_otel_kernels as sok
    from sglang_otel_kernels.record import processor, tracefile

    path = str(tmp_path / name)
    processor.set_writer(tracefile.TraceFileWriter(path, capacity=1 << 20))
    provider = TracerProvider()
    provider.add_span_processor(TraceFileProcessor(private=private))
    tracer = provider.get_tracer("server", "2")
    try:
        with tracer.start_as_current_span("request", kind=SpanKind.SERVER, attributes={"rid": "r1"}) as request:
            batch = tracer.start_span("batch", links=[Link(request.get_span_context(), {"rid": "r1"})])
            batch.set_attribute("size", 4)  # changed after its start: a full end record
            batch.add_event("scheduled", {"step": 1})
            batch.end()
            quiet = tracer.start_span("quiet", attributes={"n": 1})  # unchanged: a compact end record
            quiet.set_status(Status(StatusCode.ERROR, "it failed"))
            quiet.end()
            tracer.start_span("never ended").__enter__()
    finally:
        processor.set_writer(None)
    return [(s.name, s.kind, s.attributes, [(t, a) for _, _, a in s.links for t in [s.trace_id == _]],
             [(e[0], e[2]) for e in s.events], s.status_code, s.status_description, s.in_flight,
             s.scope_name, s.scope_version, s.parent_span_id != 0) for s in sok.read_trace(path)]


def test_the_public_api_records_what_the_private_fields_record(tmp_path):
    public = _record_spans(tmp_path, "public.sgltrace", private=False)
    assert public == _record_spans(tmp_path, "private.sgltrace", private=True)
    assert [span[0] for span in public] == ["request", "batch", "quiet", "never ended"]
    assert public[1][2] == {"size": 4} and public[1][4] == [("scheduled", {"step": 1})] and public[1][3]
    assert public[2][5:7] == ("ERROR", "it failed") and public[3][7]


class _ProcessorsElsewhere:
    """The processor list of an SDK that does not keep it where ours is read."""

    def __init__(self, inner) -> None:
        self._inner = inner

    def __getattr__(self, name: str):
        if name == "_span_processors":
            raise AttributeError(name)
        return getattr(self._inner, name)


def test_without_the_sdks_processor_list_kernel_spans_reach_its_exporters_and_the_file_once(provider, tmp_path):
    import torch

    import sglang_otel_kernels as sok

    provider._active_span_processor = _ProcessorsElsewhere(provider._active_span_processor)
    path = tmp_path / "t.sgltrace"
    sok.configure(level=3, log_dest="off", spans=True, tracer_provider=provider, trace_file=str(path))
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x + 1)
    with provider.get_tracer("server").start_as_current_span("request") as request:
        kernel(torch.ones(2))
    exported = {span.name: span for span in provider.exporter.get_finished_spans()}
    assert set(exported) == {"request", "k"}
    assert exported["k"].parent.span_id == request.get_span_context().span_id
    assert exported["k"].attributes["sglang.kernel.input.arg0.shape"] == (2,)
    sok.configure(trace_file="off")
    assert sorted(span.name for span in sok.read_trace(path)) == ["k", "request"]


def test_a_tracer_makes_its_spans_with_the_resource_it_keeps():
    """record/setup.py: carry_process gives our tracer of an application's
    provider another resource than the provider's."""
    from opentelemetry.sdk.resources import Resource

    provider = TracerProvider(resource=Resource({"service.name": "app"}))
    tracer = provider.get_tracer("t", "1")
    assert tracer.resource is provider.resource
    tracer.resource = Resource({"service.name": "app", "process.pid": 7})
    span = tracer.start_span("s")
    span.end()
    assert span.resource.attributes["process.pid"] == 7 and "process.pid" not in provider.resource.attributes
