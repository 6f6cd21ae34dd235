"""The SGLang integration on SGLang's own code: the published wheel
(tests/sglang-site.txt, installed with --no-deps into .cache/ by this module
and reused) runs a tokenizer and a scheduler process joined by a real ZMQ
socket (tests/sglang_server_parts.py), with SGLang's own tracing
(`process_tracing_init`, `TraceReqContext`), `TokenizedGenerateReqInput`,
`Req`, `ScheduleBatch`, `Scheduler.run_batch` body and a real
`ReplicatedLinear`, exporting over OTLP/gRPC to a receiver on loopback.
Stand-ins only for what needs a GPU: the model worker, the memory pools and
the scheduler's metrics and profiler collaborators."""

import json
import os
import subprocess
import sys
import time

import pytest

import sglang_otel_kernels as sok
from backends import port, wait
from otlp_receivers import GrpcReceiver

TESTS = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(TESTS)
sys.path.insert(0, os.path.join(ROOT, "bench"))
from sglang_wheel import install_sglang_site  # noqa: E402

PARTS = os.path.join(TESTS, "sglang_server_parts.py")
KERNEL = "sglang.quant_method.UnquantizedLinearMethod.apply"
NORM = "sglang_server_parts._Worker.__init__.rmsnorm"  # SGLang's name: module and qualified name
RIDS = ("r1", "r2", "bad3")


@pytest.fixture(scope="module")
def sglang_site():
    return install_sglang_site(os.path.join(TESTS, "sglang-site.txt"))


@pytest.fixture
def receiver():
    server = GrpcReceiver()
    yield server
    server.stop()


def _address() -> str:
    return f"tcp://127.0.0.1:{port()}"


def serve(site, receiver, tmp_path, *, pickle_ipc: bool = True, first: str = "none", level: int = 3):
    """Runs the scheduler and the tokenizer, each under the `run` launcher as
    the README starts a server; returns their (stdout, stderr) texts."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "OTEL_"))}
    env.update(PYTHONPATH=os.pathsep.join([site, ROOT]), SGLANG_TEST_OTLP_ENDPOINT=f"127.0.0.1:{receiver.port}",
               SGLANG_USE_PICKLE_IPC="1" if pickle_ipc else "0", SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    requests, done = _address(), _address()
    launcher = [sys.executable, "-m", "sglang_otel_kernels", "run", "--level", str(level), "--", sys.executable, PARTS]
    scheduler = subprocess.Popen([*launcher, "scheduler", requests, done, str(len(RIDS)), first], cwd=tmp_path,
                                 env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    tokenizer = subprocess.Popen([*launcher, "tokenizer", requests, done, ",".join(RIDS)], cwd=tmp_path, env=env,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outputs = [process.communicate(timeout=300) for process in (scheduler, tokenizer)]
    finally:
        for process in (scheduler, tokenizer):
            process.kill()
    assert scheduler.returncode == 0, outputs[0][1][-4000:]
    assert tokenizer.returncode == 0, outputs[1][1][-4000:]
    return outputs


def _trace_file(scheduler_stdout: str) -> str:
    [path] = [line.split(" ", 1)[1] for line in scheduler_stdout.splitlines() if line.startswith("tracefile ")]
    return path


def _roots(spans) -> dict:
    """rid -> SGLang's root span of that request (named ' Req <rid>')."""
    return {span["attributes"]["rid"]: span for span in spans if span["name"].strip().startswith("Req ")}


@pytest.mark.parametrize("pickle_ipc", [True, False], ids=["pickle-ipc", "msgpack-ipc"])
def test_kernels_land_in_sglangs_request_traces_across_the_zmq_hop(sglang_site, receiver, tmp_path, pickle_ipc):
    (scheduler_out, _), _ = serve(sglang_site, receiver, tmp_path, pickle_ipc=pickle_ipc)
    assert "failed bad3 RuntimeError" in scheduler_out
    spans = receiver.wait_for(lambda got: len(_roots(got)) == 3 and sum(s["name"] == KERNEL for s in got) == 2)
    roots = _roots(spans)
    by_name = {}
    for span in spans:
        by_name.setdefault(span["name"], []).append(span)

    # SGLang's own exporter carries SGLang's spans (tokenizer and scheduler side) and ours.
    assert len([s for s in spans if s["name"].startswith("Tokenizer")]) == 3
    assert len([s for s in spans if s["name"].startswith("Scheduler [TP 0]")]) == 3
    assert {s["resource"]["service.name"] for s in by_name[KERNEL]} == {"sglang"}

    # The batch of r1 and r2: its own trace, linked to both requests' real root spans.
    [pair] = [b for b in by_name["sglang.forward_batch"] if len(b["links"]) == 2]
    assert sorted(pair["links"]) == sorted((roots[r]["trace_id"], roots[r]["span_id"]) for r in ("r1", "r2"))
    assert pair["attributes"]["sglang.batch.request_ids"] == ("r1", "r2")
    # Each request trace gets a span back, under its root.
    back = by_name["sglang.forward_batch.request"]
    assert sorted((s["trace_id"], s["parent_span_id"]) for s in back) == sorted(
        (roots[r]["trace_id"], roots[r]["span_id"]) for r in ("r1", "r2"))
    # The batch of one request sits in that request's trace.
    [single] = [b for b in by_name["sglang.forward_batch"] if b is not pair]
    assert (single["trace_id"], single["parent_span_id"]) == (roots["bad3"]["trace_id"], roots["bad3"]["span_id"])
    # Kernels are children of their batch; the failing one is an ERROR span.
    kernels = {k["parent_span_id"]: k for k in by_name[KERNEL]}
    assert set(kernels) == {pair["span_id"], single["span_id"]}
    assert sorted(k["parent_span_id"] for k in by_name[NORM]) == sorted(kernels)
    assert kernels[pair["span_id"]]["status"] == 0 and kernels[single["span_id"]]["status"] == 2
    assert kernels[pair["span_id"]]["attributes"]["sglang.kernel.input.arg1.shape"] == (2, 8)
    assert "mat1 and mat2 shapes cannot be multiplied" in kernels[single["span_id"]]["status_message"]

    # The scheduler's trace file holds SGLang's spans of that process and ours, with their ids.
    contents = sok.read_trace_file(_trace_file(scheduler_out))
    assert contents.problems == []
    in_file = {(s.name, s.trace_id, s.span_id) for s in contents.spans}
    exported = {(s["name"], s["trace_id"], s["span_id"]) for s in spans if s["name"] in (KERNEL, NORM)
                or s["name"].startswith(("sglang.forward_batch", "Scheduler [TP 0]"))}
    assert in_file == exported

    # The report names the request of the failed kernel.
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", _trace_file(scheduler_out)],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 1, report.stderr
    assert "Failed calls (1):" in report.stdout and "requests bad3" in report.stdout
    # SGLang's own logger module, imported by SGLang's layers, left no file of its own (LOGDEST=off).
    assert not (tmp_path / "off").exists()


@pytest.mark.parametrize("first", ["configure", "kernel"])
def test_whatever_runs_before_sglangs_tracing_init_sglangs_export_works(sglang_site, receiver, tmp_path, first):
    """`configure` or a recorded kernel before `process_tracing_init` (the run
    launcher before both): SGLang's provider is installed all the same, its
    exporter receives SGLang's spans and the kernel spans, and the trace file
    records SGLang's spans from then on."""
    (scheduler_out, _), _ = serve(sglang_site, receiver, tmp_path, first=first, level=1)
    spans = receiver.wait_for(lambda got: len(_roots(got)) == 3 and sum(s["name"] == KERNEL for s in got) == 2)
    assert len([s for s in spans if s["name"].startswith("Scheduler [TP 0]")]) == 3
    names = [s.name for s in sok.read_trace_file(_trace_file(scheduler_out)).spans]
    # A kernel run first has no request yet: it lies in the file (its own trace), not in SGLang's export.
    assert names.count(KERNEL) == (3 if first == "kernel" else 2)
    assert names.count("sglang.forward_batch") == 2
    assert sum(name.startswith("Scheduler [TP 0]") for name in names) == 3


def test_sglangs_group_coordinator_collectives_and_ranks_name_the_stuck_rank(sglang_site, tmp_path):
    """SGLang's own parallel state (GroupCoordinator on gloo) under the run
    launcher, two ranks whose ranks only SGLang's ParallelContext knows: its
    collectives are recorded and numbered alike on both, the ranks reach the
    trace files, and the report names the rank stuck in a kernel while the
    other waits in the all-reduce."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "OTEL_", "RANK", "WORLD_SIZE"))}
    env.update(PYTHONPATH=os.pathsep.join([sglang_site, ROOT]), SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    rendezvous = port()
    ranks = [subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels", "run", "--level", "1", "--", sys.executable,
                               os.path.join(TESTS, "sglang_ranks.py"), str(rank), "2", str(rendezvous)],
                              cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    coordinator = "srt.distributed.parallel_state.GroupCoordinator."
    try:
        def in_flight(rank):
            try:
                spans = sok.read_trace(tmp_path / f"trace_{ranks[rank].pid}.sgltrace")
            except sok.TraceFileError:
                return []
            return [s.name for s in spans if s.in_flight and "sglang.kernel.name" in s.attributes]

        wait("rank 1 stuck, rank 0 in the all-reduce", lambda: in_flight(1) == ["sglang_ranks.stuck"]
             and in_flight(0) == [coordinator + "all_reduce"], timeout=120)
        time.sleep(1.2)
        report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path), "--json",
                                 "--hang-seconds", "1"], capture_output=True, text=True, timeout=120)
        assert report.returncode == 1, report.stderr
        verdict = json.loads(report.stdout)["cross_rank"]
        assert verdict["verdict"].startswith("rank 1 is stuck in sglang_ranks.stuck (running ")
        # Steps 1 and 2 made four collectives each: the third all-reduce is the ninth.
        assert verdict["verdict"].endswith("and never entered all_reduce #9 of group world:0, which rank 0 waits in")
        for rank in range(2):
            contents = sok.read_trace_file(tmp_path / f"trace_{ranks[rank].pid}.sgltrace")
            assert {k: contents.metadata["ranks"][k] for k in ("rank", "world_size", "tp_rank", "attn_tp_rank")} == {
                "rank": rank, "world_size": 2, "tp_rank": rank, "attn_tp_rank": rank}
            collectives = [(s.name[len(coordinator):], s.attributes["sglang.collective.seq"]) for s in contents.spans
                           if "sglang.collective.op" in s.attributes]
            # Both ranks numbered the same collectives alike; SGLang's calls into torch.distributed are inside them.
            assert collectives[:4] == [("all_reduce", 1), ("all_gather", 2), ("barrier", 3), ("broadcast", 4)]
            assert not any(s.name.startswith("torch.distributed.") for s in contents.spans)
            p2p = [s for s in contents.spans if s.attributes.get("sglang.collective.op") in ("send", "recv")]
            assert [s.attributes["sglang.collective.peer"] for s in p2p] == [1 - rank, 1 - rank]
    finally:
        for process in ranks:
            process.kill()
            process.communicate(timeout=60)


@pytest.mark.parametrize("ending", ["exit", "kill"])
def test_sglangs_graph_runner_replays_carry_their_batch_and_a_crash_names_the_graphs_kernels(sglang_site, tmp_path,
                                                                                              ending):
    """SGLang's own DecodeCudaGraphRunner.execute and FullCudaGraphBackend.replay
    replay a graph (a stand-in: CUDA graphs need a GPU) under the run
    launcher: each replay is a span with the batch's size, forward mode and
    requests; killed inside the third, the report lists the graph's kernels."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "OTEL_"))}
    env.update(PYTHONPATH=os.pathsep.join([sglang_site, ROOT]), SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "run", "--level", "1", "--", sys.executable,
                           os.path.join(TESTS, "sglang_graph_parts.py"), "3", *(["kill"] if ending == "kill" else [])],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == (-9 if ending == "kill" else 0), proc.stderr[-3000:]
    [path] = tmp_path.glob("trace_*.sgltrace")
    replays = [s for s in sok.read_trace(path) if s.name == "cuda_graph.replay"]
    assert [s.attributes["sglang.cuda_graph.replay"] for s in replays] == [1, 2, 3]
    for replay in replays:
        assert (replay.attributes["sglang.batch.size"], replay.attributes["sglang.forward_mode"],
                replay.attributes["sglang.batch.request_ids"]) == (2, "DECODE", ("rid-a", "rid-b"))
        assert replay.attributes["sglang.cuda_graph.calls"] == 2
    assert replays[-1].in_flight is (ending == "kill")
    if ending == "kill":
        report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path)],
                                capture_output=True, text=True, timeout=120)
        assert report.returncode == 1, report.stderr
        crashed = report.stdout.split("CRASHED: 1 kernel call(s) were running when the process died:\n")[1]
        assert ("    replay 3 of CUDA graph 1 (DECODE, batch of 2): one of these 2 captured kernels:\n"
                "      1. sglang_graph_parts.rmsnorm  (2, 8), (8,)  torch.float32, torch.float32\n"
                "      2. sglang_graph_parts.lm_head  (2, 8), (8, 16)  torch.float32, torch.float32\n"
                "    batch cuda_graph.replay: requests rid-a, rid-b") in crashed


def test_sglangs_batches_give_each_requests_rows_for_nan_provenance(sglang_site):
    """forward_batch(rows=...) from SGLang's own ForwardMode: one row each in decode, the extend lengths in
    prefill, extend and mixed batches (running requests count one), unknown in speculative verification."""
    script = (
        "import types\n"
        "from sglang.srt.model_executor.forward_batch_info import ForwardMode\n"
        "from sglang_otel_kernels.integrations.sglang import _rows\n"
        "batch = lambda mode, lengths=None: types.SimpleNamespace(forward_mode=mode, extend_lens=lengths)\n"
        "print(repr([_rows(batch(ForwardMode.DECODE, [7, 7]), 2), _rows(batch(ForwardMode.EXTEND, [5, 1, 2]), 3),\n"
        "            _rows(batch(ForwardMode.MIXED, [5, 1, 1]), 3), _rows(batch(ForwardMode.TARGET_VERIFY, [4, 4]), 2),\n"
        "            _rows(batch(ForwardMode.IDLE), 0), _rows(batch(ForwardMode.EXTEND, [5]), 3), _rows(object(), 2)]))\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SGLANG_", "OTEL_"))}
    env["PYTHONPATH"] = os.pathsep.join([sglang_site, ROOT])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[[1, 1], [5, 1, 2], [5, 1, 1], None, None, None, None]"
