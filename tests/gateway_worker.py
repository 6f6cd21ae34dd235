"""One rank of one node, for the gateway tier's end-to-end test.

    python gateway_worker.py PLAN RANK

PLAN is a JSON list of requests [traceparent, kind, faulty rank]: for each,
this rank runs a batch of one (that request) with two kernels, so every
rank's spans of a request sit in its trace. On the faulty rank the first
kernel fails as `kind` says: `error` raises (the span is ERROR), `nan`
returns NaN (level 5 flags it), `crash` kills this process inside it
(SIGKILL: the sidecar exports the call in flight). Its sidecar exports
through the node's agent (OTEL_EXPORTER_OTLP_ENDPOINT)."""

import json
import os
import signal
import sys

import torch

import sglang_otel_kernels as sok


@sok.debug_kernel_api(op_name="layer.attn")
def attn(x, fault=None):
    if fault == "error":
        raise RuntimeError("CUDA error: device-side assert triggered (the test's fault)")
    if fault == "nan":
        return x * float("nan")
    if fault == "crash":
        os.kill(os.getpid(), signal.SIGKILL)
    return x * 1.0


@sok.debug_kernel_api(op_name="layer.mlp")
def mlp(x):
    return x + 1.0


def main() -> int:
    with open(sys.argv[1]) as handle:
        plan = json.load(handle)
    rank = int(sys.argv[2])
    for number, (traceparent, kind, faulty) in enumerate(plan):
        try:
            with sok.forward_batch([(traceparent, f"req-{number}")], name="decode_batch"):
                mlp(attn(torch.ones(4), fault=kind if rank == faulty else None))
        except RuntimeError:
            pass  # the request fails; the server goes on
    return 0


if __name__ == "__main__":
    sys.exit(main())
