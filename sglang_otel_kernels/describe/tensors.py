"""Tensor metadata, read from the host side only: no kernel launch, no sync."""

from __future__ import annotations

import torch

_dtype_names: dict = {}


def _dtype_name(dtype: torch.dtype) -> str:
    name = _dtype_names.get(dtype)
    if name is None:
        name = _dtype_names[dtype] = str(dtype)
    return name


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

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.shape: tuple = ()
        self.dtype = "unknown"
        self.device = "unknown"
        self.stride: tuple | None = None
        self.contiguous = False
        self.requires_grad = False
        # (min, max, mean, nan_count, inf_count), or a note saying why not.
        self.stats: tuple | None = None
        self.stats_note: str | None = None


def _stride(tensor: torch.Tensor) -> tuple | None:
    return tuple(tensor.stride()) if tensor.layout is torch.strided else None


# Field by field, for tensors that refuse some reads (subclasses, sparse and
# nested tensors): the rest is still worth recording.
_READERS = (
    ("shape", lambda t: tuple(t.shape)),
    ("dtype", lambda t: _dtype_name(t.dtype)),
    ("device", lambda t: str(t.device)),
    ("requires_grad", lambda t: bool(t.requires_grad)),
    ("contiguous", lambda t: bool(t.is_contiguous())),
    ("stride", _stride),
)


def describe_tensor(tensor: torch.Tensor) -> TensorInfo:
    info = TensorInfo(tensor)
    try:
        info.shape = tuple(tensor.shape)
        info.dtype = _dtype_name(tensor.dtype)
        info.device = str(tensor.device)
        info.requires_grad = bool(tensor.requires_grad)
        info.contiguous = bool(tensor.is_contiguous())
        info.stride = _stride(tensor)
    except Exception:
        for field, read in _READERS:
            try:
                setattr(info, field, read(tensor))
            except Exception:
                continue
    return info
