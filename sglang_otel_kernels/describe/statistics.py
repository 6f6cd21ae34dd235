"""Level-5 statistics: min, max, mean and NaN/Inf counts of each tensor.

Values are those SGLang prints (computed in float32; complex tensors by
magnitude; integer and bool tensors converted), gathered in as few passes as
possible: one `aminmax` and one `mean` per tensor (in float32, as SGLang's
`mean()`: a float32 sum divided in double would print other digits). On an
accelerator a bfloat16 or float16 tensor is reduced where it lies, the mean
accumulated in float32, with no float32 copy: that copy, written and read
twice, made a 1 GiB bfloat16 tensor's statistics cost 7.5 times one `aminmax`
on an H100 (2.1 for float32). The host path keeps the copy, which gives
SGLang's digits exactly.
NaN propagates into min and max, and +/-Inf shows as a bound, so the counting passes (`isnan`, `isinf`,
on the float32 view: float8 types have no `isinf`) run only when min or max
shows one, and never for integer and bool tensors, which hold neither. On an
accelerator the scalars of all of a call's tensors are gathered on the device
and copied to the host in one transfer: one side of a call (inputs, or
outputs) synchronises once; only when a tensor shows NaN or Inf are its
counts computed and copied in a second transfer (a second synchronisation).
"""

from __future__ import annotations

import math

import torch

from ..record import core
from .guards import is_graph_capturing
from ..descriptions import TensorInfo

_isfinite = math.isfinite
EMPTY = "empty tensor"
GRAPH_CAPTURE = "skipped: graph capture in progress"
META = "skipped: meta tensor"


def _skip_reason(info: TensorInfo, tensor: torch.Tensor, capturing: dict) -> str | None:
    if info.device == "cpu" and info.stride is not None:
        # A strided host tensor, as described: its shape tells, no tensor read.
        return EMPTY if 0 in info.shape else None
    if tensor.numel() == 0:
        return EMPTY
    if tensor.is_cpu:  # a property read, where `device.type` builds a device object
        return None if tensor.layout is torch.strided else _layout_note(tensor)
    device_type = tensor.device.type
    if device_type in ("cuda", "xpu"):
        if device_type not in capturing:
            capturing[device_type] = is_graph_capturing(device_type)
        if capturing[device_type]:
            return GRAPH_CAPTURE
    if tensor.is_meta:
        return META
    if tensor.layout is not torch.strided:
        return _layout_note(tensor)
    return None


def _layout_note(tensor: torch.Tensor) -> str:
    return f"skipped: {str(tensor.layout).replace('torch.', '')} layout"


# Dtypes an accelerator reduces directly (`aminmax` exact, `mean` in float32).
_REDUCED_AS_THEY_ARE = frozenset({"torch.float32", "torch.bfloat16", "torch.float16"})


def _float_view(tensor: torch.Tensor) -> torch.Tensor:
    """The float32 values of a tensor of another dtype (a float32 one is used
    as it is, tested by the caller on its description)."""
    if tensor.is_complex():
        return tensor.abs().float()
    return tensor.float()


def _counts(source: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """NaN and Inf counts of a tensor's values (its float32 view where it has one)."""
    return torch.isnan(source).sum(), torch.isinf(source).sum()


def _flagged(tensor: torch.Tensor, low: float, high: float) -> bool:
    """Whether min or max shows a NaN or an Inf (only a float or complex tensor can)."""
    return not (_isfinite(low) and _isfinite(high)) and (tensor.is_floating_point() or tensor.is_complex())


def on_host(tensor: torch.Tensor) -> bool:
    return tensor.is_cpu


def is_device_error(exc: BaseException) -> bool:
    """A CUDA (or other accelerator) error: sticky, and raised by whatever
    synchronises next, not by the kernel that caused it."""
    return isinstance(exc, getattr(torch, "AcceleratorError", ())) or (
        isinstance(exc, RuntimeError) and str(exc).startswith(("CUDA error", "XPU error")))


def fill_statistics(infos: list[TensorInfo]) -> "BaseException | None":
    """Sets `stats` or `stats_note` on each of `infos`; never raises. Returns
    the device error the transfer to the host raised, if any (the tensors
    then say `unavailable`): a fault of a kernel launched before."""
    if not infos:
        return None
    capturing: dict = {}
    deferred: list[tuple[TensorInfo, torch.Tensor, torch.Tensor, torch.Tensor]] = []
    for info in infos:
        try:
            tensor = info.tensor
            if info.requires_grad:  # else the reductions would join its autograd graph
                tensor = tensor.detach()
            reason = _skip_reason(info, tensor, capturing)
            if reason is not None:
                info.stats_note = reason
                continue
            if on_host(tensor):
                source = tensor if info.dtype == "torch.float32" else _float_view(tensor)
                low, high = torch.aminmax(source)
                mean = source.mean()  # in float32, as SGLang prints it (a float32 sum divided in double is not)
                low, high, mean = low.item(), high.item(), mean.item()
                # Finite bounds: no NaN and no Inf, nothing to count (the usual case).
                info.stats = (low, high, mean, *((0, 0) if _isfinite(low) and _isfinite(high)
                                                 else _host_counts(tensor, source)))
            else:
                source = tensor if info.dtype in _REDUCED_AS_THEY_ARE else _float_view(tensor)
                low, high = torch.aminmax(source)
                mean = source.mean(dtype=torch.float32)
                # stack promotes a bfloat16 bound to the float32 of the mean: no launch of its own
                deferred.append((info, tensor, source, torch.stack([low, high, mean])))
        except Exception as exc:
            info.stats_note = f"unavailable: {type(exc).__name__}"
    return _transfer(deferred) if deferred else None


def _host_counts(tensor: torch.Tensor, source: torch.Tensor) -> tuple[int, int]:
    """NaN and Inf counts of a host tensor whose min or max is not finite."""
    if not (tensor.is_floating_point() or tensor.is_complex()):
        return 0, 0
    nans, infs = _counts(source)
    return int(nans.item()), int(infs.item())


def _host_values(entries: list, what: int, faults: list) -> "list[float] | None":
    """The device scalars of `entries` (element `what` of each) in one copy, or
    None after marking them all unavailable (a device error kept in `faults`)."""
    try:
        return torch.cat([entry[what] for entry in entries]).tolist()
    except Exception as exc:
        for entry in entries:
            entry[0].stats_note = f"unavailable: {type(exc).__name__}"
        if is_device_error(exc):
            faults.append(exc)
        return None


def _transfer(deferred: list) -> "BaseException | None":
    by_device: dict = {}
    faults: list = []
    for entry in deferred:
        by_device.setdefault(entry[3].device, []).append(entry)
    for entries in by_device.values():
        flat = _host_values(entries, 3, faults)
        if flat is None:
            continue
        counted = []
        for index, (info, tensor, source, _) in enumerate(entries):
            low, high, mean = flat[3 * index : 3 * index + 3]
            info.stats = (low, high, mean, 0, 0)
            if _flagged(tensor, low, high):
                try:
                    counted.append((info, torch.stack(_counts(source)).float()))
                except Exception as exc:
                    info.stats, info.stats_note = None, f"unavailable: {type(exc).__name__}"
        counts = _host_values(counted, 1, faults) if counted else None
        for index, (info, _) in enumerate(counted):
            if counts is None:
                info.stats = None
            else:
                info.stats = (*info.stats[:3], int(counts[2 * index]), int(counts[2 * index + 1]))
    return faults[0] if faults else None


def has_nan(info: TensorInfo) -> bool:
    return info.stats is not None and info.stats[3] > 0


def has_inf(info: TensorInfo) -> bool:
    return info.stats is not None and info.stats[4] > 0


def nonfinite_rows(info: TensorInfo) -> "list[int] | None":
    """The indices along its leading dimension of the rows of a tensor that
    hold NaN or Inf: asked only of one whose statistics already counted some,
    so a clean tensor never pays for it (one more pass and, on a GPU, one
    synchronisation, for a flagged one). None for a 0-d tensor, or one the
    reduction fails on."""
    tensor = info.tensor
    try:
        if tensor.dim() == 0:
            return None
        tensor = tensor.detach()
        source = tensor if info.dtype == "torch.float32" else _float_view(tensor)
        finite = torch.isfinite(source.reshape(source.shape[0], -1)).all(dim=1)
        return torch.nonzero(~finite).flatten().tolist()
    except Exception:
        return None


def finite_rows(tensor: torch.Tensor, rows: int, flags: torch.Tensor, slot: int, column: int) -> None:
    """Whether each of `rows` rows of `tensor` (its elements split evenly)
    is all finite, written into `flags[slot, column:column + rows]` (a
    contiguous bool tensor on the tensor's device) with nothing read back
    from a device (the NaN flags, capture/nan_flags.py). A contiguous CPU
    tensor of a common floating type: its memory scanned by the compiled
    core (no torch dispatch, no view made). On an accelerator `isfinite`
    then `all`: two kernels. Any other CPU tensor: the difference of the
    tensor with itself summed (0 for finite values, NaN for NaN and either
    Inf, exact in every floating type), as `isfinite` is slow there (42 us
    for 4x4096 float32 against 9.5)."""
    if tensor.is_cpu:
        kind = _SCANNED.get(tensor.dtype) if core.native is not None else None
        if kind is not None and tensor.is_contiguous():
            core.native.finite_rows(tensor.data_ptr(), tensor.numel(), kind, rows,
                                    flags.data_ptr() + slot * flags.stride(0) + column)
            return
        grouped = tensor.reshape(rows, -1)
        torch.eq((grouped - grouped).sum(1), 0, out=flags[slot, column:column + rows])
    else:
        torch.all(torch.isfinite(tensor.reshape(rows, -1)), dim=1, out=flags[slot, column:column + rows])


# The floating types the compiled core scans, by their element's code there (native/finite.c).
_SCANNED = {torch.float16: 2, torch.bfloat16: 3, torch.float32: 4, torch.float64: 8}
