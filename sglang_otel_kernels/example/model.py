"""A tiny decoder step whose operations are decorated kernels, named as SGLang
names its own (a custom op, a quant method), so the traces read the same."""

from __future__ import annotations

import os
import time
from typing import Callable

import torch

from .. import debug_kernel_api

VOCAB, HIDDEN = 32, 8
# The last token id has an all-zero embedding: the norm (eps 0) divides zero by
# zero, so its batch's rmsnorm produces NaN from finite inputs and the NaN
# flows to the logits, as an overflow or a bad weight row does in a real model.
NAN_TOKEN = VOCAB - 1


def build_model(seed: int = 0, crash: bool = False) -> Callable[[torch.Tensor], torch.Tensor]:
    """Token ids [batch, length] -> logits [batch, length, VOCAB]. Call after
    `configure`: the kernels are decorated here, as an engine's layers are at import.
    An out-of-range token id makes the embedding kernel fail: an IndexError
    (a device-side assert on a GPU), or with `crash=True` the death of the
    process by SIGABRT 50 ms into the call, as an illegal memory access
    takes a server down when the host waits for the device.
    NAN_TOKEN makes NaN (visible at level 5)."""

    @debug_kernel_api(op_name="sglang.custom_op.embedding")
    def embedding(token_ids: torch.Tensor, table: torch.Tensor) -> torch.Tensor:
        if crash and int(token_ids.max()) >= table.shape[0]:
            # A GPU reports the fault when the host next waits for it, after
            # the work queued before: the call blocks a moment, then dies.
            time.sleep(0.05)
            os.abort()
        return torch.nn.functional.embedding(token_ids, table)

    @debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
    def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

    @debug_kernel_api(op_name="sglang.quant_method.UnquantizedLinearMethod.apply")
    def linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x @ weight.t()

    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(VOCAB, HIDDEN, generator=generator)
    table[NAN_TOKEN] = 0.0
    norm_weight = torch.ones(HIDDEN)
    head = torch.randn(VOCAB, HIDDEN, generator=generator)

    def decode_step(token_ids: torch.Tensor) -> torch.Tensor:
        return linear(rmsnorm(embedding(token_ids, table), norm_weight, eps=0.0), head)

    return decode_step
