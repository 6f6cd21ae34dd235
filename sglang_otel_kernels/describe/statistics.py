"""Level-5 statistics: min, max, mean and NaN/Inf counts of each tensor.

Values are those SGLang prints (computed in float32; complex tensors by
magnitude; integer and bool tensors converted), gathered in as few passes as
possible: one `aminmax` and one `mean` per tensor. NaN propagates into min and
max, and +/-Inf shows as a bound, so counting passes run only when one of the
two flags is raised. On an accelerator every scalar of a call's tensors is
gathered on the device and copied to the host in one transfer, so one side of
a call (inputs, or outputs) synchronises once; the counts are then computed on
the device unconditionally, as deciding first would cost a second sync.
"""

from __future__ import annotations

import math

import torch

from ..capture.guards import is_graph_capturing
from .tensors import TensorInfo

EMPTY = "empty tensor"
GRAPH_CAPTURE = "skipped: graph capture in progress"
META = "skipped: meta tensor"


def _skip_reason(tensor: torch.Tensor, capturing: dict) -> str | None:
    if tensor.numel() == 0:
        return EMPTY
    device_type = tensor.device.type
    if device_type in ("cuda", "xpu"):
        if device_type not in capturing:
            capturing[device_type] = is_graph_capturing(device_type)
        if capturing[device_type]:
            return GRAPH_CAPTURE
    if tensor.is_meta:
        return META
    if tensor.layout is not torch.strided:
        return f"skipped: {str(tensor.layout).replace('torch.', '')} layout"
    return None


def _float_view(tensor: torch.Tensor) -> torch.Tensor:
    if tensor.dtype is torch.float32:
        return tensor
    if tensor.is_complex():
        return tensor.abs().float()
    return tensor.float()


def _counts(tensor: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.isnan(tensor).sum(), torch.isinf(tensor).sum()


def fill_statistics(infos: list[TensorInfo]) -> None:
    """Sets `stats` or `stats_note` on each of `infos`; never raises."""
    if not infos:
        return
    capturing: dict = {}
    deferred: list[tuple[TensorInfo, torch.Tensor]] = []
    with torch.no_grad():
        for info in infos:
            try:
                tensor = info.tensor.detach()
                reason = _skip_reason(tensor, capturing)
                if reason is not None:
                    info.stats_note = reason
                    continue
                source = _float_view(tensor)
                low, high = torch.aminmax(source)
                mean = source.mean()
                if tensor.device.type == "cpu":
                    info.stats = _host_stats(tensor, low.item(), high.item(), mean.item())
                else:
                    nans, infs = _counts(tensor)
                    deferred.append((info, torch.stack([low, high, mean, nans.float(), infs.float()])))
            except Exception as exc:
                info.stats_note = f"unavailable: {type(exc).__name__}"
        if deferred:
            _transfer(deferred)


def _host_stats(tensor: torch.Tensor, low: float, high: float, mean: float) -> tuple:
    nan_count = inf_count = 0
    flagged = math.isnan(low) or math.isnan(high) or math.isinf(low) or math.isinf(high)
    if flagged and (tensor.is_floating_point() or tensor.is_complex()):
        nans, infs = _counts(tensor)
        nan_count, inf_count = int(nans.item()), int(infs.item())
    return (low, high, mean, nan_count, inf_count)


def _transfer(deferred: list[tuple[TensorInfo, torch.Tensor]]) -> None:
    by_device: dict = {}
    for info, scalars in deferred:
        by_device.setdefault(scalars.device, []).append((info, scalars))
    for entries in by_device.values():
        try:
            flat = torch.cat([scalars for _, scalars in entries]).tolist()
        except Exception as exc:
            for info, _ in entries:
                info.stats_note = f"unavailable: {type(exc).__name__}"
            continue
        for index, (info, _) in enumerate(entries):
            low, high, mean, nans, infs = flat[5 * index : 5 * index + 5]
            info.stats = (low, high, mean, int(nans), int(infs))


def has_nan(info: TensorInfo) -> bool:
    return info.stats is not None and info.stats[3] > 0


def has_inf(info: TensorInfo) -> bool:
    return info.stats is not None and info.stats[4] > 0
