"""Level-5 statistics across dtypes, layouts and devices, on real spans."""

import pytest
import torch

import sglang_otel_kernels as sok

K = "sglang.kernel."


def stats_of(record, tensor):
    exporter = record(level=5)
    sok.debug_kernel_api(op_name="k")(lambda x: None)(tensor)
    (span,) = exporter.get_finished_spans()
    exporter.clear()
    a = span.attributes
    fields = ("min", "max", "mean", "nan_count", "inf_count", "has_nan", "has_inf", "stats")
    return {f: a[K + "input.arg0." + f] for f in fields if K + "input.arg0." + f in a}


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64, torch.float32])
def test_floating_dtypes(record, dtype):
    s = stats_of(record, torch.tensor([[-1.5, 2.0], [0.5, 3.0]], dtype=dtype))
    assert s == {"min": -1.5, "max": 3.0, "mean": 1.0, "nan_count": 0, "inf_count": 0,
                 "has_nan": False, "has_inf": False}


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8(record, dtype):
    s = stats_of(record, torch.tensor([-2.0, 0.5, 4.0]).to(dtype))
    assert (s["min"], s["max"], s["mean"]) == (-2.0, 4.0, pytest.approx(2.5 / 3))
    assert s["nan_count"] == 0


def test_float16_nan_and_inf_counted(record):
    s = stats_of(record, torch.tensor([1.0, float("nan"), float("inf"), float("-inf"), float("nan")], dtype=torch.float16))
    assert (s["nan_count"], s["inf_count"], s["has_nan"], s["has_inf"]) == (2, 2, True, True)


def test_inf_only_is_found_through_the_bounds(record):
    s = stats_of(record, torch.tensor([1.0, float("-inf"), 3.0]))
    assert (s["min"], s["nan_count"], s["inf_count"], s["has_nan"], s["has_inf"]) == ("-inf", 0, 1, False, True)


def test_integer_and_bool(record):
    s = stats_of(record, torch.tensor([3, -7, 10], dtype=torch.int32))
    assert (s["min"], s["max"], s["mean"], s["nan_count"]) == (-7.0, 10.0, 2.0, 0)
    s = stats_of(record, torch.tensor([True, False, True, True]))
    assert (s["min"], s["max"], s["mean"]) == (0.0, 1.0, 0.75)


def test_complex_uses_magnitude_and_counts_nan(record):
    s = stats_of(record, torch.tensor([3 + 4j, 0j, complex(float("nan"), 1.0)]))
    assert (s["nan_count"], s["inf_count"], s["has_nan"]) == (1, 0, True)
    s = stats_of(record, torch.tensor([3 + 4j, 1j]))
    assert (s["min"], s["max"], s["mean"]) == (1.0, 5.0, 3.0)


def test_non_contiguous_and_expanded(record):
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    s = stats_of(record, base.t()[1:])
    assert (s["min"], s["max"]) == (1.0, 11.0)
    s = stats_of(record, torch.tensor([2.0]).expand(1000))
    assert (s["min"], s["max"], s["mean"]) == (2.0, 2.0, 2.0)


@pytest.mark.parametrize(
    "tensor, note",
    [
        (torch.empty(0, 3), "empty tensor"),
        (torch.empty(4, device="meta"), "skipped: meta tensor"),
        (torch.eye(3).to_sparse(), "skipped: sparse_coo layout"),
    ],
)
def test_skipped_statistics_say_why(record, tensor, note):
    assert stats_of(record, tensor) == {"stats": note}


def test_tensor_subclass_and_parameter(record):
    class Tagged(torch.Tensor):
        pass

    s = stats_of(record, torch.tensor([1.0, 5.0]).as_subclass(Tagged))
    assert (s["min"], s["max"]) == (1.0, 5.0)
    param = torch.nn.Parameter(torch.tensor([1.0, 3.0]))
    s = stats_of(record, param)
    assert s["mean"] == 2.0
    assert param.grad is None and param.requires_grad


def test_failing_statistics_are_a_note_not_an_error(record):
    class Broken(torch.Tensor):
        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            if func is torch.aminmax:
                raise RuntimeError("device lost")
            return super().__torch_function__(func, types, args, kwargs or {})

    assert stats_of(record, torch.ones(2).as_subclass(Broken)) == {"stats": "unavailable: RuntimeError"}


def test_statistics_build_no_autograd_graph(record):
    exporter = record(level=5)
    x = torch.ones(3, requires_grad=True)
    kernel = sok.debug_kernel_api(op_name="k")(lambda t: t * 2)
    y = kernel(x)
    y.sum().backward()
    assert torch.equal(x.grad, torch.full((3,), 2.0))
    assert exporter.get_finished_spans()[0].attributes[K + "output.requires_grad"] is True


# The accelerator branch, forced on CPU tensors: what a GPU would run.
@pytest.fixture
def on_device(monkeypatch):
    from sglang_otel_kernels.describe import statistics

    calls = {"counts": 0, "transfers": 0}
    counts, transfer = statistics._counts, statistics._host_values

    def counting(source):
        calls["counts"] += 1
        return counts(source)

    def transferring(entries, what, faults):
        calls["transfers"] += 1
        return transfer(entries, what, faults)

    monkeypatch.setattr(statistics, "on_host", lambda tensor: False)
    monkeypatch.setattr(statistics, "_counts", counting)
    monkeypatch.setattr(statistics, "_host_values", transferring)
    return calls


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_float8_nan_is_counted_on_the_device_path(record, on_device, dtype):
    s = stats_of(record, torch.tensor([1.0, float("nan"), 2.0]).to(dtype))
    assert (s["nan_count"], s["has_nan"]) == (1, True) and "stats" not in s


def test_float8_nan_is_counted_on_the_host_path(record):
    # float8_e4m3fn has no isinf kernel at all, on the CPU either.
    s = stats_of(record, torch.tensor([1.0, float("nan"), 2.0]).to(torch.float8_e4m3fn))
    assert (s["nan_count"], s["inf_count"], s["has_nan"]) == (1, 0, True) and "stats" not in s
    s = stats_of(record, torch.tensor([1.0, float("inf"), 2.0]).to(torch.float8_e5m2))
    assert (s["inf_count"], s["has_inf"], s["max"]) == (1, True, "inf")


def test_device_path_counts_only_when_min_or_max_shows_nan_or_inf(record, on_device):
    s = stats_of(record, torch.tensor([1.0, 2.0, 4.0], dtype=torch.bfloat16))
    assert (s["min"], s["max"], s["nan_count"], s["inf_count"]) == (1.0, 4.0, 0, 0)
    assert on_device == {"counts": 0, "transfers": 1}  # one copy to the host, no counting pass
    stats_of(record, torch.tensor([3, 7], dtype=torch.int64))
    stats_of(record, torch.tensor([True, False]))
    assert on_device["counts"] == 0  # integers and bools hold no NaN or Inf
    s = stats_of(record, torch.tensor([1.0, float("-inf"), float("nan")]))
    assert (s["nan_count"], s["inf_count"]) == (1, 1)
    # One copy per call (the kernel returns nothing), and for the flagged tensor a second, for its counts.
    assert on_device == {"counts": 1, "transfers": 1 + 1 + 1 + 2}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_device_path_reduces_half_precision_where_it_lies(record, on_device, monkeypatch, dtype):
    """No float32 copy of a bfloat16 or float16 tensor on an accelerator (on
    an H100 that copy made a 1 GiB tensor's statistics 7.5 times one aminmax):
    the same values as the host path, NaN and Inf still counted."""
    from sglang_otel_kernels.describe import statistics

    values = torch.tensor([[0.5, -3.25, 8.0], [1.0, 2.0, -0.125]], dtype=dtype)
    monkeypatch.setattr(statistics, "on_host", lambda tensor: True)
    on_host = stats_of(record, values)
    monkeypatch.setattr(statistics, "on_host", lambda tensor: False)
    copies = []

    def view(tensor, original=statistics._float_view):
        copies.append(tensor.dtype)
        return original(tensor)

    monkeypatch.setattr(statistics, "_float_view", view)
    on_device_stats = stats_of(record, values)
    assert copies == []
    assert {k: on_device_stats[k] for k in ("min", "max", "mean")} == {"min": -3.25, "max": 8.0, "mean": pytest.approx(1.3541667)}
    assert on_device_stats == on_host
    s = stats_of(record, torch.tensor([1.0, float("nan"), float("inf")], dtype=dtype))
    assert (s["nan_count"], s["inf_count"], s["has_nan"], s["has_inf"]) == (1, 1, True, True)
    assert copies == [] and on_device["counts"] == 1
    stats_of(record, torch.tensor([1.0, 2.0], dtype=torch.float64))
    assert copies == [torch.float64]  # other dtypes keep their float32 view
