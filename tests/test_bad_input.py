"""Whatever a kernel is given or returns, instrumentation never raises, never
changes arguments or results, and never masks the kernel's own exception."""

import collections
import enum
import itertools
import math
import sys

import pytest
import torch

import sglang_otel_kernels as sok
from conftest import strip_timestamps


class RaisingRepr:
    def __repr__(self):
        raise RuntimeError("repr exploded")


class RaisingGetattr:
    def __getattribute__(self, name):
        if name in ("__class__", "__dict__"):
            return object.__getattribute__(self, name)
        raise ValueError(f"no {name} for you")


class RaisingShape:
    @property
    def shape(self):
        raise RuntimeError("shape exploded")

    dtype = "fp8"


class UnprintableDtype:
    class _Dtype:
        def __str__(self):
            raise TypeError("no str")

    dtype = _Dtype()


class ReprStr(str):
    def __repr__(self):
        raise RuntimeError("str subclass repr")


class BadList(list):
    def __getitem__(self, index):
        raise IndexError("bad list")


class BadDict(dict):
    def items(self):
        raise KeyError("bad items")


class BadKey:
    def __hash__(self):
        return 1

    def __repr__(self):
        raise RuntimeError("key repr")


class Everything:
    """Answers every attribute, like a mock."""

    def __getattr__(self, name):
        return self


class NoLayoutTensor(torch.Tensor):
    """A subclass refusing some metadata reads, as nested and exotic tensors do."""

    def is_contiguous(self, *args, **kwargs):
        raise RuntimeError("no contiguity here")

    def stride(self, *args, **kwargs):
        raise RuntimeError("no strides here")


class Color(enum.Enum):
    RED = 1


def self_list():
    items = [1, 2]
    items.append(items)
    return items


def self_dict():
    mapping = {"a": 1}
    mapping["self"] = mapping
    return mapping


Point = collections.namedtuple("Point", "x y")

CASES = {
    "generator": lambda: (i for i in range(3)),
    "iterator": lambda: iter([1, 2, 3]),
    "count": lambda: itertools.count(),
    "repr raises": RaisingRepr,
    "getattr raises": RaisingGetattr,
    "shape raises": RaisingShape,
    "dtype str raises": UnprintableDtype,
    "str subclass repr raises": lambda: ReprStr("x"),
    "list getitem raises": lambda: BadList([1, 2]),
    "dict items raises": lambda: BadDict(a=1),
    "key repr raises": lambda: {BadKey(): 1},
    "self-referencing list": self_list,
    "self-referencing dict": self_dict,
    "huge list": lambda: list(range(1_000_000)),
    "huge dict": lambda: {i: i for i in range(100_000)},
    "non-string keys": lambda: {(1, 2): "t", None: 0, 3: [1], frozenset({1}): 2.5},
    "None": lambda: None,
    "Ellipsis": lambda: ...,
    "nan and inf floats": lambda: [math.nan, math.inf, -math.inf],
    "huge ints": lambda: [10**100, -(10**100), 2**63],
    "bytes": lambda: b"\x00\xff",
    "bytearray": lambda: bytearray(b"ab"),
    "complex": lambda: 1 + 2j,
    "lone surrogate string": lambda: "bad \ud800 text\nsecond line",
    "megabyte string": lambda: "x" * 1_000_000,
    "namedtuple": lambda: Point(torch.ones(1), 2),
    "set": lambda: {1, 2, 3},
    "class object": lambda: torch.Tensor,
    "module": lambda: sys,
    "lambda": lambda: (lambda: 0),
    "torch dtype and device": lambda: (torch.bfloat16, torch.device("cpu")),
    "torch.Size": lambda: torch.Size([2, 3]),
    "deeply nested tensors": lambda: [[[torch.ones(2)]]],
    "tensor needing grad": lambda: torch.ones(2, requires_grad=True),
    "zero-dim tensor": lambda: torch.tensor(3.5),
    "sparse tensor": lambda: torch.eye(2).to_sparse(),
    "meta tensor": lambda: torch.empty(3, device="meta"),
    "mock-like object": Everything,
    "tensor refusing stride and contiguity": lambda: torch.ones(2, 3).as_subclass(NoLayoutTensor),
    "enum": lambda: Color.RED,
    "exception instance": lambda: ValueError("as a value"),
}


@pytest.fixture
def full_recording(record, tmp_path):
    exporter = record(level=5, log_dest=str(tmp_path / "kernels.log"))
    return exporter, tmp_path / "kernels.log"


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_argument_and_result(full_recording, capsys, name):
    exporter, log = full_recording
    value = CASES[name]()
    received = []

    @sok.debug_kernel_api(op_name="identity")
    def identity(x, *rest, **kwargs):
        received.append((x, rest, kwargs))
        return x

    result = identity(value, value, key=value)
    assert result is value
    ((got, rest, kwargs),) = received
    assert got is value and rest == (value,) and kwargs["key"] is value
    if name == "generator":
        assert list(value) == [0, 1, 2]  # not consumed
    if name == "iterator":
        assert next(value) == 1
    (span,) = exporter.get_finished_spans()
    assert span.name == "identity"
    described = [k for k in span.attributes if k == "sglang.kernel.input.arg0" or k.startswith("sglang.kernel.input.arg0.")]
    assert described, "the argument left no attribute"
    text = strip_timestamps(log.read_text(encoding="utf-8"))
    assert text.startswith("=" * 80 + "\n[TS] SGLang Kernel API Call: identity\nPositional input arguments:\n")
    assert "Output:\n  return=" in text
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("name", ["repr raises", "getattr raises", "huge list", "generator", "meta tensor"])
def test_kernel_exception_is_not_masked(full_recording, name):
    exporter, _ = full_recording
    error = IndexError("the kernel's own")

    @sok.debug_kernel_api(op_name="fails")
    def fails(x):
        raise error

    with pytest.raises(IndexError) as info:
        fails(CASES[name]())
    assert info.value is error
    assert exporter.get_finished_spans()[0].status.description == "IndexError: the kernel's own"


def test_exception_with_unprintable_message(full_recording):
    exporter, log = full_recording

    class Weird(Exception):
        def __str__(self):
            raise RuntimeError("no message")

    error = Weird()

    @sok.debug_kernel_api(op_name="weird")
    def weird():
        raise error

    with pytest.raises(Weird) as info:
        weird()
    assert info.value is error
    assert exporter.get_finished_spans()[0].status.status_code.name == "ERROR"


def test_broken_text_destination_does_not_break_the_call(record, capsys, monkeypatch):
    record(level=3, log_dest="stdout")

    class Closed:
        def write(self, text):
            raise ValueError("I/O operation on closed file")

        def flush(self):
            pass

    monkeypatch.setattr(sys, "stdout", Closed())
    assert sok.debug_kernel_api(op_name="k")(lambda x: x * 2)(21) == 42


def test_unencodable_text_keeps_text_log_and_attributes_exportable(record, monkeypatch):
    import io

    exporter = record(level=3, log_dest="stdout")
    stdout = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")  # strict, like a real terminal
    monkeypatch.setattr(sys, "stdout", stdout)
    kernel = sok.debug_kernel_api(op_name="k")(lambda *a, **kw: None)
    kernel("bad \ud800", {"key \udcff": 1}, opt="\ud800")
    kernel("fine")
    stdout.flush()
    text = stdout.buffer.getvalue().decode("utf-8")
    assert "arg[0]='bad \\ud800'" in text
    assert "arg[0]='fine'" in text
    for span in exporter.get_finished_spans():
        for key, value in span.attributes.items():
            key.encode("utf-8")
            if isinstance(value, str):
                value.encode("utf-8")


def test_partly_readable_tensor_keeps_what_it_can(record):
    exporter = record(level=3)
    sok.debug_kernel_api(op_name="k")(lambda x: None)(torch.ones(2, 3).as_subclass(NoLayoutTensor))
    a = exporter.get_finished_spans()[0].attributes
    assert a["sglang.kernel.input.arg0.shape"] == (2, 3)
    assert a["sglang.kernel.input.arg0.dtype"] == "torch.float32"
    assert a["sglang.kernel.input.arg0.contiguous"] is False
    assert "sglang.kernel.input.arg0.stride" not in a
