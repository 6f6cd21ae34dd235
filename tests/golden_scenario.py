"""The calls behind tests/golden/level{1,3,5}.log, written from SGLang's format.

`run(debug_kernel_api)` takes the decorator as a parameter so the same calls
can be made through SGLang's own logger when comparing by hand.
"""

import torch


def run(debug_kernel_api):
    @debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
    def rmsnorm(x, weight, eps=1e-6, residual=None):
        return x * weight

    class Attention:
        @debug_kernel_api
        def forward(self, q, layer_ids, *, meta=None):
            return (q, 2)

    @debug_kernel_api(op_name="fail_kernel")
    def failing(t):
        raise ValueError("index 7 out of range")

    x = torch.tensor([[1.0, -2.0], [3.0, 4.0]])
    w = torch.tensor([0.5, 2.0])
    rmsnorm(x, w, eps=1e-5, residual=torch.empty(0, 2))
    Attention().forward(
        torch.tensor([1, 2, 3]),
        [0, 1, [2, 3], 4, 5],
        meta={"mode": "decode", "flags": (True, None), "dtype": torch.bfloat16},
    )
    try:
        failing(torch.tensor([float("nan"), float("inf"), 1.0]))
    except ValueError:
        pass
