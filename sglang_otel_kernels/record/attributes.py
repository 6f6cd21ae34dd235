"""Span attributes from described values (schema in docs/span-schema.md).

A value at PATH (`input.arg0`, `input.<keyword>`, `output`, items extending
the path) becomes `sglang.kernel.PATH` for a plain value, or
`sglang.kernel.PATH.<field>` for each tensor field.
"""

from __future__ import annotations

import math

from ..descriptions import REPR_LIMIT, Elided, Mapping, Opaque, Scalar, Sequence, TensorInfo
from ..schema import PREFIX
from ..text import utf8


_TENSOR_FIELDS = (
    ".shape",
    ".dtype",
    ".device",
    ".stride",
    ".contiguous",
    ".requires_grad",
    ".min",
    ".max",
    ".mean",
    ".nan_count",
    ".inf_count",
    ".has_nan",
    ".has_inf",
    ".stats",
)
_INT64 = (-(2**63), 2**63 - 1)
_isfinite = math.isfinite
_key_cache: dict[str, tuple[str, ...]] = {}
_KEY_CACHE_LIMIT = 4096


def _tensor_keys(path: str) -> tuple[str, ...]:
    keys = _key_cache.get(path)
    if keys is None:
        base = PREFIX + path
        keys = tuple(base + field for field in _TENSOR_FIELDS)
        # Paths come from argument positions and names, so they repeat; dict
        # keys could be anything, hence the bound.
        if len(_key_cache) < _KEY_CACHE_LIMIT:
            _key_cache[path] = keys
    return keys


def _text(text: str) -> str:
    """Cut to REPR_LIMIT and made encodable: a lone surrogate would make the
    OTLP exporter fail the whole batch it sits in."""
    return utf8(text[:REPR_LIMIT])


def number(value: float):
    """A float attribute, or for NaN and infinities the text `nan`, `inf`,
    `-inf`: Jaeger's query API cannot write a non-finite number as JSON and
    answers 500 for the whole trace, the very trace that holds the NaN."""
    if _isfinite(value):
        return value
    return "nan" if value != value else "inf" if value > 0 else "-inf"


def _primitive(node: Scalar):
    value = node.value
    kind = type(value)
    if kind is bool:
        return value
    if kind is float:
        return number(value)
    if kind is int:
        # OTLP carries int64; a larger Python int would fail the export.
        return value if _INT64[0] <= value <= _INT64[1] else _text(node.text)
    if kind is str:
        return _text(value)
    return _text(node.text)


def add_value(attrs: dict, path: str, node, with_stats: bool, nonfinite: list, meta: bool = True) -> None:
    """Adds the attributes of `node` at `path`; tensors holding NaN/Inf append
    their path to `nonfinite`. With `meta=False` only the statistics are added
    (a call's start record already holds the rest)."""
    if isinstance(node, TensorInfo):
        keys = _tensor_keys(path)
        if meta:
            attrs[keys[0]] = node.shape
            attrs[keys[1]] = node.dtype
            attrs[keys[2]] = node.device
            if node.stride is not None:
                attrs[keys[3]] = node.stride
            attrs[keys[4]] = node.contiguous
            attrs[keys[5]] = node.requires_grad
        if with_stats:
            if node.stats is not None:
                low, high, mean, nans, infs = node.stats
                # One test for the usual case: a finite sum means all three are
                # finite (NaN and Inf propagate; a sum that overflows tests all).
                if not _isfinite(low + high + mean):
                    low, high, mean = number(low), number(high), number(mean)
                attrs[keys[6]] = low
                attrs[keys[7]] = high
                attrs[keys[8]] = mean
                attrs[keys[9]] = nans
                attrs[keys[10]] = infs
                attrs[keys[11]] = nans > 0
                attrs[keys[12]] = infs > 0
                if nans or infs:
                    nonfinite.append(path)
            elif node.stats_note is not None:
                attrs[keys[13]] = node.stats_note
        return
    key = PREFIX + path
    if isinstance(node, Sequence):
        if meta:
            attrs[key] = f"{'list' if node.is_list else 'tuple'}[{len(node.items) + node.more}]"
        for index, item in enumerate(node.items):
            add_value(attrs, f"{path}.{index}", item, with_stats, nonfinite, meta)
    elif isinstance(node, Mapping):
        if meta:
            attrs[key] = f"dict[{len(node.items) + node.more}]"
        for _, part, item in node.items:
            add_value(attrs, f"{path}.{_text(part)}", item, with_stats, nonfinite, meta)
    elif not meta:
        return
    elif isinstance(node, Scalar):
        attrs[key] = _primitive(node)
    elif isinstance(node, Elided):
        attrs[key] = f"{node.type_name}(...)"
    elif isinstance(node, Opaque):
        if node.fields:
            inner = ", ".join(f"{name}={text}" for name, text in node.fields)
            attrs[key] = _text(f"{node.type_name}({inner})")
        else:  # what identifies it, never its repr: bounded on every call
            attrs[key] = _text(node.identity)


def fit(attrs: dict, room: int) -> tuple[dict, int]:
    """Keeps the first `room` attributes (the call's identity comes first) and
    says how many were left out, so the SDK never evicts one silently."""
    if len(attrs) <= room:
        return attrs, 0
    kept = dict(list(attrs.items())[: max(room, 0)])
    return kept, len(attrs) - len(kept)
