"""One span per call: name, kind, nesting, status, and the attribute schema."""

import traceback

import pytest
import torch
from opentelemetry import trace
from opentelemetry.trace import SpanKind, StatusCode

import sglang_otel_kernels as sok

K = "sglang.kernel."


def only_span(exporter):
    spans = exporter.get_finished_spans()
    assert len(spans) == 1, [s.name for s in spans]
    return spans[0]


def test_level1_span_identity(record):
    exporter = record(level=1)

    @sok.debug_kernel_api
    def fused_add_rmsnorm(x):
        return x

    fused_add_rmsnorm(torch.ones(2))
    fused_add_rmsnorm(torch.ones(2))
    first, second = exporter.get_finished_spans()
    assert first.name == "test_spans.test_level1_span_identity.fused_add_rmsnorm"
    assert first.kind is SpanKind.INTERNAL
    assert first.instrumentation_scope.name == "sglang_otel_kernels"
    assert first.status.status_code is StatusCode.UNSET
    assert dict(first.attributes) == {
        K + "name": first.name,
        K + "level": 1,
        K + "seq": first.attributes[K + "seq"],
    }
    assert second.attributes[K + "seq"] == first.attributes[K + "seq"] + 1


def test_level3_tensor_and_value_attributes(record):
    exporter = record(level=3)

    class Layer:
        @sok.debug_kernel_api(op_name="sglang.quant_method.Fp8LinearMethod.apply")
        def apply(self, x, weights, *, bias=None, eps=1e-5, mode="decode", opts=None):
            return x.t(), 3

    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    weights = [torch.ones(8, 2).t(), torch.ones(1).expand(5)]
    Layer().apply(x, weights, eps=1e-6, opts={"k": 2, 7: None})
    span = only_span(exporter)
    a = span.attributes
    assert span.name == "sglang.quant_method.Fp8LinearMethod.apply"
    assert a[K + "input.arg0.shape"] == (4, 8)
    assert a[K + "input.arg0.dtype"] == "torch.bfloat16"
    assert a[K + "input.arg0.device"] == "cpu"
    assert a[K + "input.arg0.stride"] == (8, 1)
    assert a[K + "input.arg0.contiguous"] is True
    assert a[K + "input.arg0.requires_grad"] is False
    assert a[K + "input.arg1"] == "list[2]"
    assert a[K + "input.arg1.0.shape"] == (2, 8)
    assert a[K + "input.arg1.0.stride"] == (1, 2)
    assert a[K + "input.arg1.0.contiguous"] is False
    assert a[K + "input.arg1.1.stride"] == (0,)
    assert a[K + "input.eps"] == 1e-6
    assert a[K + "input.opts"] == "dict[2]"
    assert a[K + "input.opts.k"] == 2
    assert a[K + "input.opts.7"] == "None"
    # Only what was passed: defaults are not arguments of the call.
    assert K + "input.bias" not in a and K + "input.mode" not in a
    # self is skipped and not counted.
    assert not any(key.startswith(K + "input.arg2") for key in a)
    assert a[K + "output"] == "tuple[2]"
    assert a[K + "output.0.shape"] == (8, 4)
    assert a[K + "output.0.contiguous"] is False
    assert a[K + "output.1"] == 3
    assert not any(key.endswith((".min", ".has_nan")) for key in a)


def test_depth_item_limits_and_long_values(record):
    exporter = record(level=3)
    kernel = sok.debug_kernel_api(op_name="k")(lambda *args: None)
    kernel(list(range(10)), [[torch.ones(1)]], "s" * 500, 2**70, object())
    a = only_span(exporter).attributes
    assert a[K + "input.arg0"] == "list[10]"
    assert [a[K + f"input.arg0.{i}"] for i in range(4)] == [0, 1, 2, 3]
    assert K + "input.arg0.4" not in a
    assert a[K + "input.arg1.0"] == "list[1]"
    assert a[K + "input.arg1.0.0"] == "Tensor(...)"
    assert a[K + "input.arg2"] == "s" * 200
    assert a[K + "input.arg3"] == str(2**70)
    assert a[K + "input.arg4"] == "object"  # its type: a span never formats an object


def test_objects_are_recorded_by_what_identifies_them_never_by_their_repr(record, tmp_path):
    """SGLang's ForwardBatch and layers: their mode, size and sizes, read from
    their own attributes; an object whose repr, attributes or properties are
    dear or raise costs a span nothing; SGLang's text log keeps the repr."""
    import dataclasses
    import enum

    class ForwardMode(enum.IntEnum):
        DECODE = 2

    class Color(enum.Enum):
        RED = "r"

    reprs = []  # how many times a ForwardBatch was formatted

    @dataclasses.dataclass(repr=False)
    class ForwardBatch:
        forward_mode: ForwardMode
        batch_size: int
        input_ids: torch.Tensor

        def __repr__(self):
            reprs.append(1)
            return "ForwardBatch(...)"

    class Hostile:
        prefix = "class attribute, not the instance's"

        def __init__(self):
            self.layer_id = 3
            self.in_features = [1]  # not a number: left out

        @property
        def out_features(self):
            raise AssertionError("a property ran")

        def __getattr__(self, name):
            raise AssertionError(f"__getattr__ ran for {name}")

        def __repr__(self):
            raise AssertionError("repr ran")

    log = tmp_path / "kernels.log"
    exporter = record(level=3)
    kernel = sok.debug_kernel_api(op_name="k")(lambda *args: None)
    batch = ForwardBatch(ForwardMode.DECODE, 4, torch.ones(4, dtype=torch.int64))
    layer = torch.nn.Linear(8, 4)
    for _ in range(2):
        kernel(batch, layer, Hostile(), Color.RED, ForwardMode.DECODE)
    assert reprs == []
    a = exporter.get_finished_spans()[-1].attributes
    assert a[K + "input.arg0"] == "ForwardBatch(forward_mode=DECODE, batch_size=4)"
    assert a[K + "input.arg1"] == "Linear(in_features=8, out_features=4)"
    assert a[K + "input.arg2"] == "Hostile(layer_id=3)"
    assert a[K + "input.arg3"] == "Color.RED"
    assert a[K + "input.arg4"] == "<ForwardMode.DECODE: 2>"  # an int: a scalar, as before
    sok.configure(log_dest=str(log))
    kernel(batch, layer)
    assert len(reprs) == 1 and "  arg[0]=ForwardBatch(\n      repr=ForwardBatch(...)\n    )" in log.read_text()


def test_span_is_started_before_the_kernel_with_inputs_set(record, tmp_path):
    exporter = record(level=3)
    sok.configure(trace_file=str(tmp_path / "t.sgltrace"))
    seen = {}

    @sok.debug_kernel_api(op_name="k")
    def kernel(x):
        # No SDK span on the kernel thread: the call is on disk, with its inputs, while it runs.
        [current] = sok.read_trace(tmp_path / "t.sgltrace")
        seen["name"] = current.name
        seen["shape"] = current.attributes[K + "input.arg0.shape"]
        seen["in_flight"] = current.in_flight
        return x

    kernel(torch.ones(3, 2))
    assert seen == {"name": "k", "shape": (3, 2), "in_flight": True}
    assert only_span(exporter).end_time is not None


def test_nesting_under_request_span_and_kernel_in_kernel(record, provider):
    exporter = record(level=1)
    inner = sok.debug_kernel_api(op_name="inner")(lambda x: x)
    outer = sok.debug_kernel_api(op_name="outer")(lambda x: inner(x))
    with provider.get_tracer("app").start_as_current_span("request") as request:
        outer(1)
    spans = {s.name: s for s in exporter.get_finished_spans()}
    assert spans["outer"].parent.span_id == request.get_span_context().span_id
    assert spans["inner"].parent.span_id == spans["outer"].context.span_id
    assert len({s.context.trace_id for s in spans.values()}) == 1
    # The kernel's span is no longer current after the call.
    assert trace.get_current_span() is trace.INVALID_SPAN


def test_each_call_takes_the_parent_current_at_that_call(record, provider):
    # The parent is looked up once per context and kept: switching contexts
    # back and forth, and leaving them, must never reuse a stale one.
    exporter = record(level=1)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x)
    tracer = provider.get_tracer("app")
    a, b = tracer.start_span("a"), tracer.start_span("b")
    expected = []
    for span in (a, b, a, None, None, b, None):
        if span is None:
            kernel(1)
        else:
            with trace.use_span(span):
                kernel(1)
        expected.append(span)
    kernels = [s for s in exporter.get_finished_spans() if s.name == "k"]
    assert [s.parent.span_id if s.parent else None for s in kernels] == [
        span.get_span_context().span_id if span else None for span in expected]
    assert [s.context.trace_id for s, span in zip(kernels, expected) if span is not None] == [
        span.get_span_context().trace_id for span in expected if span is not None]
    alone = [s.context.trace_id for s, span in zip(kernels, expected) if span is None]
    assert len(set(alone)) == 3 and not {a.get_span_context().trace_id, b.get_span_context().trace_id} & set(alone)


def test_exception_sets_error_and_is_reraised_unchanged(record):
    exporter = record(level=3)
    error = RuntimeError("CUDA error: device-side assert triggered")

    @sok.debug_kernel_api(op_name="embedding")
    def embedding(ids):
        raise error

    with pytest.raises(RuntimeError) as info:
        embedding(torch.tensor([5, 70000]))
    assert info.value is error
    frames = [frame.name for frame in traceback.extract_tb(info.tb)]
    assert frames[-1] == "embedding"
    span = only_span(exporter)
    assert span.status.status_code is StatusCode.ERROR
    assert span.status.description == "RuntimeError: CUDA error: device-side assert triggered"
    (event,) = span.events
    assert event.name == "exception"
    assert event.attributes["exception.type"] == "RuntimeError"
    assert event.attributes["exception.escaped"] == "True"
    assert K + "output" not in span.attributes
    assert trace.get_current_span() is trace.INVALID_SPAN


@pytest.mark.parametrize("exc_type", [KeyboardInterrupt, SystemExit, GeneratorExit])
def test_base_exceptions_end_the_span_with_error(record, exc_type):
    exporter = record(level=1)

    @sok.debug_kernel_api(op_name="k")
    def kernel():
        raise exc_type()

    with pytest.raises(exc_type):
        kernel()
    assert only_span(exporter).status.status_code is StatusCode.ERROR


def test_wrapping_twice_is_a_no_op(record):
    exporter = record(level=1)

    def kernel(x):
        return x

    once = sok.debug_kernel_api(kernel)
    assert sok.debug_kernel_api(once) is once
    assert sok.debug_kernel_api(op_name="other")(once) is once
    assert once.__wrapped__ is kernel and once.__name__ == "kernel"
    once(1)
    assert len(exporter.get_finished_spans()) == 1


def test_debug_torch_op_wraps_the_op_under_the_python_name(record):
    exporter = record(level=3)

    def silu_and_mul(x):
        """The Python function the op was registered from."""

    op = sok.debug_torch_op(silu_and_mul, "relu", namespace="aten")
    assert op is not torch.ops.aten.relu
    assert torch.equal(op(torch.tensor([-1.0, 2.0])), torch.tensor([0.0, 2.0]))
    span = only_span(exporter)
    assert span.name == "test_spans.test_debug_torch_op_wraps_the_op_under_the_python_name.silu_and_mul"
    assert span.attributes[K + "output.shape"] == (2,)
    marked = sok.debug_kernel_api(silu_and_mul)
    raw = sok.debug_torch_op(marked, "relu", namespace="aten")
    assert raw is torch.ops.aten.relu


def test_wrap_method_once(record):
    exporter = record(level=1)

    class UnquantizedLinearMethod:
        def apply(self, layer, x):
            return x

    method = UnquantizedLinearMethod()
    sok.wrap_method_with_debug_kernel_once(method, "apply", op_name="sglang.quant_method.Unquantized.apply")
    first = method.apply
    sok.wrap_method_with_debug_kernel_once(method, "apply", op_name="again")
    assert method.apply is first
    assert method._debug_kernel_apply_wrapped is True
    assert method.apply("layer", 5) == 5
    assert [s.name for s in exporter.get_finished_spans()] == ["sglang.quant_method.Unquantized.apply"]
    sok.wrap_method_with_debug_kernel_once(method, "apply", op_name="x", marker_attr="_mine")
    assert method._mine is True


def test_many_arguments_are_never_dropped_silently(record):
    exporter = record(level=3)
    kernel = sok.debug_kernel_api(op_name="wide")(lambda *tensors: tensors[0])
    kernel(*[torch.ones(2) for _ in range(40)])  # 40 tensors x 6 attributes
    span = only_span(exporter)
    a = span.attributes
    assert span.dropped_attributes == 0
    assert a[K + "name"] == "wide" and a[K + "seq"] >= 1
    kept = len(a)
    assert kept <= 128
    assert a[K + "attributes_dropped"] + kept - 1 == 3 + 40 * 6 + 6
    assert a[K + "input.arg0.shape"] == (2,)


def test_stats_attributes_and_nonfinite_output_event(record):
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="div")(lambda x, y: x / y)
    kernel(torch.tensor([1.0, 0.0, -1.0]), torch.tensor([0.0, 0.0, 2.0]))
    span = only_span(exporter)
    a = span.attributes
    assert (a[K + "input.arg0.min"], a[K + "input.arg0.max"], a[K + "input.arg0.mean"]) == (-1.0, 1.0, 0.0)
    assert (a[K + "input.arg0.nan_count"], a[K + "input.arg0.inf_count"]) == (0, 0)
    assert (a[K + "input.arg0.has_nan"], a[K + "input.arg0.has_inf"]) == (False, False)
    assert (a[K + "output.nan_count"], a[K + "output.inf_count"]) == (1, 1)
    assert (a[K + "output.has_nan"], a[K + "output.has_inf"]) == (True, True)
    assert a[K + "has_nan"] is True and a[K + "has_inf"] is True
    assert a[K + "nonfinite"] == ("output",)
    (event,) = span.events
    assert event.name == "nonfinite_output"
    assert event.attributes[K + "nonfinite"] == ("output",)


def test_nonfinite_input_sets_flags_before_the_call_and_no_event(record, tmp_path):
    exporter = record(level=5)
    sok.configure(trace_file=str(tmp_path / "t.sgltrace"))
    seen = {}

    @sok.debug_kernel_api(op_name="k")
    def kernel(x, y):
        seen.update(sok.read_trace(tmp_path / "t.sgltrace")[0].attributes)  # the start record, written before
        return x + 1

    kernel(torch.tensor([1.0, float("inf")]), torch.ones(2))
    assert seen[K + "has_inf"] is True and seen[K + "has_nan"] is False
    assert seen[K + "nonfinite"] == ("input.arg0",)
    span = only_span(exporter)
    assert span.events == ()
    assert span.attributes[K + "nonfinite"] == ("input.arg0", "output")


def test_non_finite_statistics_are_texts_also_when_only_the_mean_overflows(record):
    """Jaeger cannot show a non-finite number: min, max and mean that are not
    finite become texts, also a mean whose float32 sum overflowed though no
    value is NaN or Inf (no flag raised then)."""
    exporter = record(level=5)
    kernel = sok.debug_kernel_api(op_name="k")(lambda x, y: None)
    kernel(torch.tensor([float("nan"), float("-inf"), 1.0]), torch.tensor([3e38, 3e38], dtype=torch.float32))
    a = only_span(exporter).attributes
    assert a[K + "input.arg0.max"] == "nan" and a[K + "input.arg0.mean"] == "nan"
    assert (a[K + "input.arg0.nan_count"], a[K + "input.arg0.inf_count"]) == (1, 1)
    assert (a[K + "input.arg1.min"], a[K + "input.arg1.max"]) == (pytest.approx(3e38), pytest.approx(3e38))
    assert a[K + "input.arg1.mean"] == "inf"
    assert (a[K + "input.arg1.nan_count"], a[K + "input.arg1.inf_count"]) == (0, 0)
    assert a[K + "nonfinite"] == ("input.arg0",)


def test_clean_call_at_level5_has_false_flags(record):
    exporter = record(level=5)
    sok.debug_kernel_api(op_name="k")(lambda x: x)(torch.ones(3))
    a = only_span(exporter).attributes
    assert a[K + "has_nan"] is False and a[K + "has_inf"] is False and a[K + "nonfinite"] == ()


def test_spans_off_records_no_span(record, capsys):
    exporter = record(level=3, log_dest="stdout")
    sok.configure(spans=False)
    sok.debug_kernel_api(op_name="k")(lambda x: x)(1)
    assert exporter.get_finished_spans() == ()
    assert "SGLang Kernel API Call: k" in capsys.readouterr().out


def test_name_inference_strips_sglang_prefix_and_locals():
    from sglang_otel_kernels.capture.naming import infer_api_name

    def local():
        pass

    local.__module__ = "sglang.srt.layers.layernorm"
    local.__qualname__ = "RMSNorm.forward_cuda.<locals>.inner"
    assert infer_api_name(local) == "srt.layers.layernorm.RMSNorm.forward_cuda.inner"
    local.__module__ = "sgl_kernel.elementwise"
    local.__qualname__ = "fused_add_rmsnorm"
    assert infer_api_name(local) == "elementwise.fused_add_rmsnorm"
    local.__module__ = "__main__"
    assert infer_api_name(local) == "test_spans.fused_add_rmsnorm"
    assert infer_api_name(len) == "len"


def test_a_provider_that_is_not_the_sdks_gets_kernel_spans_through_its_tracer(provider, tmp_path, capsys):
    class Foreign(trace.TracerProvider):
        """An API-level provider (a vendor's, say) that takes no finished span."""

        def get_tracer(self, *args, **kwargs):
            return provider.get_tracer(*args, **kwargs)

    sok.configure(level=3, log_dest="off", tracer_provider=Foreign(), trace_file=str(tmp_path / "t.sgltrace"))
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x[9])
    with provider.get_tracer("app").start_as_current_span("request") as request:
        with pytest.raises(IndexError):
            kernel(torch.ones(2))
    [made] = [s for s in provider.exporter.get_finished_spans() if s.name == "k"]
    assert made.parent.span_id == request.get_span_context().span_id
    assert made.attributes[K + "input.arg0.shape"] == (2,)
    assert made.status.status_code == StatusCode.ERROR and made.events[0].name == "exception"
    assert "not the OpenTelemetry SDK's: kernel spans reach it" in capsys.readouterr().err
    [recorded] = [s for s in sok.read_trace(tmp_path / "t.sgltrace") if s.name == "k"]
    assert recorded.status_code == "ERROR" and recorded.parent_span_id == made.parent.span_id
