"""Batch spans written straight into the trace file (record/file_spans.py),
where the provider feeds nothing but the file: the same records as through
the SDK's span, which the same batches produce where the provider has an
exporter too."""

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_ON

import sglang_otel_kernels as sok
from sglang_otel_kernels.record.file_spans import FileSpan, file_only
from sglang_otel_kernels.schema import SEQ

REQUEST_A = "00-" + "1" * 32 + "-" + "2" * 16 + "-01"
REQUEST_B = "00-" + "3" * 32 + "-" + "4" * 16 + "-01"


def batches(kernel):
    """Batches as an engine runs them: yields each batch span it was given."""
    with sok.forward_batch([(REQUEST_A, "a")], name="one", batch_key=(1, ("a",))) as span:  # the request's child
        kernel()
    yield span
    with sok.forward_batch([(REQUEST_A, "a"), (REQUEST_B, "b"), (None, "c")], name="several",
                           attributes={"sglang.forward_mode": "decode"}, batch_key=(2, ("a", "b", "c"))) as span:
        kernel()
        span.set_attribute("user.list", [1, 2])
        span.set_attribute("user.bad", {"not": "allowed"})  # dropped, with the SDK's warning
        span.add_event("user.event", {"n": 1})
    yield span
    with sok.forward_batch([(None, "c")], name="keyed", batch_key=(3, ("c",))) as span:  # a root, its id the key's
        kernel()
    yield span
    with trace.get_tracer("engine").start_as_current_span("loop"):
        with sok.forward_batch([(None, "c")], name="inside", batch_key=(4, ("c",))) as span:  # the current span's child
            kernel()
    yield span
    with pytest.raises(IndexError):
        with sok.forward_batch([(REQUEST_A, "a"), (REQUEST_B, "b")], name="failed", batch_key=(5, ("a", "b"))) as span:
            kernel()
            raise IndexError("index out of range in self")
    yield span
    with pytest.raises(ValueError):  # one request: a batch the compiled core opens, ended with an event
        with sok.forward_batch([(None, "d")], name="failed alone", batch_key=(6, ("d",))) as span:
            kernel()
            span.add_event("user.event", {"n": 2})
            raise ValueError("bad row")
    yield span


def recorded(path, provider) -> tuple[list, list]:
    """The spans the batches leave in a trace file, as comparable tuples, and the batch spans given."""
    sok.configure(level=1, log_dest="off", trace_file=str(path), tracer_provider=provider)
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    given = list(batches(kernel))
    sok.configure(level=0)
    spans = sok.read_trace(path)
    names = {span.span_id: span.name for span in spans}
    shown = []
    for span in spans:
        shown.append((span.name, names.get(span.parent_span_id, span.parent_span_id), span.kind, span.status_code,
                      span.status_description, {k: v for k, v in span.attributes.items() if k != SEQ},
                      [(name, {k: v for k, v in attributes.items() if k != "exception.stacktrace"})
                       for name, _, attributes in span.events],
                      [(f"{trace_id:032x}", names.get(span_id, span_id), attributes)
                       for trace_id, span_id, attributes in span.links],
                      span.trace_flags, span.parent_is_remote, span.scope_name, span.in_flight))
    keyed = [span.trace_id for span in spans if span.name == "keyed"]
    return sorted(shown, key=repr) + [keyed], given


def test_a_file_only_provider_writes_what_the_sdk_would(tmp_path):
    alone = TracerProvider(sampler=ALWAYS_ON)
    fed = TracerProvider(sampler=ALWAYS_ON)
    exporter = InMemorySpanExporter()
    fed.add_span_processor(SimpleSpanProcessor(exporter))
    trace.set_tracer_provider(alone)  # the engine's own span ("loop") comes from it in both runs
    straight, given_straight = recorded(tmp_path / "alone.sgltrace", alone)
    through_sdk, given_sdk = recorded(tmp_path / "fed.sgltrace", fed)
    assert all(isinstance(span, FileSpan) for span in given_straight)
    assert not any(isinstance(span, FileSpan) for span in given_sdk)
    assert straight == through_sdk
    assert {span.name for span in exporter.get_finished_spans()} >= {"one", "several", "failed", "k"}
    failed = next(row for row in straight[:-1] if row[0] == "failed")
    assert failed[3] == "ERROR" and failed[6][0][1]["exception.type"] == "IndexError"
    alone = next(row for row in straight[:-1] if row[0] == "failed alone")
    assert alone[3] == "ERROR" and [name for name, _ in alone[6]] == ["user.event", "exception"]
    assert alone[5]["sglang.batch.kernel_calls"] == 1


def test_a_provider_with_more_to_feed_takes_the_sdk_path():
    plain = TracerProvider(sampler=ALWAYS_ON)
    tracer = plain.get_tracer("t")
    assert not file_only(tracer)  # no trace file processor on it
    from sglang_otel_kernels.record.processor import TraceFileProcessor

    plain.add_span_processor(TraceFileProcessor())
    assert file_only(tracer)
    plain.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    assert not file_only(tracer)
    sampled = TracerProvider()  # the SDK's default sampler: parent-based
    sampled.add_span_processor(TraceFileProcessor())
    assert not file_only(sampled.get_tracer("t"))


def test_a_batch_ended_later_is_in_flight_until_its_caller_ends_it(tmp_path):
    """forward_batch(end_later=True): a batch that ran stays open (a death now
    died serving it) until the caller ends it; one that raised ends at once."""
    path = tmp_path / "t.sgltrace"
    sok.configure(level=1, log_dest="off", trace_file=str(path), tracer_provider=TracerProvider(sampler=ALWAYS_ON))
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    with sok.forward_batch([(None, "r1")], name="open", end_later=True) as span:
        kernel()
    with pytest.raises(IndexError):
        with sok.forward_batch([(None, "r2")], name="raised", end_later=True):
            raise IndexError("index out of range in self")
    spans = {s.name: s for s in sok.read_trace(path)}
    assert spans["open"].in_flight and not spans["raised"].in_flight
    assert spans["raised"].status_code == "ERROR"
    span.end(end_time=spans["open"].start_time + 5_000)
    span.end()  # once
    sok.configure(level=0)
    spans = {s.name: s for s in sok.read_trace(path)}
    assert not spans["open"].in_flight and spans["open"].attributes["sglang.batch.kernel_calls"] == 1
    assert spans["open"].end_time == spans["open"].start_time + 5_000
    assert spans["k"].parent_span_id == spans["open"].span_id
    assert not span.is_recording()


def test_consecutive_batches_name_their_own_requests(tmp_path):
    """A batch of the requests the last one ran reuses what was made for it
    (every decode step); one of other requests, rows or traces does not."""
    path = tmp_path / "t.sgltrace"
    sok.configure(level=1, log_dest="off", trace_file=str(path), tracer_provider=TracerProvider(sampler=ALWAYS_ON))
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    steps = [([(None, "a")], [1]), ([(None, "a")], [1]), ([(None, "a"), (None, "b")], [3, 1]),
             ([(None, "a"), (None, "b")], [1, 1]), ([(REQUEST_A, "a"), (None, "b")], [1, 1]), ([(None, "c")], None)]
    for step, (requests, rows) in enumerate(steps):
        with sok.forward_batch(requests, name=f"step{step}", batch_key=(step, tuple(r for _, r in requests)),
                               rows=rows) as span:
            kernel()
            kernel()
            if step == 1:
                span.set_attribute("user.note", "second")
    sok.configure(level=0)
    spans = {span.name: span for span in sok.read_trace(path)}
    for step, (requests, _) in enumerate(steps):
        attributes = spans[f"step{step}"].attributes
        assert list(attributes["sglang.batch.request_ids"]) == [r for _, r in requests]
        assert attributes["sglang.batch.size"] == len(requests)
        assert attributes["sglang.batch.kernel_calls"] == 2
        assert attributes.get("sglang.batch.untraced_requests", 0) == sum(c is None for c, _ in requests)
        assert ("user.note" in attributes) == (step == 1)
    assert [link[2] for link in spans["step4"].links] == [{"sglang.request.id": "a"}]
    assert spans["step4.request"].trace_id == int("1" * 32, 16)  # a request span in the traced request's trace
    # Each step its own trace: a step's trace id comes from its key, the same key gives the same one.
    roots = [spans[f"step{step}"].trace_id for step in (0, 1, 2, 3, 5)]
    assert len(set(roots)) == len(roots)


def test_a_step_keyed_trace_id_is_the_key_s_on_every_rank():
    """A key of a step number and the requests: the same id wherever it is
    made (each rank makes its own), another for another step or requests."""
    from sglang_otel_kernels.capture import requests

    ids = {step: requests._keyed_trace_id((step, ("a", "b"))) for step in range(1000)}
    assert len(set(ids.values())) == 1000 and all(0 < value < 1 << 128 for value in ids.values())
    requests._keyed_trace_id((7, ("c",)))  # another batch in between
    assert requests._keyed_trace_id((3, ("a", "b"))) == ids[3]
    assert requests._keyed_trace_id((3, ("a",))) != ids[3]
    # Not a step and the rest: hashed whole, as any other key.
    assert requests._keyed_trace_id("batch 3") == requests._keyed_trace_id("batch 3") != ids[3]


def test_a_batch_repeated_into_a_new_file_is_named_with_that_file_s_names(tmp_path):
    """What a batch span's start encodes to is kept for the next step's, per
    file: a step written into a new file, whose name table numbers names in
    another order, names itself and its scope with that file's numbers."""
    provider = TracerProvider(sampler=ALWAYS_ON)
    paths = [tmp_path / "first.sgltrace", tmp_path / "second.sgltrace"]
    for index, path in enumerate(paths):
        sok.configure(level=1, log_dest="off", trace_file=str(path), tracer_provider=provider)
        kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
        if index:  # another name first: each number stands for another name than in the first file
            sok.debug_kernel_api(op_name="first.in.the.second.file")(lambda: None)()
        for step in range(3):
            with sok.forward_batch([(None, "a")], name="step", batch_key=(step, ("a",))):
                kernel()
    sok.configure(level=0)
    for path in paths:
        spans = [span for span in sok.read_trace(path) if span.name != "first.in.the.second.file"]
        assert sorted(span.name for span in spans) == ["k"] * 3 + ["step"] * 3, path
        steps = [span for span in spans if span.name == "step"]
        assert all(list(span.attributes["sglang.batch.request_ids"]) == ["a"] for span in steps)
        assert {span.scope_name for span in steps} == {"sglang_otel_kernels"}
