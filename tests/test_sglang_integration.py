"""The SGLang integration against SGLang's real logger module,
`sglang/kernels/kernel_api_logging.py` from the published wheel (downloaded
now, never committed), in a package tree beside stand-ins for the SGLang
modules that import it (a layer, a custom op, a quant method, a scheduler)."""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest

import sglang_otel_kernels as sok

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
sys.path.insert(0, BENCH)
from sglang_wheel import RegistryUnreachable, fetch_sglang_logger  # noqa: E402
from conftest import clean_env  # noqa: E402

K = "sglang.kernel."

LAYER = '''
import torch
from sglang.kernels.kernel_api_logging import debug_kernel_api, debug_torch_op, wrap_method_with_debug_kernel_once


@debug_kernel_api
def rmsnorm(x, weight, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def _silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.nn.functional.silu(x[..., :half]) * x[..., half:]


_lib = torch.library.Library("sglang", "FRAGMENT")
_lib.define("silu_and_mul(Tensor x) -> Tensor")
_lib.impl("silu_and_mul", _silu_and_mul, "CompositeExplicitAutograd")
silu_and_mul = debug_torch_op(_silu_and_mul, "silu_and_mul")


class UnquantizedLinearMethod:
    def apply(self, layer, x):
        return x @ layer


def linear(weight, x):
    method = UnquantizedLinearMethod()
    wrap_method_with_debug_kernel_once(method, "apply", op_name="sglang.quant_method.UnquantizedLinearMethod.apply")
    return method.apply(weight, x)
'''

# A stand-in for sglang.srt.managers.scheduler: the attribute names are SGLang's
# (Scheduler.run_batch(batch), batch.reqs, req.rid, req.time_stats.trace_ctx.root_span_context).
SCHEDULER = '''
import types
from sglang.srt.layers.norm import rmsnorm


class Scheduler:
    def __init__(self, fail=False):
        if fail:  # as a second rank fails on the CPU, in SGLang's PyNcclCommunicator
            raise ValueError("Expected a cuda device, but got: cpu")

    def run_batch(self, batch):
        return [rmsnorm(req.x, req.x.new_ones(req.x.shape[-1])) for req in batch.reqs]


def request(rid, x, root_span_context):
    trace_ctx = types.SimpleNamespace(root_span_context=root_span_context)
    return types.SimpleNamespace(rid=rid, x=x, time_stats=types.SimpleNamespace(trace_ctx=trace_ctx))
'''


@pytest.fixture(scope="module")
def sglang_tree(tmp_path_factory):
    download = tmp_path_factory.mktemp("sglang-wheel")
    try:
        logger, wheel = fetch_sglang_logger(str(download))
    except RegistryUnreachable as exc:
        pytest.skip(str(exc))
    tree = tmp_path_factory.mktemp("sglang-tree")
    for package in ("sglang", "sglang/kernels", "sglang/srt", "sglang/srt/layers", "sglang/srt/managers"):
        (tree / package).mkdir(parents=True, exist_ok=True)
        (tree / package / "__init__.py").write_text("")
    shutil.copy(logger, tree / "sglang/kernels/kernel_api_logging.py")
    (tree / "sglang/srt/layers/norm.py").write_text(LAYER)
    (tree / "sglang/srt/managers/scheduler.py").write_text(SCHEDULER)
    return tree, wheel


def launch(tree, tmp_path, script: str, *run_options: str, env: dict | None = None) -> subprocess.CompletedProcess:
    settings = env or {}
    env = clean_env()
    env.update(PYTHONPATH=str(tree), SGLANG_KERNEL_API_LOGDEST=str(tmp_path / "kernels.log"),
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    env.update(settings)
    (tmp_path / "app.py").write_text(textwrap.dedent(script))
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "run", *run_options, "--",
                           sys.executable, str(tmp_path / "app.py")],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)


def test_kernels_decorated_through_sglangs_import_path_produce_our_spans(sglang_tree, tmp_path):
    tree, wheel = sglang_tree
    proc = launch(tree, tmp_path, """
        import torch
        import sglang.kernels.kernel_api_logging as sglang_logging
        from sglang.srt.layers import norm
        import sglang_otel_kernels as sok
        from sglang_otel_kernels.capture import decorator
        assert sglang_logging.debug_kernel_api is decorator.debug_kernel_api
        norm.rmsnorm(torch.ones(2, 8), torch.ones(8))
        norm.silu_and_mul(torch.ones(2, 8))
        norm.linear(torch.ones(8, 4), torch.ones(2, 8))
        print(sok.trace_file_path())
    """, "--level", "3")
    assert proc.returncode == 0, f"{wheel}: {proc.stderr}"
    spans = sok.read_trace(proc.stdout.strip().splitlines()[-1])
    # SGLang's names: module path without "sglang.", the op named after its Python function, op_name as given.
    assert [s.name for s in spans] == ["srt.layers.norm.rmsnorm", "srt.layers.norm._silu_and_mul",
                                       "sglang.quant_method.UnquantizedLinearMethod.apply"]
    assert spans[0].attributes[K + "input.arg0.shape"] == (2, 8)
    assert spans[1].attributes[K + "output.shape"] == (2, 4)
    assert spans[2].attributes[K + "input.arg0.shape"] == (8, 4)
    # SGLang's text log, written once per call, by us.
    log = (tmp_path / "kernels.log").read_text()
    assert log.count("SGLang Kernel API Call: srt.layers.norm.rmsnorm") == 1
    assert "Positional input arguments:\n  arg[0]=Tensor(\n      shape=(2, 8)" in log


def test_batches_attach_kernels_to_sglangs_request_traces(sglang_tree, tmp_path):
    tree, _ = sglang_tree
    proc = launch(tree, tmp_path, """
        import torch, types
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        # SGLang's --enable-trace installs its own SDK provider; kernel spans share it.
        trace.set_tracer_provider(TracerProvider())
        from sglang.srt.managers import scheduler
        import sglang_otel_kernels as sok
        tracer = trace.get_tracer("sglang server")
        roots = [tracer.start_span(f"Req {i}") for i in range(2)]
        batch = types.SimpleNamespace(reqs=[
            scheduler.request(f"rid-{i}", torch.ones(1, 4), trace.set_span_in_context(root))
            for i, root in enumerate(roots)])
        scheduler.Scheduler().run_batch(batch)
        for root in roots:
            root.end()
        print(" ".join(f"{r.get_span_context().trace_id}:{r.get_span_context().span_id}" for r in roots))
        print(sok.trace_file_path())
    """, "--level", "1")
    assert proc.returncode == 0, proc.stderr
    *_, root_ids, path = proc.stdout.strip().splitlines()
    roots = sorted(tuple(map(int, pair.split(":"))) for pair in root_ids.split())
    by_name = {}
    for span in sok.read_trace(path):
        by_name.setdefault(span.name, []).append(span)
    [batch] = by_name["sglang.forward_batch"]
    assert batch.attributes["sglang.batch.request_ids"] == ("rid-0", "rid-1")
    assert sorted((link[0], link[1]) for link in batch.links) == roots
    kernels = by_name["srt.layers.norm.rmsnorm"]
    assert len(kernels) == 2 and all(k.parent_span_id == batch.span_id for k in kernels)
    # Each request's trace holds a span that links back to the batch.
    requests = by_name["sglang.forward_batch.request"]
    assert sorted((r.trace_id, r.parent_span_id) for r in requests) == roots


# SGLang's overlap loop (Scheduler.event_loop_overlap, its default): a batch's results are processed
# a step later, from a copy of the batch (ScheduleBatch.copy) that shares its out_cache_loc.
OVERLAP_SCHEDULER = SCHEDULER + '''

def process_batch_result(self, batch, result):
    return result


def event_loop_overlap(self, batches):
    queue = []
    for batch in [*batches, None]:  # None: the server idle, its last batch's results processed then
        if batch is not None:
            result = self.run_batch(batch)
            queue.append((types.SimpleNamespace(reqs=batch.reqs[:], out_cache_loc=batch.out_cache_loc), result))
        if len(queue) > (batch is not None):
            self.process_batch_result(*queue.pop(0))


Scheduler.process_batch_result = process_batch_result
Scheduler.event_loop_overlap = event_loop_overlap
'''


def test_an_overlapped_schedulers_last_batch_ends_and_an_idle_kill_blames_no_request(sglang_tree, tmp_path):
    """On SGLang's real server a scheduler killed idle, seconds after its
    last request returned, was said to have died serving that request: the
    overlap loop processes a copy of each batch, and the last batch's span
    never ended."""
    tree, _ = sglang_tree
    overlapped = tmp_path / "tree"
    shutil.copytree(tree, overlapped)
    (overlapped / "sglang/srt/managers/scheduler.py").write_text(OVERLAP_SCHEDULER)
    proc = launch(overlapped, tmp_path, """
        import os, signal, torch, types
        from sglang.srt.managers import scheduler
        import sglang_otel_kernels as sok
        batches = [types.SimpleNamespace(reqs=[scheduler.request(f"done-ok-{i}", torch.ones(1, 4), None)],
                                         out_cache_loc=torch.zeros(1)) for i in range(3)]
        scheduler.Scheduler().event_loop_overlap(batches)
        print(sok.trace_file_path(), flush=True)
        os.kill(os.getpid(), signal.SIGKILL)  # idle: the OOM killer
    """, "--level", "1")
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = proc.stdout.strip().splitlines()[-1]
    batches = [span for span in sok.read_trace(path) if span.name == "sglang.forward_batch"]
    assert len(batches) == 3 and not any(span.in_flight for span in batches), batches
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert "died" in first and "with no kernel call or batch running" in first and "done-ok" not in first, first


# SGLang's embedding lookup (sglang.srt.layers.quantization.unquant, 0.5.23), and a scheduler whose step
# embeds its batch's tokens, flattened in request order: an extend batch with each request's extend_lens.
UNQUANT = '''
import torch


class UnquantizedEmbeddingMethod:
    def embedding(self, layer, input_):
        return torch.nn.functional.embedding(input_, layer.weight)
'''
EMBEDDING_SCHEDULER = SCHEDULER + '''
from sglang.srt.layers.quantization.unquant import UnquantizedEmbeddingMethod


def run_batch(self, batch):
    return UnquantizedEmbeddingMethod().embedding(self.embed_tokens, batch.input_ids)


Scheduler.run_batch = run_batch
'''


def test_a_batch_failed_on_one_requests_token_names_that_request_apart_from_the_others(sglang_tree, tmp_path):
    """Four traced requests in one prefill batch, one carrying token 99999
    beyond the vocabulary: the embedding raises IndexError for the whole
    batch. The report's first line names the request that carried the token
    apart from its batch mates, and in each request's trace the copy of the
    failed call says whose input it was: only the culprit's is marked."""
    tree, _ = sglang_tree
    culprit_tree = tmp_path / "tree"
    shutil.copytree(tree, culprit_tree)
    (culprit_tree / "sglang/srt/layers/quantization").mkdir()
    (culprit_tree / "sglang/srt/layers/quantization/__init__.py").write_text("")
    (culprit_tree / "sglang/srt/layers/quantization/unquant.py").write_text(UNQUANT)
    (culprit_tree / "sglang/srt/managers/scheduler.py").write_text(EMBEDDING_SCHEDULER)
    proc = launch(culprit_tree, tmp_path, """
        import torch, types
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())  # SGLang's --enable-trace
        from sglang.srt.managers import scheduler
        import sglang_otel_kernels as sok
        tracer = trace.get_tracer("sglang server")
        tokens = {"ok-0": [5, 6, 7], "ok-1": [8], "bad-2": [9, 99999, 10, 11], "ok-3": [12, 13]}
        roots = {rid: tracer.start_span(f"Req {rid}") for rid in tokens}
        mode = types.SimpleNamespace(is_decode=lambda: False, is_extend=lambda: True)
        batch = types.SimpleNamespace(
            reqs=[scheduler.request(rid, None, trace.set_span_in_context(root)) for rid, root in roots.items()],
            forward_mode=mode, extend_lens=[len(ids) for ids in tokens.values()],
            input_ids=torch.tensor([token for ids in tokens.values() for token in ids]))
        server = scheduler.Scheduler()
        server.embed_tokens = torch.nn.Embedding(32000, 4)
        try:
            server.run_batch(batch)
        except IndexError as exc:
            print("raised", exc)
        for root in roots.values():
            root.end()
        print(sok.trace_file_path())
    """, "--level", "1")
    assert proc.returncode == 0, proc.stderr
    assert "raised index out of range in self" in proc.stdout, proc.stdout
    path = proc.stdout.strip().splitlines()[-1]
    call, text = _failed_call_and_report(path, "sglang.quant_method.UnquantizedEmbeddingMethod.embedding")
    assert call.status_code == "ERROR" and call.attributes[K + "culprit_requests"] == ("bad-2",)
    assert call.attributes[K + "culprit"] == "id 99999 (row 5 of 10) is outside the 32000 rows of the embedding"
    first = text.stdout.splitlines()[0]
    assert first.startswith("the batch sglang.forward_batch (requests ok-0, ok-1, bad-2, ok-3) failed in "
                            "sglang.quant_method.UnquantizedEmbeddingMethod.embedding: IndexError"), first
    assert first.endswith("; request bad-2 caused it: id 99999 (row 5 of 10) is outside the 32000 rows of the "
                          "embedding"), first
    assert "  caused by request bad-2: id 99999" in text.stdout, text.stdout
    document = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--json", path],
                                         capture_output=True, text=True, timeout=120, env=clean_env()).stdout)
    [failed] = document["failed_batches"]
    assert failed["culprit"] == {"request_ids": ["bad-2"], "why": call.attributes[K + "culprit"]}
    assert document["verdict"]["headline"] == first
    # Each request's trace gets a copy of the failed call; only the culprit's copy says it was the cause.
    exported = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", path, "-o", "-"],
                                         capture_output=True, text=True, timeout=120, env=clean_env()).stdout)
    traces = {}
    for resource in exported["resourceSpans"]:
        for scope in resource["scopeSpans"]:
            for span in scope["spans"]:
                traces.setdefault(span["traceId"], []).append(span)
    [batch] = [span for span in sok.read_trace(path) if span.name == "sglang.forward_batch"]
    copies = {}
    for rid, (root, _, _) in zip(["ok-0", "ok-1", "bad-2", "ok-3"], batch.links):
        root = f"{root:032x}"
        [copy] = [span for span in traces[root] if span["name"] == call.name]
        copies[rid] = {item["key"]: item["value"] for item in copy["attributes"]}
    assert {rid: "boolValue" in attributes.get("sglang.request.culprit", {}) for rid, attributes in copies.items()} \
        == {"ok-0": False, "ok-1": False, "bad-2": True, "ok-3": False}, copies


def _failed_call_and_report(path: str, name: str) -> "tuple[object, subprocess.CompletedProcess]":
    """The one call named `name` of the trace file, and `report` of the file (a failure: exit status 1)."""
    [call] = [span for span in sok.read_trace(path) if span.name == name]
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    assert text.returncode == 1, text.stdout + text.stderr
    return call, text


# SGLang's sampler (sglang.srt.layers.sampler, 0.5.23: the top logprobs by torch's topk, k the batch's
# largest top_logprobs_num), and a scheduler whose decode step samples its batch's logits.
SAMPLER = '''
import torch


class Sampler(torch.nn.Module):
    def forward(self, logits_output, sampling_info, return_logprob, top_logprobs_nums, token_ids_logprobs, positions):
        logits = logits_output.next_token_logits
        if return_logprob:
            torch.log_softmax(logits, dim=-1).topk(max(top_logprobs_nums), dim=-1)
        return logits.argmax(dim=-1)
'''
SAMPLING_SCHEDULER = SCHEDULER + '''
import torch
from sglang.srt.layers.sampler import Sampler


def run_batch(self, batch):
    logits = types.SimpleNamespace(next_token_logits=torch.zeros(len(batch.reqs), 320))
    return Sampler()(logits, None, True, [req.top_logprobs_num for req in batch.reqs], None, None)


Scheduler.run_batch = run_batch
'''


def test_a_request_asking_more_top_logprobs_than_the_vocabulary_has_is_named_apart(sglang_tree, tmp_path):
    """A decode batch of three, one asking for 500 top logprobs of a
    320-token vocabulary: torch's topk fails the whole batch in the
    sampler; the report names that request, not its batch mates."""
    tree, _ = sglang_tree
    sampling_tree = tmp_path / "tree"
    shutil.copytree(tree, sampling_tree)
    (sampling_tree / "sglang/srt/layers/sampler.py").write_text(SAMPLER)
    (sampling_tree / "sglang/srt/managers/scheduler.py").write_text(SAMPLING_SCHEDULER)
    proc = launch(sampling_tree, tmp_path, """
        import torch, types
        from sglang.srt.managers import scheduler
        import sglang_otel_kernels as sok
        requests = []
        for rid, asked in (("ok-0", 2), ("greedy-1", 500), ("ok-2", 1)):
            requests.append(scheduler.request(rid, None, None))
            requests[-1].top_logprobs_num = asked
        mode = types.SimpleNamespace(is_decode=lambda: True, is_extend=lambda: False)
        try:
            scheduler.Scheduler().run_batch(types.SimpleNamespace(reqs=requests, forward_mode=mode))
        except RuntimeError as exc:
            print("raised", exc)
        print(sok.trace_file_path())
    """, "--level", "1")
    assert proc.returncode == 0, proc.stderr
    assert "raised selected index k out of range" in proc.stdout, proc.stdout
    call, text = _failed_call_and_report(proc.stdout.strip().splitlines()[-1], "srt.layers.sampler.Sampler.forward")
    assert call.attributes[K + "culprit_requests"] == ("greedy-1",)
    assert call.attributes[K + "culprit"] == ("top_logprobs_num 500 (row 1 of 3) is more than the 320 tokens of the "
                                              "vocabulary")
    first = text.stdout.splitlines()[0]
    assert first.startswith("the batch sglang.forward_batch (requests ok-0, greedy-1, ok-2) failed in "
                            "srt.layers.sampler.Sampler.forward: RuntimeError: selected index k out of range"), first
    assert first.endswith("; request greedy-1 caused it: top_logprobs_num 500 (row 1 of 3) is more than the 320 "
                          "tokens of the vocabulary"), first


def test_a_scheduler_that_fails_to_start_is_a_failure(sglang_tree, tmp_path):
    """SGLang's run_scheduler_process catches the exception of Scheduler(...),
    tells its parent and returns: the process ends normally, and its file
    names the failed start, its exception and where it was raised."""
    tree, _ = sglang_tree
    proc = launch(tree, tmp_path, """
        import torch
        from sglang.srt.managers import scheduler
        import sglang_otel_kernels as sok
        scheduler.Scheduler()  # a rank that starts
        try:
            scheduler.Scheduler(fail=True)
        except ValueError:
            pass  # as run_scheduler_process: logged, the parent told, then return
        print(sok.trace_file_path())
    """, "--level", "1")
    assert proc.returncode == 0, proc.stderr
    path = proc.stdout.strip().splitlines()[-1]
    inits = [span for span in sok.read_trace(path) if span.name == "sglang.scheduler.init"]
    assert [span.status_code for span in inits] == ["UNSET", "ERROR"]
    assert all(span.attributes["sglang.engine.stage"] == "init" for span in inits)
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path], capture_output=True,
                          text=True, timeout=120, env=clean_env())
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert first.startswith("the engine init sglang.scheduler.init failed in __init__ (scheduler.py:"), first
    assert first.endswith("ValueError: Expected a cuda device, but got: cpu"), first
    assert "  the engine's init stage" in text.stdout, text.stdout
    [failed] = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--json", path],
                                         capture_output=True, text=True, timeout=120, env=clean_env()).stdout
                          )["failed_batches"]
    assert failed["stage"] == "init" and failed["request_ids"] == [] and failed["frames"][0]["function"] == "__init__"


def test_install_and_uninstall_in_process(sglang_tree, monkeypatch):
    tree, _ = sglang_tree
    monkeypatch.syspath_prepend(str(tree))
    from sglang_otel_kernels.capture import decorator
    from sglang_otel_kernels.integrations import sglang as integration

    for name in [m for m in sys.modules if m == "sglang" or m.startswith("sglang.")]:
        monkeypatch.delitem(sys.modules, name)
    handle = integration.install()
    try:
        assert integration.install() is handle  # idempotent
        import sglang.kernels.kernel_api_logging as sglang_logging

        assert sglang_logging.debug_torch_op is decorator.debug_torch_op
    finally:
        integration.uninstall()
    assert sglang_logging.debug_kernel_api is not decorator.debug_kernel_api
    assert sglang_logging.debug_kernel_api.__module__ == "sglang.kernels.kernel_api_logging"


@pytest.mark.parametrize("destination", ["off", "kernels.log"])
def test_sglangs_logger_leaves_no_file_of_its_own(sglang_tree, tmp_path, destination):
    tree, _ = sglang_tree
    proc = launch(tree, tmp_path, """
        import os, torch
        from sglang.srt.layers import norm
        norm.rmsnorm(torch.ones(2, 8), torch.ones(8))
        print(sorted(os.listdir(".")))
    """, "--level", "1", env={"SGLANG_KERNEL_API_LOGDEST": destination})
    assert proc.returncode == 0, proc.stderr
    # SGLang's module opens its logger's file at import (`off` would be a file named "off"):
    # only our own files are there, the text log only when one was asked for.
    expected = {"app.py"} | ({"kernels.log"} if destination == "kernels.log" else set())
    files = set(os.listdir(tmp_path)) - {name for name in os.listdir(tmp_path) if ".sgltrace" in name}
    assert files == expected


def test_spans_of_a_provider_installed_before_the_first_kernel_are_in_the_trace_file(sglang_tree, tmp_path):
    """SGLang's process_tracing_init installs its provider and starts thread and request spans
    before any kernel runs (as a stand-in here: the same OpenTelemetry calls)."""
    tree, _ = sglang_tree
    proc = launch(tree, tmp_path, """
        import torch
        from opentelemetry import trace
        from opentelemetry.sdk.trace import TracerProvider
        trace.set_tracer_provider(TracerProvider())
        tracer = trace.get_tracer("sglang")
        thread_span = tracer.start_span("Scheduler thread")
        with tracer.start_as_current_span("Req 1a2b3c4d"):
            pass
        from sglang.srt.layers import norm
        import sglang_otel_kernels as sok
        with tracer.start_as_current_span("prefill_forward"):
            norm.rmsnorm(torch.ones(2, 8), torch.ones(8))
        thread_span.end()
        print(sok.trace_file_path())
    """, "--level", "1")
    assert proc.returncode == 0, proc.stderr
    contents = sok.read_trace_file(proc.stdout.strip().splitlines()[-1])
    assert [s.name for s in contents.spans] == ["Scheduler thread", "Req 1a2b3c4d", "prefill_forward",
                                                "srt.layers.norm.rmsnorm"]
    assert contents.problems == []
