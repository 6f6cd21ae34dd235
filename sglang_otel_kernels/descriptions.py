"""What a kernel call's arguments and result are described as: the tree
describe/ makes of them (describe/values.py, describe/tensors.py) and
record/ renders (span attributes, SGLang's text log, tensor dumps), read,
never made, there. Torch-free."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Union

from .text import utf8

if TYPE_CHECKING:
    import torch

REPR_LIMIT = 200


class TensorInfo:
    """What is known of one tensor argument; statistics are filled in later, at
    level 5, by `describe.statistics.fill_statistics`."""

    __slots__ = (
        "tensor",
        "shape",
        "dtype",
        "device",
        "stride",
        "contiguous",
        "requires_grad",
        "stats",
        "stats_note",
    )

    def __init__(self, tensor: torch.Tensor, shape: tuple = (), dtype: str = "unknown", device: str = "unknown",
                 stride: tuple | None = None, contiguous: bool = False, requires_grad: bool = False) -> None:
        self.tensor = tensor
        self.shape = shape
        self.dtype = dtype
        self.device = device
        self.stride = stride
        self.contiguous = contiguous
        self.requires_grad = requires_grad
        # (min, max, mean, nan_count, inf_count), or a note saying why not.
        self.stats: tuple | None = None
        self.stats_note: str | None = None


class Scalar:
    """A str, int, float, bool or None (or a subclass of one)."""

    __slots__ = ("value", "text")

    def __init__(self, value: Any, text: str) -> None:
        self.value = value
        self.text = text


class Sequence:
    __slots__ = ("is_list", "items", "more")

    def __init__(self, is_list: bool, items: list, more: int) -> None:
        self.is_list = is_list
        self.items = items
        self.more = more


class Mapping:
    """Items are (key repr, key as a path part, node)."""

    __slots__ = ("items", "more")

    def __init__(self, items: list, more: int) -> None:
        self.items = items
        self.more = more


class Elided:
    """A value past the depth limit, shown as `TypeName(...)`."""

    __slots__ = ("type_name",)

    def __init__(self, type_name: str) -> None:
        self.type_name = type_name


class Opaque:
    """Any other object: the shape/dtype/device it has (SGLang's fields);
    else, read only by the reader that wants it, its repr cut short (SGLang's
    text log) or its `identity` (a span): a ForwardBatch's or a layer's repr
    formats all it holds, too dear for every call."""

    __slots__ = ("type_name", "fields", "_value", "_repr")

    def __init__(self, type_name: str, fields: list, value: Any) -> None:
        self.type_name = type_name
        self.fields = fields
        self._value = value
        self._repr: str | None = None

    # How the object is read when a reader asks: describe/values.py sets both
    # (it knows when an object must not be touched: while a CUDA graph is
    # captured); these serve descriptions made without it.
    read_repr: "Callable[[Any], str]" = staticmethod(lambda value: safe_repr(value, REPR_LIMIT))
    read_identity: "Callable[[Any], str]" = staticmethod(lambda value: type(value).__name__)

    @property
    def repr(self) -> str | None:
        if self.fields:
            return None
        if self._repr is None:
            self._repr = self.read_repr(self._value)
        return self._repr

    @property
    def identity(self) -> str:
        return self.read_identity(self._value)


Node = Union[TensorInfo, Scalar, Sequence, Mapping, Elided, Opaque]


def safe_repr(value: Any, limit: int | None = None) -> str:
    try:
        text = repr(value)
        if not isinstance(text, str):
            raise TypeError("__repr__ returned a non-string")
    except Exception as exc:
        return f"<{type(value).__name__} object, repr raised {type(exc).__name__}>"
    return utf8(text if limit is None else text[:limit])


def safe_str(value: Any) -> str:
    """str(value) as valid UTF-8; never raises."""
    try:
        text = str(value)
        if isinstance(text, str):
            return utf8(text)
    except Exception:
        pass
    return f"<{type(value).__name__}, str() failed>"


def tensors_in(nodes: list) -> list[TensorInfo]:
    """Every tensor described in `nodes`, depth first, in argument order."""
    found: list[TensorInfo] = []
    stack = list(reversed(nodes))
    while stack:
        node = stack.pop()
        if isinstance(node, TensorInfo):
            found.append(node)
        elif isinstance(node, Sequence):
            stack.extend(reversed(node.items))
        elif isinstance(node, Mapping):
            stack.extend(item for _, _, item in reversed(node.items))
    return found
