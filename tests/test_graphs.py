"""CUDA graphs on the CPU: a real CUDAGraph needs CUDA, so the package's seam
(capture/graphs.py: `record_graph_class`) points the recording at a stand-in
class with CUDAGraph's `capture_begin` / `capture_end` / `replay`, and
`torch.cuda.is_current_stream_capturing` is patched on while it captures, as
it is on a GPU. Real processes: captures and replays into trace files, a
process killed inside a replay, an asynchronous device error after one, a
real OTLP receiver for the sidecar."""

import json
import os
import signal
import subprocess
import sys

import pytest

import sglang_otel_kernels as sok
from conftest import run_python
from otlp_receivers import GrpcReceiver
from test_html_report import _chromium

TESTS = os.path.dirname(os.path.abspath(__file__))

APP = """
import os, signal, sys, torch
sys.path.insert(0, TESTS)
import sglang_otel_kernels as sok
from sglang_otel_kernels.capture.graphs import record_graph_class
from stand_in_graph import StandInGraph, capturing
CONFIGURE

@sok.debug_kernel_api(op_name="layer.attn")
def attn(x, w):
    return x @ w

@sok.debug_kernel_api(op_name="layer.mlp")
def mlp(x, scale=1.0):
    return x * scale

def capture(graph, hidden=4):
    x, w = torch.ones(2, hidden), torch.ones(hidden, hidden)
    with capturing():
        graph.capture_begin()
        out = mlp(attn(x, w), scale=2.0)
        out = mlp(out)
        graph.capture_end()
    return out

def poison(check, poisoned):  # what a replay's captured kernels write on the GPU: its NaN check's flags, summarised
    check.flags.zero_()
    check.flags[1] = poisoned  # position 2: the first layer.mlp
    start, count = check.rows[2]
    check.flags[start + 1] = poisoned  # its output's second row: the batch's second request
    check.summarise()  # the summary's kernels, captured at the capture's end, run after them

carriers = [("00-" + "a1" * 16 + "-" + "b1" * 8 + "-01", "req-1"), ("00-" + "a2" * 16 + "-" + "b2" * 8 + "-01", "req-2")]
record_graph_class(StandInGraph)
"""


def _app(body: str, level: int = 1, **settings) -> str:
    values = ", ".join(f"{k}={v!r}" for k, v in {"level": level, "log_dest": "off", "trace_file": "t.sgltrace",
                                                   **settings}.items())
    return APP.replace("TESTS", repr(TESTS)).replace("CONFIGURE", f"sok.configure({values})") + body


def _replays(spans) -> list:
    return [s for s in spans if s.name == "cuda_graph.replay"]


@pytest.mark.parametrize("level", [1, 3])
def test_a_capture_marks_its_calls_and_keeps_its_call_list_and_each_replay_is_a_span(tmp_path, level):
    proc = run_python(_app("first, second = StandInGraph(), StandInGraph()\n"
                           "capture(first); capture(second, hidden=8)\n"
                           "mlp(torch.ones(3))  # after the capture: an eager call, not in any graph\n"
                           "for _ in range(3): first.replay()\n"
                           "second.replay()\n", level=level), tmp_path)
    assert proc.returncode == 0, proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert contents.graphs == {
        1: ((("layer.attn", ("(2, 4)", "(4, 4)"), ("torch.float32", "torch.float32")),
             ("layer.mlp", ("(2, 4)",), ("torch.float32",)), ("layer.mlp", ("(2, 4)",), ("torch.float32",))), 0),
        2: ((("layer.attn", ("(2, 8)", "(8, 8)"), ("torch.float32", "torch.float32")),
             ("layer.mlp", ("(2, 8)",), ("torch.float32",)), ("layer.mlp", ("(2, 8)",), ("torch.float32",))), 0)}
    kernels = [s for s in contents.spans if s.name.startswith("layer.")]
    marks = [(s.attributes.get("sglang.cuda_graph.id"), s.attributes.get("sglang.cuda_graph.position")) for s in kernels]
    assert marks == [(1, 1), (1, 2), (1, 3), (2, 1), (2, 2), (2, 3), (None, None)]
    # Captured: no statistics and no touching of the data, at any level (the capturing flag is on).
    assert all("sglang.kernel.input.arg0.min" not in s.attributes for s in kernels)
    replays = _replays(contents.spans)
    assert [(r.attributes["sglang.cuda_graph.id"], r.attributes["sglang.cuda_graph.replay"],
             r.attributes["sglang.cuda_graph.calls"]) for r in replays] == [(1, 1, 3), (1, 2, 3), (1, 3, 3), (2, 1, 3)]
    assert all(not r.in_flight and r.status_code == "UNSET" for r in replays)


def test_the_call_list_is_still_readable_after_fifty_wraps_of_a_small_ring(tmp_path):
    proc = run_python(_app("graph = StandInGraph(); capture(graph)\n"
                           "from sglang_otel_kernels.record.processor import current_writer\n"
                           "while current_writer().wraps < 50:\n"
                           "    mlp(torch.ones(1))\n"
                           "graph.replay()\n"
                           "print(current_writer().wraps)\n", trace_file_size=64 * 1024), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert int(proc.stdout) >= 50
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert [name for name, _, _ in contents.graphs[1][0]] == ["layer.attn", "layer.mlp", "layer.mlp"]
    # The capture's own records are long gone; the table every lap starts with kept the graph.
    assert not any(s.attributes.get("sglang.cuda_graph.position") for s in contents.spans)
    [replay] = _replays(contents.spans)
    assert replay.attributes["sglang.cuda_graph.calls"] == 3


@pytest.mark.parametrize("how", ["sigkill", "abort"])
def test_a_process_killed_inside_a_replay_reports_the_replay_with_its_graphs_kernels(tmp_path, how):
    death = "lambda: os.kill(os.getpid(), signal.SIGKILL)" if how == "sigkill" else "os.abort"
    proc = run_python(_app(f"graph = StandInGraph(); capture(graph)\n"
                           f"graph.at, graph.then = 3, {death}\n"
                           "for _ in range(3):\n"
                           "    with sok.forward_batch(carriers, name='decode_batch'):\n"
                           "        graph.replay()\n"), tmp_path)
    assert proc.returncode == (-signal.SIGKILL if how == "sigkill" else -signal.SIGABRT), proc.stderr
    path = tmp_path / "t.sgltrace"
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path)], capture_output=True,
                          text=True, timeout=120)
    assert text.returncode == 1, text.stderr
    crashed = text.stdout.split("CRASHED: 1 kernel call(s) were running when the process died:\n")[1]
    assert crashed.startswith("  cuda_graph.replay  (pid ")
    assert ("    replay 3 of CUDA graph 1: one of these 3 captured kernels:\n"
            "      1. layer.attn  (2, 4), (4, 4)  torch.float32, torch.float32\n"
            "      2. layer.mlp  (2, 4)  torch.float32\n"
            "      3. layer.mlp  (2, 4)  torch.float32\n"
            "    batch decode_batch: requests req-1, req-2 (2 traces linked)") in crashed
    document = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path), "--json"],
                                         capture_output=True, text=True, timeout=120).stdout)
    [call] = document["in_flight"]
    assert (call["name"], call["graph"]["id"], call["graph"]["replay"], call["graph"]["role"]) == (
        "cuda_graph.replay", 1, 3, "replayed")
    assert [k["name"] for k in call["graph"]["calls"]] == ["layer.attn", "layer.mlp", "layer.mlp"]
    assert call["graph"]["calls"][0]["shapes"] == ["(2, 4)", "(4, 4)"]
    assert call["requests"]["request_ids"] == ["req-1", "req-2"]
    page = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 1, made.stderr
    dom = _chromium("--dump-dom", page.as_uri())
    [box] = dom.stdout.split('<div class="in-flight-call">')[1:]
    assert "replay 3 of CUDA graph 1: one of these 3 captured kernels:" in box and "3. layer.mlp  (2, 4)" in box


def test_a_process_that_died_while_a_replayed_graph_ran_on_the_gpu_reports_that_replay(tmp_path):
    # replay() only launches a graph: on a GPU it returns at once and the
    # process waits (or hangs) at a later synchronisation, where it is killed.
    proc = run_python(_app("graph = StandInGraph(); capture(graph)\n"
                           "for _ in range(2): graph.replay()\n"
                           "mlp(torch.ones(3))  # an eager call after it, ended: no proof the GPU finished\n"
                           "os.kill(os.getpid(), signal.SIGKILL)  # as in a hung synchronisation\n"), tmp_path)
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    path = tmp_path / "t.sgltrace"
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path)], capture_output=True,
                          text=True, timeout=120).stdout
    block = text.split("No kernel call was running when the file was last written, but a CUDA graph's kernels may "
                       "have been:\n")[1]
    assert block.startswith("  the process died ") and "s after this CUDA graph replay returned" in block
    assert ("      replay 2 of CUDA graph 1: one of these 3 captured kernels:\n"
            "        1. layer.attn  (2, 4), (4, 4)  torch.float32, torch.float32\n") in block
    document = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path), "--json"],
                                         capture_output=True, text=True, timeout=120).stdout)
    [call] = document["graph_replay_at_death"]
    assert (call["graph"]["id"], call["graph"]["replay"], len(call["graph"]["calls"])) == (1, 2, 3)
    assert 0 <= call["seconds_before_death"] < 60 and document["in_flight"] == []
    page = tmp_path / "report.html"
    subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(path), "--html", str(page)],
                   capture_output=True, text=True, timeout=120)
    dom = _chromium("--dump-dom", page.as_uri()).stdout
    assert "died after a CUDA graph replay" in dom
    [box] = dom.split('<div class="in-flight-call">')[1:]
    assert "replay 2 of CUDA graph 1: one of these 3 captured kernels:" in box
    # A process that exited normally: its last replay finished.
    clean = tmp_path / "clean"
    clean.mkdir()
    assert run_python(_app("graph = StandInGraph(); capture(graph); graph.replay()\n"), clean).returncode == 0
    ended = json.loads(subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(clean / "t.sgltrace"),
                                       "--json"], capture_output=True, text=True, timeout=120).stdout)
    assert ended["graph_replay_at_death"] == []


def test_the_sidecar_and_replay_export_the_replay_in_flight_with_its_graphs_kernels(tmp_path):
    receiver, replayed = GrpcReceiver(), GrpcReceiver()
    try:
        proc = run_python(_app("graph = StandInGraph(); capture(graph)\n"
                               "graph.at, graph.then = 2, lambda: os.kill(os.getpid(), signal.SIGKILL)\n"
                               "for _ in range(2): graph.replay()\n"), tmp_path,
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        assert proc.returncode == -signal.SIGKILL, proc.stderr
        in_flight = lambda got: [s for s in got if s["attributes"].get("sglang.kernel.in_flight")]  # noqa: E731
        exported = in_flight(receiver.wait_for(in_flight))
        sent = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", str(tmp_path / "t.sgltrace"),
                               "--endpoint", replayed.endpoint], capture_output=True, text=True, timeout=120)
        assert sent.returncode == 0, sent.stderr
        exported += in_flight(replayed.wait_for(in_flight))
    finally:
        receiver.stop()
        replayed.stop()
    assert len(exported) == 2  # the sidecar's, then replay's
    for replay in exported:
        assert replay["name"] == "cuda_graph.replay" and replay["status"] == 2
        assert replay["attributes"]["sglang.cuda_graph.replay"] == 2
        assert replay["attributes"]["sglang.cuda_graph.captured"] == (
            "layer.attn (2, 4), (4, 4)", "layer.mlp (2, 4)", "layer.mlp (2, 4)")


def test_replays_exported_in_process_carry_their_graph(tmp_path):
    receiver = GrpcReceiver()
    try:
        proc = run_python(_app("graph = StandInGraph(); capture(graph)\n"
                               "for _ in range(2): graph.replay()\n", export_sidecar=False), tmp_path,
                          env={"OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint})
        assert proc.returncode == 0, proc.stderr
        spans = receiver.wait_for(lambda got: len(_replays_of(got)) == 2)
    finally:
        receiver.stop()
    first, second = _replays_of(spans)
    for number, replay in enumerate((first, second), 1):
        assert {key: replay["attributes"].get(key) for key in ("sglang.cuda_graph.id", "sglang.cuda_graph.replay",
                                                                "sglang.cuda_graph.calls", "sglang.kernel.seq")} == {
            "sglang.cuda_graph.id": 1, "sglang.cuda_graph.replay": number, "sglang.cuda_graph.calls": 3,
            "sglang.kernel.seq": None}
    captured = [s for s in spans if s["name"] in ("layer.attn", "layer.mlp")]
    assert [s["attributes"]["sglang.cuda_graph.position"] for s in captured] == [1, 2, 3]


def _replays_of(exported: list) -> list:
    return sorted((s for s in exported if s["name"] == "cuda_graph.replay"),
                  key=lambda s: s["attributes"]["sglang.cuda_graph.replay"])


POISON = """
poisoned = []
graph = StandInGraph(); capture(graph)
graph.at, graph.then = 2, lambda: poisoned.append(True)

@sok.debug_kernel_api(op_name="sampler")
def sampler(x):
    if poisoned:  # the sticky asynchronous error the replay left, met at the next synchronisation
        raise RuntimeError("CUDA error: an illegal memory access was encountered")
    return x

for step in range(2):
    graph.replay()
    for _ in range(2):
        try:
            sampler(torch.ones(2))
        except RuntimeError:
            pass
"""


def test_an_asynchronous_error_after_a_replay_is_laid_at_that_replay(tmp_path):
    proc = run_python(_app(POISON), tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = sok.read_trace(tmp_path / "t.sgltrace")
    failed = [s for s in spans if s.name == "sampler" and s.status_code == "ERROR"]
    assert len(failed) == 2
    first, second = failed
    assert first.attributes["sglang.cuda_graph.suspect"] == "graph 1, replay 2"
    assert "the newest CUDA graph replay before it was replay 2 of graph 1, whose 3 captured kernels are the " \
           "likeliest culprits" in first.status_description
    # The next call that meets the sticky error is not blamed: it says where it was first seen.
    assert "first seen in sampler, after graph 1, replay 2" in second.status_description
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace")],
                            capture_output=True, text=True, timeout=120)
    block = report.stdout.split("Failed calls (2):\n")[1]
    assert "    first seen after replay 2 of CUDA graph 1: one of these 3 captured kernels:\n" \
           "      1. layer.attn  (2, 4), (4, 4)  torch.float32, torch.float32" in block


OUTPUTS = """
graph = StandInGraph(); out = capture(graph)
sok.watch_graph_outputs(graph, {"logits": out})
graph.replay()
graph.at, graph.then = 2, lambda: out.fill_(float("nan"))  # what the graph's kernels wrote this time
graph.replay()
"""


@pytest.mark.parametrize("level, check, flagged", [(5, "1", True), (5, "0", False), (3, "1", False)])
def test_the_output_check_flags_a_replay_that_made_nan(tmp_path, level, check, flagged):
    proc = run_python(_app(OUTPUTS, level=level), tmp_path, env={"SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK": check})
    assert proc.returncode == 0, proc.stderr
    first, second = _replays(sok.read_trace(tmp_path / "t.sgltrace"))
    if flagged:
        assert (first.attributes["sglang.kernel.has_nan"], first.attributes["sglang.kernel.has_inf"]) == (False, False)
        assert (second.attributes["sglang.kernel.has_nan"], second.attributes["sglang.kernel.has_inf"]) == (True, False)
    else:
        assert "sglang.kernel.has_nan" not in first.attributes and "sglang.kernel.has_nan" not in second.attributes


NAN_CHECK = """
graph = StandInGraph(); out = capture(graph)
check = graph._sglang_otel_kernels_graph.nan  # None when the check is off
def replayed(poisoned):
    if check is not None:
        poison(check, poisoned)
for number, poisoned in enumerate([False, True, False, True], 1):
    graph.at, graph.then = number, lambda poisoned=poisoned: replayed(poisoned)
    with sok.forward_batch(carriers, name="decode_batch"):
        graph.replay()
print(None if check is None else (check.flags[:4].tolist(), sorted(check.rows.items())))
"""


@pytest.mark.parametrize("level, check, named", [(5, "1", True), (5, "0", False), (3, "1", False)])
def test_the_nan_check_names_the_first_captured_call_that_made_nan_on_its_replay(tmp_path, level, check, named):
    """Each captured call's reduction writes its slot; a replay's flags are
    read after the next replay (or at exit, for the last) and name its first
    flagged call on that replay's span, not on the others."""
    proc = run_python(_app(NAN_CHECK, level=level), tmp_path, env={"SGLANG_KERNEL_API_GRAPH_NAN_CHECK": check})
    assert proc.returncode == 0, proc.stderr
    # Three calls captured, a slot and two rows (their outputs are 2x4) each, after the calls' slots and
    # their arguments' (none flagged here).
    assert proc.stdout.split("\n")[-2] == ("([False, True, False, False], [(1, (8192, 2)), (2, (8194, 2)), "
                                           "(3, (8196, 2))])" if named else "None")
    replays = _replays(sok.read_trace(tmp_path / "t.sgltrace"))
    marks = [span.attributes.get("sglang.cuda_graph.first_nonfinite") for span in replays]
    assert marks == ([None, "2: layer.mlp", None, "2: layer.mlp"] if named else [None] * 4)
    requests = [span.attributes.get("sglang.kernel.nonfinite_requests") for span in replays]
    assert requests == ([None, ("req-2",), None, ("req-2",)] if named else [None] * 4)
    if named:
        report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"),
                                 "--json"], capture_output=True, text=True, timeout=120)
        graphs = [call["graph"] for call in json.loads(report.stdout)["last_calls"] if call["graph"]]
        assert [graph["first_nonfinite"] for graph in graphs] == marks


GRAPH_FLAGS = """
sys.path.insert(0, BENCH)
from host_reads import host_reads
graph = StandInGraph(); out = capture(graph)
check = graph._sglang_otel_kernels_graph.nan
with host_reads(refuse=True) as reads:  # no value read to the host in a replay or at a step's end
    for number, poisoned in enumerate([False, True, False], 1):
        graph.at, graph.then = number, lambda poisoned=poisoned: poison(check, poisoned)
        with sok.forward_batch(carriers, name="decode_batch"):
            graph.replay()
print(reads)
"""


def test_the_nan_flags_name_a_graphs_first_flagged_call_at_level_1_with_no_host_read(tmp_path):
    """With SGLANG_KERNEL_API_NAN_FLAGS at level 1 the graph NaN check flags
    the captured calls; each replay's flags are read at its step's end from
    host memory, and the report's headline names the captured call, its
    replay and the request of its flagged row."""
    bench = os.path.join(os.path.dirname(TESTS), "bench")
    proc = run_python(_app(GRAPH_FLAGS.replace("BENCH", repr(bench)), level=1, nan_flags=True), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[-2] == "[]"
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 3, report.stdout + report.stderr
    assert report.stdout.startswith("the NaN flags saw the first NaN/Inf come out of layer.mlp (captured call 2) in "
                                    "replay 2 of CUDA graph 1, in the rows of request req-2 "), report.stdout


GRAPH_FLAGS_CRASH = """
from sglang_otel_kernels.capture import nan_flags
nan_flags.FlagRing._first_flagged = lambda self, start, end: None  # never read live (as a GPU a step late)
graph = StandInGraph(); out = capture(graph)
check = graph._sglang_otel_kernels_graph.nan
for number in range(1, 5):
    graph.at, graph.then = number, lambda poisoned=number == 2: poison(check, poisoned)
    with sok.forward_batch(carriers, name="decode_batch"):
        if number == 4:  # a step after the NaN: a device-side assert, or the OOM killer
            mlp(torch.ones(1))
            os.abort() if ENDING == "abort" else os.kill(os.getpid(), signal.SIGKILL)
        graph.replay()
"""


@pytest.mark.parametrize("ending", ["kill", "abort"])
def test_a_graph_replays_nan_flags_survive_a_crash_a_step_later_in_the_flags_file(tmp_path, ending):
    """The graph's summary of replay 2 goes into the flags ring, then into
    the crash-safe flags file at its step's end; never read live, the
    process dies a step later: the report names the captured call, its
    replay and the request of its flagged row from the files alone."""
    proc = run_python(_app(GRAPH_FLAGS_CRASH.replace("ENDING", repr(ending)), level=1, nan_flags=True), tmp_path)
    assert proc.returncode == (-signal.SIGKILL if ending == "kill" else -signal.SIGABRT), proc.stderr
    path = str(tmp_path / "t.sgltrace")
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path, "--json"],
                            capture_output=True, text=True, timeout=120)
    first = json.loads(report.stdout)["first_nonfinite_output"]
    assert first["nonfinite_seen_by"] == "flags" and first["requests"]["request_ids"] == ["req-2"], first
    assert first["graph"]["first_nonfinite"] == "2: layer.mlp" and first["graph"]["replay"] == 2, first
    os.rename(path + ".nanflags", tmp_path / "aside")  # the trace file alone does not say it
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path, "--json"],
                            capture_output=True, text=True, timeout=120)
    assert json.loads(report.stdout)["first_nonfinite_output"] is None


GRAPH_INPUTS = """
@sok.debug_kernel_api(op_name="layer.attn_cache")
def attend(x, cache=None):
    return x @ cache

from sglang_otel_kernels.capture import nan_flags
if LIVE is False:
    nan_flags.FlagRing._first_flagged = lambda self, start, end: None  # never read live (as a GPU a step late)
graph = StandInGraph()
x, cache = torch.ones(2, 4), torch.ones(4, 4)
cache[1, 2] = float("nan")  # a NaN in the cache, from before the graph: its captured reductions see it
with capturing():
    graph.capture_begin()
    out = mlp(attend(mlp(x), cache=cache))
    graph.capture_end()
check = graph._sglang_otel_kernels_graph.nan
graph.at, graph.then = 1, check.summarise  # the replay's kernels, the summary's last (on the CPU: run again)
with sok.forward_batch(carriers, name="decode_batch"):
    graph.replay()
if LIVE is False:
    with sok.forward_batch(carriers, name="decode_batch"):  # a step later
        mlp(torch.ones(1))
        os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("asked, live, level, named", [
    ("layer.attn*", True, 1, "input.cache"), ("", True, 1, None),
    ("layer.attn*", False, 3, "input.cache"), ("layer.attn*", False, 1, "input.keyword0")])
def test_a_graphs_captured_call_fed_nan_through_an_argument_is_named_with_it_live_and_after_a_kill(
        tmp_path, asked, live, level, named):
    """SGLANG_KERNEL_API_NAN_FLAGS_INPUTS reaches calls captured into a CUDA
    graph: their arguments' reductions are captured before them, and the
    replay's summary names the first captured call that made NaN/Inf or
    was fed it, with the arguments that held it: a cache poisoned before
    the graph is said to go into the attention through input.cache, not to
    start there. Live, and from the files alone after a SIGKILL a step
    later (the keyword's name from the captured call's span where its
    level lists keywords, else its place)."""
    proc = run_python(_app(GRAPH_INPUTS.replace("LIVE", repr(live)), level=level, nan_flags=True,
                           nan_flag_inputs=[asked] if asked else []), tmp_path)
    assert proc.returncode == (0 if live else -signal.SIGKILL), proc.stderr
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"),
                             "--json"], capture_output=True, text=True, timeout=120)
    first = json.loads(report.stdout)["first_nonfinite_output"]
    assert first["graph"]["first_nonfinite"] == "2: layer.attn_cache" and first["nonfinite_seen_by"] == "flags", first
    assert first["requests"]["request_ids"] == ["req-1", "req-2"], first  # the cache's NaN column: every row
    assert first["nonfinite_inputs"] == ([named] if named else None), first
    text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace")],
                          capture_output=True, text=True, timeout=120).stdout
    where = "layer.attn_cache (captured call 2) in replay 1 of CUDA graph 1"
    headline = (f"the NaN flags saw the first NaN/Inf go into {where} through {named}, from before it, " if named else
                f"the NaN flags saw the first NaN/Inf come out of {where}, ")
    if live:
        assert text.startswith(headline), text
    else:  # the death leads; the replay a step before it says what its captured call was fed
        assert text.startswith("the process died ") and f"its inputs' NaN flags: NaN/Inf in {named}: " in text, text


def test_level_0_wraps_no_cuda_graph_and_a_failed_capture_leaves_nothing_behind(tmp_path):
    plain = run_python("import torch, sglang_otel_kernels as sok\n"
                       "import torch.cuda.graphs as graphs\n"
                       "print(torch.cuda.CUDAGraph.replay is graphs.CUDAGraph.__dict__['replay'],"
                       " torch.cuda.CUDAGraph.replay.__module__)\n", tmp_path)
    assert plain.stdout.split() == ["True", "torch.cuda.graphs"], plain.stderr
    proc = run_python(_app("""
class Broken(StandInGraph):
    def capture_end(self):
        raise RuntimeError("operation not permitted when stream is capturing")
record_graph_class(Broken)
broken = Broken()
try:
    capture(broken)
except RuntimeError:
    pass
mlp(torch.ones(1))  # after the failed capture: a call of no graph
"""), tmp_path)
    assert proc.returncode == 0, proc.stderr
    contents = sok.read_trace_file(tmp_path / "t.sgltrace")
    assert contents.graphs == {}
    assert "sglang.cuda_graph.id" not in contents.spans[-1].attributes
