"""The two processes of an SGLang server, run from SGLang's own modules
(the published wheel): `tokenizer` and `scheduler`, joined by a real ZMQ
socket and SGLang's own `sock_send`/`sock_recv` (SGLANG_USE_PICKLE_IPC picks
pickle or msgpack). Only the GPU-bound parts are stand-ins: the model worker
(its forward runs a real `ReplicatedLinear` on the CPU), the memory pools and
the scheduler's collaborators that `run_batch` touches.

    python sglang_server_parts.py tokenizer PUSH_ADDR DONE_ADDR RIDS
    python sglang_server_parts.py scheduler PULL_ADDR DONE_ADDR COUNT FIRST

FIRST (scheduler): what runs before SGLang's process_tracing_init: `none`,
`configure` (sglang_otel_kernels.configure), `kernel` (a decorated kernel).
The endpoint is SGLANG_TEST_OTLP_ENDPOINT. A request whose rid starts with
"bad" goes into a batch of its own whose kernel fails.
"""

from __future__ import annotations

import os
import sys
import types
import warnings
from array import array

import torch

warnings.simplefilter("ignore")  # SGLang warns that AWQ/GGUF need a GPU


def tokenizer(push: str, done: str, rids: str) -> None:
    import zmq
    from opentelemetry import trace

    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.io_struct import TokenizedGenerateReqInput, sock_send
    from sglang.srt.observability import trace as sglang_trace
    from sglang.srt.observability.req_time_stats import APIServerReqTimeStats
    from sglang.srt.sampling.sampling_params import SamplingParams

    sglang_trace.process_tracing_init(os.environ["SGLANG_TEST_OTLP_ENDPOINT"], "sglang")
    sglang_trace.trace_set_thread_info("Tokenizer")
    context = zmq.Context()
    sender, finished = context.socket(zmq.PUSH), context.socket(zmq.PULL)
    sender.connect(push)
    finished.bind(done)
    states = {}
    for rid in rids.split(","):
        # What TokenizerManager does for each request with --enable-trace.
        time_stats = APIServerReqTimeStats(disagg_mode=DisaggregationMode.NULL)
        time_stats.init_trace_ctx(rid, None, None)
        time_stats.set_created_time()
        states[rid] = time_stats
        request = TokenizedGenerateReqInput(
            rid=rid, input_text="hello", input_ids=array("q", [1, 2, 3]), input_embeds=None, mm_inputs=None,
            token_type_ids=None, sampling_params=SamplingParams(max_new_tokens=1), return_logprob=False,
            logprob_start_len=-1, top_logprobs_num=0, token_ids_logprob=None, stream=False)
        request.time_stats = time_stats
        request.wrap_pickle_fields()
        sock_send(sender, request)
    if not finished.poll(120_000) or finished.recv_string() != "done":
        sys.exit("tokenizer: the scheduler did not finish")
    for time_stats in states.values():
        time_stats.set_finished_time()
    root = {rid: ts.trace_ctx.root_span for rid, ts in states.items()}
    print("roots", ",".join(rid for rid in root), flush=True)
    trace.get_tracer_provider().shutdown()


class _Pool:
    """Stands for ReqToTokenPool / the KV allocator (GPU memory)."""

    device = "cpu"


class _Worker:
    """Stands for the model worker: its forward runs a real SGLang layer
    (whose quant method SGLang wraps with wrap_method_with_debug_kernel_once)
    and a function under SGLang's `debug_kernel_api`. (SGLang's
    `register_custom_op` registers its ops for the GPU's dispatch key only,
    so they cannot run here.)"""

    def __init__(self) -> None:
        from sglang.kernels.kernel_api_logging import debug_kernel_api
        from sglang.srt.layers.linear import ReplicatedLinear

        self.layer = ReplicatedLinear(8, 4, bias=False)
        with torch.no_grad():
            self.layer.weight.copy_(torch.arange(32, dtype=torch.float32).reshape(4, 8) / 32)

        @debug_kernel_api
        def rmsnorm(x, weight, eps=1e-6):
            return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight

        self.rmsnorm = rmsnorm

    def forward_batch_generation(self, batch, pp_proxy_tensors=None):
        from sglang.srt.managers.utils import GenerationBatchResult

        width = 7 if any(req.rid.startswith("bad") for req in batch.reqs) else 8  # bad: the kernel fails
        hidden = self.rmsnorm(torch.ones(len(batch.reqs), 8), torch.ones(8))
        self.layer(hidden[:, :width])
        return GenerationBatchResult(logits_output=None, can_run_cuda_graph=False)


def _scheduler_object():
    """A Scheduler with the attributes `run_batch` reads on the plain
    (non-overlap, non-speculative, non-disaggregated) generation path."""
    from sglang.srt.disaggregation.utils import DisaggregationMode
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    scheduler = object.__new__(Scheduler)
    settings = dict(
        metrics_reporter=types.SimpleNamespace(record_scheduler_active=lambda now: None),
        scheduler_stage_metrics=None, forward_ct=0, _sched_idled=False, processed_tokens_counter=0, scripted_scheduler_hook=None,
        profiler_manager=types.SimpleNamespace(_profile_batch_predicate=lambda batch: None),
        forward_sleep_time=None, disaggregation_mode=DisaggregationMode.NULL, is_generation=True,
        enable_overlap=False, enable_pdmux=False, spec_algorithm=SpeculativeAlgorithm.NONE,
        future_map=types.SimpleNamespace(spec_algo=SpeculativeAlgorithm.NONE), model_worker=_Worker(),
        enable_unified_cache_external_linker=False, attn_dp_enabled=False,
    )
    for name, value in settings.items():
        setattr(scheduler, name, value)
    return scheduler


def _batch(reqs):
    from sglang.srt.managers.schedule_batch import ScheduleBatch
    from sglang.srt.model_executor.forward_batch_info import ForwardMode
    from sglang.srt.speculative.spec_info import SpeculativeAlgorithm

    batch = ScheduleBatch.init_new(reqs, _Pool(), None, None, types.SimpleNamespace(vocab_size=32),
                                   enable_overlap=False, spec_algorithm=SpeculativeAlgorithm.NONE)
    batch.forward_mode = ForwardMode.DECODE
    batch.input_ids = torch.ones(len(reqs), dtype=torch.int64)  # what resolve_forward_inputs would gather
    return batch


def scheduler(pull: str, done: str, count: str, first: str) -> None:
    import zmq

    if first == "configure":
        import sglang_otel_kernels as sok

        sok.configure(level=int(os.environ.get("SGLANG_KERNEL_API_LOGLEVEL", "1")))
    elif first == "kernel":
        _Worker().layer(torch.ones(1, 8))

    from sglang.srt.managers.io_struct import sock_recv
    from sglang.srt.managers.schedule_batch import Req
    from sglang.srt.observability import trace as sglang_trace

    sglang_trace.process_tracing_init(os.environ["SGLANG_TEST_OTLP_ENDPOINT"], "sglang")
    sglang_trace.trace_set_thread_info("Scheduler", tp_rank=0)
    from sglang.srt.runtime_context import get_context
    from sglang.srt.server_args import ServerArgs

    get_context().set_server_args(ServerArgs(model_path="stand-in", device="cpu", enable_trace=True))
    scheduler = _scheduler_object()
    context = zmq.Context()
    receiver, finished = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    receiver.bind(pull)
    finished.connect(done)
    reqs = []
    for _ in range(int(count)):
        received = sock_recv(receiver)
        received.unwrap_pickle_fields()  # as the scheduler's request receiver does
        reqs.append(Req(received.rid, received.input_text, received.input_ids, received.sampling_params,
                        time_stats=received.time_stats))
    good = [req for req in reqs if not req.rid.startswith("bad")]
    bad = [req for req in reqs if req.rid.startswith("bad")]
    scheduler.run_batch(_batch(good))
    for req in bad:
        try:
            scheduler.run_batch(_batch([req]))
        except RuntimeError as exc:
            print("failed", req.rid, type(exc).__name__, flush=True)
    for req in reqs:
        req.time_stats.trace_ctx.abort()  # ends this process's thread spans of the request
    from opentelemetry import trace

    import sglang_otel_kernels as sok

    print("tracefile", sok.trace_file_path(), flush=True)
    trace.get_tracer_provider().shutdown()
    finished.send_string("done")


if __name__ == "__main__":
    role, *arguments = sys.argv[1:]
    {"tokenizer": tokenizer, "scheduler": scheduler}[role](*arguments)
