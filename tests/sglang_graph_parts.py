"""SGLang's decode CUDA graph runner and its graph backend (the published
wheel's classes), replaying a graph on the CPU, for tests/test_sglang_real.py:

    python sglang_graph_parts.py REPLAYS [kill]

A real CUDA graph needs a GPU, so the graph is a stand-in with CUDAGraph's
`capture_begin` / `capture_end` / `replay`, recorded through the package's
seam (capture/graphs.py: record_graph_class); it is captured as
`torch.cuda.graph` captures (the capturing flag patched on), with kernels
under SGLang's own `debug_kernel_api`. SGLang's own `DecodeCudaGraphRunner.execute`
then replays it through SGLang's own `FullCudaGraphBackend.replay`, once per
step; only what needs a model or a GPU is set on the runner by hand (its
attention backend, its model runner, the batch loading). With `kill`, the
last replay is killed from inside (SIGKILL), as an illegal memory access
takes a server down.
"""

import contextlib
import os
import signal
import sys
import types

import torch

from sglang.kernels.kernel_api_logging import debug_kernel_api
from sglang.srt.layers.logits_processor import LogitsProcessorOutput
from sglang.srt.model_executor.forward_batch_info import ForwardMode
from sglang.srt.model_executor.runner.decode_cuda_graph_runner import DecodeCudaGraphRunner
from sglang.srt.model_executor.runner_backend.full_cuda_graph_backend import FullCudaGraphBackend
from sglang_otel_kernels.capture.graphs import record_graph_class
from stand_in_graph import StandInGraph, capturing


@debug_kernel_api
def rmsnorm(x, weight):
    return x * weight


@debug_kernel_api
def lm_head(x, weight):
    return x @ weight


def main() -> int:
    replays = int(sys.argv[1])
    record_graph_class(StandInGraph)
    graph = StandInGraph()
    if sys.argv[2:] == ["kill"]:
        graph.at, graph.then = replays, lambda: os.kill(os.getpid(), signal.SIGKILL)
    hidden, weight, head = torch.ones(2, 8), torch.ones(8), torch.ones(8, 16)
    with capturing():
        graph.capture_begin()
        logits = lm_head(rmsnorm(hidden, weight), head)
        graph.capture_end()

    key = (2, "decode")
    backend = FullCudaGraphBackend.__new__(FullCudaGraphBackend)
    backend._graphs, backend._outputs = {key: graph}, {key: LogitsProcessorOutput(next_token_logits=logits)}
    runner = DecodeCudaGraphRunner.__new__(DecodeCudaGraphRunner)
    runner.backend, runner.is_dllm, runner.raw_num_token = backend, False, 2
    runner.model_runner = types.SimpleNamespace(device_timer=None, is_draft_worker=False)
    runner.model_context = contextlib.nullcontext
    runner._replay_attn_backend = lambda: None
    runner._resolve_shared_read_ends = lambda backend, mode: None
    runner.load_batch = lambda forward_batch, pp_proxy_tensors=None: setattr(runner, "_replay_graph_key", key)
    forward_batch = types.SimpleNamespace(batch_size=2, forward_mode=ForwardMode.DECODE, rids=["rid-a", "rid-b"])
    for _ in range(replays):
        output = runner.execute(forward_batch)
        assert output.next_token_logits.shape == (2, 16)
    print("replayed", graph.replays, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
