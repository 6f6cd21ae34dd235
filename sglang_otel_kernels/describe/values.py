"""Turns a kernel's arguments and result into a small description tree.

One walk serves both the SGLang text log and the span attributes, with
SGLang's limits: two container levels deep, the first 4 items of a list or
tuple, the first 8 of a dict. Describing never raises, never consumes an
iterator and never calls anything on the value but `repr` (for the text log
alone), `len`, slicing and attribute reads, each guarded.
"""

from __future__ import annotations

import enum
import itertools
import types
from typing import Any

import torch

from .guards import is_graph_capturing
from ..text import utf8
from ..descriptions import REPR_LIMIT, Elided, Mapping, Node, Opaque, Scalar, Sequence, safe_repr
from .tensors import describe_tensor

MAX_DEPTH = 2
MAX_SEQUENCE_ITEMS = 4
MAX_MAPPING_ITEMS = 8
OBJECT_FIELDS = ("shape", "dtype", "device")

_PRIMITIVES = (str, int, float, bool, type(None))




CAPTURE_REPR = "repr skipped: graph capture in progress"


def _object_repr(value: Any) -> str:
    """An object's repr, except while a CUDA graph is captured: a repr that
    formats the CUDA tensors an object holds synchronises and breaks the capture."""
    if is_graph_capturing("cuda"):
        return f"<{type(value).__name__}, {CAPTURE_REPR}>"
    return safe_repr(value, REPR_LIMIT)


# The plain instance attributes that identify an object that is neither a
# tensor nor a container, in a span: SGLang's ForwardBatch by its mode and
# size, a layer by its number and sizes. Each must be a number, a bool, a
# string or an enum member to count.
IDENTITY_FIELDS = ("forward_mode", "batch_size", "layer_id", "prefix", "input_size", "output_size",
                   "in_features", "out_features", "num_embeddings", "embedding_dim", "num_heads", "head_dim")
IDENTITY_TEXT_LIMIT = 64
_IDENTITY_TYPES_LIMIT = 1024
_identity_names: dict = {}  # type -> the IDENTITY_FIELDS its first instance had


def _field_text(value: Any) -> str | None:
    if isinstance(value, enum.Enum):
        return value.name if isinstance(value.name, str) else None
    if isinstance(value, (bool, int, float)):
        return repr(value) if type(value) in (bool, int, float) else None
    if type(value) is str:
        return utf8(value[:IDENTITY_TEXT_LIMIT])
    return None


def identity(value: Any) -> str:
    """`TypeName(field=..., ...)` from IDENTITY_FIELDS read out of the
    instance's own `__dict__` (no property, no `__getattr__`, no repr runs),
    or `Type.MEMBER` for an enum member: bounded whatever the object."""
    kind = type(value)
    try:
        if isinstance(value, enum.Enum):
            return f"{kind.__name__}.{_field_text(value)}"
        own = object.__getattribute__(value, "__dict__")
        if type(own) is not dict:
            return kind.__name__
        names = _identity_names.get(kind)
        if names is None:
            names = tuple(name for name in IDENTITY_FIELDS if _field_text(own.get(name)) is not None)
            if len(_identity_names) < _IDENTITY_TYPES_LIMIT:
                _identity_names[kind] = names
        parts = [f"{name}={text}" for name in names if (text := _field_text(own.get(name))) is not None]
    except Exception:  # no __dict__, or an attribute read that raised
        return kind.__name__
    return f"{kind.__name__}({', '.join(parts)})" if parts else kind.__name__


# Where torch.nn.Module's __getattr__ looks for a name its instance and class lack.
_MODULE_DICTS = ("_parameters", "_buffers", "_modules")


def identity_plan(value: Any) -> "tuple | bool | None":
    """How the compiled core writes, for every instance of `value`'s type,
    what `describe` and record/attributes.py write for it (`identity`),
    without calling Python: (the type's name, its IDENTITY_FIELDS, as its
    first instance gave them, OBJECT_FIELDS, and the dicts of the instance
    dict that are searched too, a torch module's). An instance that holds
    one of OBJECT_FIELDS there goes through `describe` (its fields are shown
    instead). None for a type whose instances always do: containers,
    tensors, enums, primitives, and any type that could find OBJECT_FIELDS
    by running code (its class's attributes or properties, a __getattr__
    other than a torch module's, a __getattribute__) or has no plain __dict__.
    False: not yet (this instance shows fields, and none of its type has
    named its identity fields yet); ask again with the next."""
    kind = type(value)
    try:
        if isinstance(value, (torch.Tensor, list, tuple, dict, enum.Enum, *_PRIMITIVES)):
            return None
        if kind.__getattribute__ is not object.__getattribute__:
            return None
        hook = getattr(kind, "__getattr__", None)
        if hook is not None and hook is not torch.nn.Module.__getattr__:
            return None
        mro = kind.__mro__
        if any(name in vars(base) for base in mro for name in OBJECT_FIELDS):
            return None
        slot = next((vars(base)["__dict__"] for base in mro if "__dict__" in vars(base)), None)
        if type(slot) is not types.GetSetDescriptorType or not isinstance(kind.__name__, str):
            return None
        if kind not in _identity_names:
            if _describe_object(value).fields:
                return False  # not yet: the first instance shown by its identity names the fields
            identity(value)  # names them, as on the Python path
        names = _identity_names.get(kind)
        return None if names is None else (kind.__name__, names, OBJECT_FIELDS, _MODULE_DICTS if hook else ())
    except Exception:  # a hostile class: each instance through `describe`, which is guarded
        return None


def describe(value: Any, depth: int = 0) -> Node:
    try:
        return _describe(value, depth)
    except Exception:
        return Opaque(type(value).__name__, [], value)


def _describe(value: Any, depth: int) -> Node:
    if depth >= MAX_DEPTH:
        return Elided(type(value).__name__)
    if isinstance(value, torch.Tensor):
        return describe_tensor(value)
    if isinstance(value, _PRIMITIVES):
        return Scalar(value, safe_repr(value))
    if isinstance(value, (list, tuple)):
        count = len(value)
        head = [describe(item, depth + 1) for item in value[:MAX_SEQUENCE_ITEMS]]
        return Sequence(isinstance(value, list), head, count - len(head))
    if isinstance(value, dict):
        count = len(value)
        head = [
            (safe_repr(key), _path_part(key), describe(item, depth + 1))
            for key, item in itertools.islice(value.items(), MAX_MAPPING_ITEMS)
        ]
        return Mapping(head, count - len(head))
    return _describe_object(value)


def _path_part(key: Any) -> str:
    if isinstance(key, str):
        return key
    return safe_repr(key, REPR_LIMIT)


def _describe_object(value: Any) -> Opaque:
    fields = []
    for name in OBJECT_FIELDS:
        try:
            fields.append((name, str(getattr(value, name))))
        except Exception:
            # Absent, or its access or str() raised: SGLang leaves it out too.
            continue
    return Opaque(type(value).__name__, fields, value)


Opaque.read_repr, Opaque.read_identity = staticmethod(_object_repr), staticmethod(identity)
