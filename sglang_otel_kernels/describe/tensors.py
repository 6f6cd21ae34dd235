"""Tensor metadata, read from the host side only: no kernel launch, no sync."""

from __future__ import annotations

from typing import Any

import torch

from ..descriptions import TensorInfo

_dtype_names: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


def dtype_names() -> dict:
    """Every dtype torch has, by its name as a span records it (what the
    compiled core looks dtypes up in; one it lacks goes through Python)."""
    for value in vars(torch).values():
        if isinstance(value, torch.dtype):
            _dtype_name(value)
    return _dtype_names


def _device_name(tensor: torch.Tensor) -> str:
    # `is_cpu` is a flag read; `str(tensor.device)` builds a device object first.
    return "cpu" if tensor.is_cpu else str(tensor.device)


def _stride(tensor: torch.Tensor) -> tuple | None:
    return tuple(tensor.stride()) if tensor.layout is torch.strided else None


# Field by field, for tensors that refuse some reads (subclasses, sparse and
# nested tensors): the rest is still worth recording.
_READERS = (
    ("shape", lambda t: tuple(t.shape)),
    ("dtype", lambda t: _dtype_name(t.dtype)),
    ("device", _device_name),
    ("requires_grad", lambda t: bool(t.requires_grad)),
    ("contiguous", lambda t: bool(t.is_contiguous())),
    ("stride", _stride),
)


def describe_tensor(tensor: torch.Tensor) -> TensorInfo:
    try:
        return TensorInfo(tensor, tuple(tensor.shape), _dtype_name(tensor.dtype), _device_name(tensor),
                          _stride(tensor), bool(tensor.is_contiguous()), bool(tensor.requires_grad))
    except Exception:
        info = TensorInfo(tensor)
        for field, read in _READERS:
            try:
                setattr(info, field, read(tensor))
            except Exception:
                continue
        return info


def tensors_of(value: Any, limit: int) -> list:
    """The tensors a result holds (itself, or in lists, tuples, dicts and
    objects' attributes: a dataclass of outputs, SGLang's
    LogitsProcessorOutput), found by their Python containers alone, at most
    `limit`, four levels deep."""
    found: list = []
    _walk(value, found, limit, 0)
    return found


def _walk(value: Any, found: list, limit: int, depth: int) -> None:
    if len(found) >= limit or depth > 3:
        return
    if isinstance(value, torch.Tensor):
        found.append(value)
    elif isinstance(value, dict):
        for item in value.values():
            _walk(item, found, limit, depth + 1)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _walk(item, found, limit, depth + 1)
    elif hasattr(value, "__dict__"):
        for item in vars(value).values():
            _walk(item, found, limit, depth + 1)
