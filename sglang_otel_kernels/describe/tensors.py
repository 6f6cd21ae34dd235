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


def describe_tensor(tensor: torch.Tensor) -> TensorInfo:
    info = TensorInfo(tensor)
    # Each read is guarded on its own: subclasses, sparse and nested tensors
    # refuse some of them, and the rest is still worth recording.
    try:
        info.shape = tuple(tensor.shape)
    except Exception:
        pass
    try:
        info.dtype = _dtype_name(tensor.dtype)
    except Exception:
        pass
    try:
        info.device = str(tensor.device)
    except Exception:
        pass
    try:
        info.requires_grad = bool(tensor.requires_grad)
    except Exception:
        pass
    try:
        info.contiguous = bool(tensor.is_contiguous())
    except Exception:
        pass
    try:
        if tensor.layout is torch.strided:
            info.stride = tuple(tensor.stride())
    except Exception:
        pass
    return info
