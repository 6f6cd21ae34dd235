"""The NaN flags (SGLANG_KERNEL_API_NAN_FLAGS, issue 63): each recorded
call's outputs reduced to non-finite flags where they lie, no host read of
a tensor's value inside a recorded call, the first flagged call of a step
named with its requests, from the trace file and, after a crash, from the
flags file beside it alone."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import run_python

BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")

# Three layers a step for four requests (a row each); layer1 puts NaN in r2's row at step 2. Every step runs
# with each host read of a tensor's value refused (bench/host_reads.py): the recorder must make none.
MODEL = r"""
import os, sys, torch, sglang_otel_kernels as sok
sys.path.insert(0, BENCH)
from host_reads import host_reads
from sglang_otel_kernels.capture import nan_flags
if ENDING != "live":  # the live reading never happens (as on a GPU, where a step's flags are read a step late)
    nan_flags.FlagRing._first_flagged = lambda self, start, end: None

@sok.debug_kernel_api(op_name="layer0")
def layer0(x):
    return x * 2

@sok.debug_kernel_api(op_name="layer1")
def layer1(x, poison):
    y = x + 1
    if poison:
        y[2] = float("nan")
    return y

@sok.debug_kernel_api(op_name="layer2")
def layer2(x):
    return x.relu(), x.sum(-1)

members = [(None, f"r{index}") for index in range(4)]
with host_reads(refuse=True) as reads:
    for step in range(5):
        with sok.forward_batch(members, name="decode"):
            if step == 3 and ENDING == "abort":
                layer0(torch.ones(4, 8))
                os.abort()  # as a device-side assert on the NaN a step later takes the process down
            layer2(layer1(layer0(torch.ones(4, 8)), step == 2))
        if step == 3 and ENDING == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
print(json.dumps(reads))
"""
SETTINGS = {"level 1": {"SGLANG_KERNEL_API_LOGLEVEL": "1"}, "level 3": {"SGLANG_KERNEL_API_LOGLEVEL": "3"},
            "black box": {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_BLACKBOX": "1"},
            # Every call's arguments flagged too, before it runs: layer1 made the NaN out of finite ones.
            "inputs": {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_NAN_FLAGS_INPUTS": "*"}}


def model(ending: str) -> str:
    return ("import json, signal\n" + MODEL).replace("BENCH", repr(BENCH)).replace("ENDING", repr(ending))


def run_model(tmp_path, ending: str, settings: dict) -> subprocess.CompletedProcess:
    return run_python(model(ending), tmp_path, env={"SGLANG_KERNEL_API_NAN_FLAGS": "1",
                                                     "SGLANG_KERNEL_API_LOGDEST": "off",
                                                     "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace", **settings})


def report(*args, cwd):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)


def first_nonfinite(tmp_path) -> tuple:
    proc = report("--json", "t.sgltrace", cwd=tmp_path)
    found = json.loads(proc.stdout)
    return proc.returncode, found["first_nonfinite_output"], found


@pytest.mark.parametrize("setting", sorted(SETTINGS))
def test_no_recorded_call_reads_a_value_to_the_host_and_the_first_nan_is_named_with_its_request(tmp_path, setting):
    proc = run_model(tmp_path, "live", SETTINGS[setting])
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1]) == []  # no host read was asked for
    assert "failed" not in proc.stderr, proc.stderr  # nothing of ours went wrong, quietly
    status, first, _ = first_nonfinite(tmp_path)
    assert status == 3  # the documented exit status of a NaN/Inf
    assert first["name"] == "layer1" and first["nonfinite_seen_by"] == "flags"
    assert first["requests"]["request_ids"] == ["r2"] and first["requests"]["nonfinite_rows"] is True
    assert first["requests"]["batch_request_ids"] == ["r0", "r1", "r2", "r3"]
    inputs = setting == "inputs"
    assert first["nonfinite_inputs"] == ([] if inputs else None) and first["nonfinite"] == ["output"]
    text = report("t.sgltrace", cwd=tmp_path).stdout
    said = "come out of layer1 from finite inputs," if inputs else "come out of layer1,"
    assert text.startswith(f"the NaN flags saw the first NaN/Inf {said} in the rows of request r2"), text
    assert "First call whose NaN flags saw NaN/Inf:\n  layer1" in text
    assert ("its inputs' NaN flags: all finite: the NaN/Inf starts in this call" in text) is inputs
    # Marked as the live reading found it: in the trace file itself, the flags file aside.
    os.rename(tmp_path / "t.sgltrace.nanflags", tmp_path / "aside")
    assert first_nonfinite(tmp_path)[1]["name"] == "layer1"


@pytest.mark.parametrize("setting", ["level 1", "inputs"])
@pytest.mark.parametrize("ending", ["kill", "abort"])
def test_a_process_that_dies_a_step_after_the_nan_has_it_named_from_the_flags_file(tmp_path, ending, setting):
    proc = run_model(tmp_path, ending, SETTINGS[setting])
    assert proc.returncode == (-signal.SIGKILL if ending == "kill" else -signal.SIGABRT), proc.stderr
    status, first, found = first_nonfinite(tmp_path)
    assert found["crashed"] is (ending == "abort")  # aborted inside layer0's call; killed between steps
    assert first["name"] == "layer1" and first["nonfinite_seen_by"] == "flags"
    assert first["requests"]["request_ids"] == ["r2"]
    assert first["nonfinite_inputs"] == ([] if setting == "inputs" else None)
    # From the flags file alone: the trace file does not say it.
    os.rename(tmp_path / "t.sgltrace.nanflags", tmp_path / "aside")
    assert first_nonfinite(tmp_path)[1] is None


# A NaN no recorded call makes: written into a cache between steps (as a bad KV write would be), into a
# module's weight or buffer (its recorded method's self), or handed in a list or a dict of tensors. The first
# call it goes into is named with the argument.
FED = r"""
import os, signal, sys, torch, sglang_otel_kernels as sok
sys.path.insert(0, BENCH)
from host_reads import host_reads
from sglang_otel_kernels.capture import nan_flags
if ENDING != "live":
    nan_flags.FlagRing._first_flagged = lambda self, start, end: None

@sok.debug_kernel_api(op_name="embed")
def embed(x):
    return x * 2

@sok.debug_kernel_api(op_name="attn")
def attn(x, cache, scale=1.0):
    return x + cache.sum() * scale

@sok.debug_kernel_api(op_name="mix")
def mix(x, parts):
    return x + parts[0] + parts[1]

class Norm(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(8), requires_grad=False)
        self.register_buffer("shift", torch.zeros(8))

    @sok.debug_kernel_api(op_name="norm")
    def forward(self, x):
        return x * self.weight + self.shift

norm = Norm()
cache = torch.zeros(3, 4)
members = [(None, f"r{index}") for index in range(4)]
with host_reads(refuse=True):
    for step in range(4):
        if step == 2:
            if POISON == "cache":
                cache[1, 2] = float("nan")
            if POISON == "weight":
                norm.weight[3] = float("inf")
            if POISON == "buffer":
                norm.shift[5] = float("nan")
        with sok.forward_batch(members, name="decode"):
            y = attn(norm(embed(torch.ones(4, 8))), cache=cache)
            parts = [torch.ones(8), torch.full((8,), float("inf") if POISON in ("list", "dict") and step == 2 else 1.0)]
            mix(y, dict(enumerate(parts)) if POISON == "dict" else parts)
        if step == 2 and ENDING == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.parametrize("core", ["compiled", "python"])
@pytest.mark.parametrize("case", [("cache", "live", "1", "input.cache"), ("cache", "kill", "3", "input.cache"),
                                  ("cache", "kill", "1", "input.keyword0"), ("list", "live", "1", "input.arg1"),
                                  ("list", "kill", "1", "input.arg1"), ("dict", "live", "1", "input.arg1"),
                                  ("weight", "live", "1", "input.self"), ("weight", "kill", "1", "input.self"),
                                  ("buffer", "live", "1", "input.self")], ids="-".join)
def test_a_nan_that_came_in_through_an_argument_is_told_from_one_a_call_made(tmp_path, core, case):
    """With SGLANG_KERNEL_API_NAN_FLAGS_INPUTS the first flagged call of the
    step is the one the NaN went into, with the argument it came through:
    live, and from the flags file alone after a SIGKILL (a keyword named
    where its span lists the call's keywords, from level 3; its place among
    them otherwise); a list or a dict of tensors is one argument; a
    module's weight or buffer is its recorded method's `input.self`."""
    poison, ending, level, argument = case
    script = FED.replace("BENCH", repr(BENCH)).replace("ENDING", repr(ending)).replace("POISON", repr(poison))
    proc = run_python(script, tmp_path, env={
        "SGLANG_KERNEL_API_NAN_FLAGS": "1", "SGLANG_KERNEL_API_NAN_FLAGS_INPUTS": "attn,mix,norm",
        "SGLANG_KERNEL_API_LOGLEVEL": level, "SGLANG_KERNEL_API_LOGDEST": "off",
        "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace", "SGLANG_KERNEL_API_NATIVE": "1" if core == "compiled" else "0"})
    assert proc.returncode == (-signal.SIGKILL if ending == "kill" else 0), proc.stderr
    assert "failed" not in proc.stderr, proc.stderr
    status, first, _ = first_nonfinite(tmp_path)
    name, seq = {"cache": ("attn", 11), "list": ("mix", 12), "dict": ("mix", 12), "weight": ("norm", 10),
                 "buffer": ("norm", 10)}[poison]
    assert status == (3 if ending == "live" else 1)  # the death, where the process was killed, goes first
    assert first["name"] == name and first["nonfinite_seen_by"] == "flags"
    assert first["nonfinite_inputs"] == [argument] and first["nonfinite"] == [argument, "output"]
    assert first["seq"] == seq  # step 2's, not a later step's
    text = report("t.sgltrace", cwd=tmp_path).stdout
    if ending == "live":
        assert text.startswith(f"the NaN flags saw the first NaN/Inf go into {name} through {argument}, from before "
                               "it, in the rows of requests r0, r1, r2, r3"), text
    assert f"its inputs' NaN flags: NaN/Inf in {argument}: it came in from before this call" in text


def test_an_earlier_runs_flags_go_where_its_trace_file_goes(tmp_path):
    assert run_model(tmp_path, "kill", SETTINGS["level 1"]).returncode == -signal.SIGKILL
    assert run_model(tmp_path, "live", SETTINGS["level 1"]).returncode == 0
    kept = [name for name in os.listdir(tmp_path) if name.endswith(".sgltrace") and ".prev-" in name]
    assert len(kept) == 1 and os.path.exists(tmp_path / (kept[0] + ".nanflags"))
    proc = report("--json", kept[0], cwd=tmp_path)
    assert json.loads(proc.stdout)["first_nonfinite_output"]["name"] == "layer1"


def test_calls_outside_any_batch_are_flagged_too_and_read_at_exit(tmp_path):
    proc = run_python("""
import torch, sglang_otel_kernels as sok
scale = sok.debug_kernel_api(op_name="scale")(lambda x, k: x * k)
for k in (1.0, 2.0, float("inf"), 3.0):
    scale(torch.ones(2, 3), k)
""", tmp_path, env={"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_NAN_FLAGS": "1",
                    "SGLANG_KERNEL_API_LOGDEST": "off", "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace"})
    assert proc.returncode == 0, proc.stderr
    status, first, _ = first_nonfinite(tmp_path)
    assert status == 3 and first["name"] == "scale" and first["seq"] == 3


def _replay_cells(head: list, arguments: list, rows: list, width: int = 32) -> bytes:
    """A REPLAY slot's bytes: the flag, two numbers, its output's flag and three counts (`head`, 11 bytes),
    then its arguments' flags (16 bytes), then its rows'."""
    cells = bytes(head + arguments + [1] * (16 - len(arguments)) + rows)
    return cells + bytes([1]) * (width - len(cells))


def test_the_flags_file_trusts_a_slot_only_once_its_copy_is_confirmed(tmp_path):
    from sglang_otel_kernels.record.flag_file import CALL, REPLAY, REPLAY_HEAD, WATCH, FlagFile, read_flag_file

    assert REPLAY_HEAD == 27  # the layout _replay_cells writes
    path = str(tmp_path / "f.nanflags")
    written = FlagFile(path, 8, 32)
    written.set_index(0, 5, 1, 4, 1, CALL)
    written.flags[0:32] = bytes([1, 1, 0, 1, 0] + [1] * 27)  # row 2 and the other output: non-finite
    written.set_index(1, 0, 2, 2, 0, WATCH)  # a watched tensor's: never read from the file
    written.flags[32:64] = bytes([0, 0] + [1] * 30)
    # A graph's replay (call number 9 << 40 | 3): captured call 258 = 3 + 1 * 255 made NaN/Inf, in rows 1 and 3
    # of its 4; its arguments were not flagged.
    written.set_index(2, (9 << 40) | 3, 3, 0, 0, REPLAY)
    written.flags[64:96] = _replay_cells([0, 4, 2, 1, 5, 1, 1, 0, 1, 1, 1], [], [1, 0, 1, 0])
    written.set_index(3, 6, 4, 1, 0, CALL)
    written.flags[96:128] = bytes([0] + [1] * 31)
    # Replay 4 of graph 9: captured call 1 was fed NaN/Inf through its second argument (of two, one positional)
    # and its outputs' flags said nothing.
    written.set_index(4, (9 << 40) | 4, 5, 0, 0, REPLAY)
    written.flags[128:160] = _replay_cells([0, 2, 1, 1, 3, 1, 1, 1, 3, 2, 1], [1, 0], [1, 1])
    found = read_flag_file(path)
    assert found.flagged == [] and found.unconfirmed == 4  # nothing confirmed yet: no flag is believed
    written.confirm(3)
    found = read_flag_file(path)
    assert [(f.seq, f.rows, f.bad_rows, f.other_output, f.position, f.inputs, f.output) for f in found.flagged] == [
        (5, 4, (2,), True, 0, None, True), ((9 << 40) | 3, 4, (1, 3), False, 258, None, True)]
    assert found.unconfirmed == 2 and found.pid == os.getpid() and found.problems == []
    written.confirm(5)
    replay = read_flag_file(path).flagged[-1]
    assert (replay.seq, replay.position, replay.rows, replay.bad_rows, replay.inputs, replay.positional,
            replay.arguments, replay.self_first, replay.output) == ((9 << 40) | 4, 1, 2, (), (1,), 1, 2, False, False)
    with pytest.raises(FileExistsError):  # never over an earlier file
        FlagFile(path, 8, 32)


def test_a_flags_files_damaged_slots_are_never_believed(tmp_path):
    """Hostile slots: a replay's number with a 0 digit (not what the graph
    writes), a replay naming position 0, one with more positional arguments
    than arguments, one with more arguments than a slot holds, a kind no
    writer has: none is a flagged call, and an unknown kind is said."""
    from sglang_otel_kernels.record.flag_file import REPLAY, FlagFile, read_flag_file

    path = str(tmp_path / "f.nanflags")
    written = FlagFile(path, 8, 32)
    for slot, head in enumerate([[0, 0, 2, 1, 2, 1, 1, 0, 1, 1, 1],  # a 0 among the digits
                                 [0, 1, 1, 1, 2, 1, 1, 0, 1, 1, 1],  # position 0
                                 [0, 2, 1, 1, 2, 1, 1, 0, 2, 3, 1],  # 2 positional of 1 argument
                                 [0, 2, 1, 1, 2, 1, 1, 0, 18, 1, 1]]):  # 17 arguments
        written.set_index(slot, 7 + slot, 1 + slot, 0, 0, REPLAY)
        written.flags[32 * slot:32 * (slot + 1)] = _replay_cells(head, [0] * 16, [0])
    written.set_index(4, 11, 5, 1, 0, 7)
    written.flags[128:160] = bytes([0] * 32)
    written.confirm(5)
    found = read_flag_file(path)
    assert found.flagged == [] and len(found.problems) == 1 and "kind 7" in found.problems[0]


def test_a_calls_arguments_slot_is_paired_with_its_outputs_and_counts_from_when_it_was_taken(tmp_path):
    """INPUTS slots: one whose arguments were finite gives its call `inputs`
    () and leaves its place; one that held NaN/Inf moves its call to the
    arguments' order (before a call flagged between them); one whose call's
    outputs said nothing is a call fed NaN/Inf with no output flagged; one
    whose counts do not fit is a problem, never believed."""
    from sglang_otel_kernels.record.flag_file import CALL, INPUTS, SELF_FIRST, FlagFile, argument_name, read_flag_file

    path = str(tmp_path / "f.nanflags")
    written = FlagFile(path, 8, 6)
    written.set_index(0, 1, 1, 1, 2, INPUTS)  # call 1: one positional argument, one keyword: finite
    written.set_index(1, 1, 2, 2, 0, CALL)
    written.flags[6:12] = bytes([0, 1, 1, 1, 1, 1])
    written.set_index(2, 2, 3, 2, 3, INPUTS)  # call 2: its keyword argument held NaN/Inf
    written.flags[12:18] = bytes([1, 1, 0, 1, 1, 1])
    written.set_index(3, 3, 4, 1, 0, CALL)  # call 3 ran inside call 2, and made NaN/Inf too
    written.flags[18:24] = bytes([0, 1, 1, 1, 1, 1])
    written.set_index(4, 2, 5, 1, 0, CALL)
    written.flags[24:30] = bytes([0, 1, 1, 1, 1, 1])
    written.set_index(5, 4, 6, 1, 1, INPUTS, SELF_FIRST)  # call 4's self was NaN/Inf; its outputs' flags said nothing
    written.flags[30:36] = bytes([0, 1, 1, 1, 1, 1])
    written.set_index(6, 4, 7, 1, 0, CALL)
    written.set_index(7, 5, 8, 3, 2, INPUTS)  # more positional arguments than arguments
    written.flags[42:48] = bytes([0] * 6)
    written.confirm(8)
    found = read_flag_file(path)
    assert [(f.seq, f.inputs, f.positional, f.arguments, f.self_first, f.output) for f in found.flagged] == [
        (1, (), 1, 2, False, True), (2, (2,), 2, 3, False, True), (3, None, 0, 0, False, True),
        (4, (0,), 1, 1, True, False)]
    assert [argument_name(at, 2, True, ["cache"]) for at in range(3)] == ["input.self", "input.arg0", "input.cache"]
    assert len(found.problems) == 1 and "slot 7 is of kind 3" in found.problems[0]


@pytest.mark.parametrize("content", [b"", b"SGLNANF1" + b"\0" * 10, b"x" * 200, None])
def test_a_flags_file_that_is_not_one_is_a_problem_never_an_error(tmp_path, content):
    from sglang_otel_kernels.record.flag_file import HEADER, VERSION, FlagFile, read_flag_file

    path = tmp_path / "f.nanflags"
    if content is None:  # a valid header whose sizes disagree with the file
        FlagFile(str(path), 8, 6)
        data = bytearray(path.read_bytes())
        HEADER.pack_into(data, 0, b"SGLNANF1", VERSION, 4096, 6, 1, 0, 0)
        path.write_bytes(bytes(data))
    else:
        path.write_bytes(content)
    found = read_flag_file(str(path))
    assert found.flagged == [] and len(found.problems) == 1 and str(path) in found.problems[0]
    os.unlink(path)
    os.mkfifo(path)  # never blocks on a FIFO
    assert "cannot read" in read_flag_file(str(path)).problems[0]


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32", "float64"])
def test_finite_rows_agrees_with_isfinite_through_every_cpu_path(dtype):
    """The compiled core's scan of a contiguous CPU tensor, and the torch
    path a strided one (and every one without the core) takes, both say
    what `isfinite` says: the largest finite value and a subnormal are
    finite, NaN and either Inf are not."""
    import torch

    from sglang_otel_kernels.describe.statistics import finite_rows

    kind = getattr(torch, dtype)
    info = torch.finfo(kind)
    x = torch.zeros(8, 12, dtype=kind)
    x[0, 0], x[1, 5], x[2, 11] = info.max, -info.max, info.tiny / 2  # finite, all three
    x[3, 2], x[5, 11], x[6, 0] = float("nan"), float("inf"), float("-inf")
    for tensor in (x, x.t().contiguous().t()):  # contiguous; strided (the torch path)
        for rows in (8, 4, 1):
            flags = torch.ones(3, 12, dtype=torch.bool)
            finite_rows(tensor, rows, flags, 1, 2)  # into slot 1, from its third flag
            expected = torch.isfinite(tensor.reshape(rows, -1)).all(1)
            assert flags[1, 2:2 + rows].tolist() == expected.tolist(), (rows, tensor.is_contiguous())
            assert flags.sum().item() == 36 - rows + sum(expected.tolist())  # nothing else written


def test_a_steps_end_while_a_cuda_graph_is_captured_copies_nothing(tmp_path, monkeypatch):
    """A batch around a capture ends while the stream captures: a copy made
    then would be captured into the graph, not made. The next end copies."""
    import torch

    from sglang_otel_kernels.capture import nan_flags

    ring = nan_flags.FlagRing(str(tmp_path / "t.sgltrace"))
    monkeypatch.setattr(nan_flags, "_ring", ring)
    ring.flag(None, 1, torch.ones(2, 3), None, None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    nan_flags.step_ended()
    assert ring.copied == 0 and ring.made == 1
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    nan_flags.step_ended()
    assert ring.copied == 1


MARKED = r"""
import json, torch, sglang_otel_kernels as sok
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
exporter = InMemorySpanExporter()
provider = TracerProvider()
provider.add_span_processor(SimpleSpanProcessor(exporter))
sok.configure(level=1, log_dest="off", trace_file="t.sgltrace", nan_flags=True, tracer_provider=provider)
layer = sok.debug_kernel_api(op_name="layer1")(lambda x, poison: x.index_fill(0, torch.tensor([1]), float("nan"))
                                               if poison else x + 1)
carriers = [("00-" + "a1" * 16 + "-" + "b1" * 8 + "-01", "r0"), ("00-" + "a2" * 16 + "-" + "b2" * 8 + "-01", "r1"),
            ("00-" + "a3" * 16 + "-" + "b3" * 8 + "-01", "r2")]
for step in range(3):
    with sok.forward_batch(carriers, name="decode"):
        layer(torch.ones(3, 4), step == 1)
print(json.dumps([(s.name, f"{s.context.trace_id:032x}", s.parent.span_id if s.parent else None, s.context.span_id,
                   {k: list(v) if isinstance(v, tuple) else v for k, v in s.attributes.items()})
                  for s in exporter.get_finished_spans()]))
"""


def test_the_flagged_call_is_marked_where_back_ends_see_it_and_in_its_requests_traces(tmp_path):
    """The mark in the trace file comes after the call's span was sent: a
    `sglang.kernel.nonfinite` span, tagged `nonfinite_flag`, goes to the
    exporters under the flagged call, and under the request its flagged
    row belongs to (r1's trace), not under its batch mates'."""
    proc = run_python(MARKED, tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = json.loads(proc.stdout.splitlines()[-1])
    calls = {span_id: (name, trace) for name, trace, _, span_id, _ in spans if name == "layer1"}
    marks = [span for span in spans if span[0] == "sglang.kernel.nonfinite"]
    assert len(marks) == 2, marks
    (_, trace, parent, _, attributes), (_, request_trace, _, _, request_attributes) = sorted(
        marks, key=lambda mark: "sglang.request.id" in mark[4])
    assert calls[parent] == ("layer1", trace)  # under the flagged call, in its batch's trace
    assert attributes["sglang.kernel.nonfinite_flag"] is True and attributes["sglang.kernel.nonfinite_call"] == "layer1"
    assert attributes["sglang.kernel.nonfinite_requests"] == ["r1"]
    assert request_trace == "a2" * 16 and request_attributes["sglang.request.id"] == "r1"  # r1's own trace


WATCHED = MARKED.replace("""
layer = sok.debug_kernel_api""", """
from sglang_otel_kernels.capture import nan_flags
from sglang_otel_kernels.capture.decorator import rewrap
layer = sok.debug_kernel_api""").replace("""        layer(torch.ones(3, 4), step == 1)
""", """        layer(torch.ones(3, 4), step == 1)
        logits = torch.zeros(3, 8)
        logits[step, 5] = float("inf")  # r0's row at step 0, r1's at 1 (where layer1 went NaN), r2's at 2
        nan_flags.watch(logits, "sampler.logits", {"sglang.request.nonfinite_logits": True})
""").replace("for step in range(3):", """layer = rewrap(layer, {"sglang.kernel.module": "model.layers.1.mlp"})
for step in range(3):""")


def test_a_watched_tensors_rows_mark_their_requests_whichever_call_came_first_and_the_mark_names_the_layer(tmp_path):
    """Logits watched before sampling (what the SGLang integration does at
    `sanitize_nan_logits`): each step whose row of a request held NaN/Inf
    marks that request's trace `sglang.request.nonfinite_logits`, also the
    step where a recorded call went NaN first; the call's own mark carries
    its module path (the layer an alert names)."""
    proc = run_python(WATCHED, tmp_path)
    assert proc.returncode == 0, proc.stderr
    spans = json.loads(proc.stdout.splitlines()[-1])
    marks = [(trace, attributes) for name, trace, _, _, attributes in spans if name == "sglang.kernel.nonfinite"]
    logits = sorted((mark["sglang.request.id"], trace, mark["sglang.kernel.nonfinite_call"]) for trace, mark in marks
                    if mark.get("sglang.request.nonfinite_logits") is True)
    assert logits == [("r0", "a1" * 16, "sampler.logits"), ("r1", "a2" * 16, "sampler.logits"),
                      ("r2", "a3" * 16, "sampler.logits")], marks
    [call_mark] = [mark for _, mark in marks if "sglang.request.id" not in mark]
    assert call_mark["sglang.kernel.nonfinite_call"] == "layer1"
    assert call_mark["sglang.kernel.module"] == "model.layers.1.mlp"
    assert call_mark["sglang.kernel.nonfinite_requests"] == ["r1"]
    # From the trace file alone: the first call the flags saw, and every request sampled from NaN/Inf logits.
    status, first, found = first_nonfinite(tmp_path)
    assert status == 3 and first["name"] == "layer1" and found["verdict"]["kind"] == "nonfinite"
    assert [mark["request_id"] for mark in found["nonfinite_logits"]] == ["r0", "r1", "r2"]
    text = report("t.sgltrace", cwd=tmp_path).stdout
    assert "Requests sampled from logits holding NaN/Inf (3; " in text and "  request r2  (" in text, text


def test_logits_held_nan_that_no_recorded_call_made_is_the_verdict_itself(tmp_path):
    """NaN that no recorded call's flags saw first (an op the recorder does
    not wrap) still reaches the logits: the report's verdict says which
    requests were sampled from them, exit status 3."""
    proc = run_python(WATCHED.replace("step == 1)", "False)"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    status, first, found = first_nonfinite(tmp_path)
    assert status == 3 and first is None
    assert found["verdict"]["headline"].startswith("requests r0, r1, r2 were sampled from logits holding NaN/Inf, "
                                                   "and no recorded call's NaN flags saw it first (pid "), found["verdict"]


def test_the_mark_reaches_jaeger_through_the_sidecar_searchable_by_its_tag(tmp_path):
    """Exported by the sidecar from the trace file to a real Jaeger: a search
    for `sglang.kernel.nonfinite_flag=true` finds the batch's trace and the
    trace of the request whose row went non-finite, not its batch mates'."""
    from backends import Jaeger, ensure_built, wait

    ensure_built()
    jaeger = Jaeger(tmp_path)
    try:
        script = MARKED.replace(", tracer_provider=provider", "").replace("print(json.dumps(", "print((")
        proc = run_python(script, tmp_path, env={"OTEL_EXPORTER_OTLP_ENDPOINT": f"http://{jaeger.otlp}",
                                                 "OTEL_SERVICE_NAME": "nan-flags"})
        assert proc.returncode == 0, proc.stderr
        found = wait("the marks in Jaeger", lambda: (lambda got: got if len(got) == 2 else None)(
            jaeger.search("nan-flags", {"sglang.kernel.nonfinite_flag": "true"})), timeout=60)
    finally:
        jaeger.close()
    assert int("a2" * 16, 16) in found and int("a1" * 16, 16) not in found and int("a3" * 16, 16) not in found


def test_a_call_whose_flags_a_crash_left_reaches_its_requests_trace_through_replay(tmp_path):
    """The sidecar delivered layer1's span as it ended (its flags unread:
    the process was SIGKILLed a step later); `replay` after the crash,
    which leaves out what the sidecar delivered, still sends its copy into
    the trace of the request whose row it made NaN, flagged from the flags
    file, and nothing into the others'."""
    from otlp_receivers import GrpcReceiver

    receiver = GrpcReceiver()
    try:
        script = model("kill").replace('members = [(None, f"r{index}") for index in range(4)]',
                                       'members = [(f"00-{index + 1:032x}-{index + 1:016x}-01", f"r{index}") '
                                       'for index in range(4)]')
        env = {"SGLANG_KERNEL_API_NAN_FLAGS": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
               "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace", "SGLANG_KERNEL_API_LOGLEVEL": "1",
               "OTEL_EXPORTER_OTLP_ENDPOINT": receiver.endpoint, "OTEL_EXPORTER_OTLP_INSECURE": "true"}
        assert run_python(script, tmp_path, env=env).returncode == -signal.SIGKILL
        receiver.wait_for(lambda got: any(s["name"] == "layer1" for s in got), timeout=60)
        time.sleep(1)  # the sidecar sends what is left of the dead process
        delivered = len(receiver.spans)
        assert not any("sglang.kernel.copy_of" in s["attributes"] for s in receiver.spans)
        replay = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", "t.sgltrace", "--endpoint",
                                 receiver.endpoint], cwd=tmp_path, capture_output=True, text=True, timeout=120)
        assert replay.returncode == 0, replay.stderr
        assert "1 copies into request traces" in replay.stdout, replay.stdout
        receiver.wait_for(lambda got: any("sglang.kernel.copy_of" in s["attributes"] for s in got[delivered:]))
        time.sleep(0.5)
        [copy] = [s for s in receiver.spans[delivered:] if "sglang.kernel.copy_of" in s["attributes"]]
    finally:
        receiver.stop()
    assert copy["name"] == "layer1" and copy["trace_id"] == 3  # r2's trace
    assert copy["attributes"]["sglang.kernel.nonfinite_flag"] is True


def test_the_inputs_asked_for_are_patterns_read_from_the_environment_or_given_as_a_list():
    """SGLANG_KERNEL_API_NAN_FLAGS_INPUTS: comma-separated patterns, blanks
    ignored; configure() takes a list and refuses a bare string (which would
    read as one pattern a character) with a clear error."""
    import sglang_otel_kernels as sok
    from sglang_otel_kernels.config import config_from_env

    assert config_from_env({"SGLANG_KERNEL_API_NAN_FLAGS_INPUTS": " *rmsnorm*, ,attn "}).nan_flag_inputs == (
        "*rmsnorm*", "attn")
    assert config_from_env({}).nan_flag_inputs == ()
    with pytest.raises(ValueError, match="nan_flag_inputs must be a list of fnmatch patterns"):
        sok.configure(nan_flag_inputs="*")


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_whether_a_calls_inputs_are_flagged_is_asked_again_when_the_patterns_change(tmp_path, core):
    """Each site asks once whether its name is among the patterns (the
    compiled core keeps the answer on the site): configured anew, a call its
    old answer left unflagged has its arguments flagged, and back."""
    proc = run_python("""
import torch, sglang_otel_kernels as sok
from sglang_otel_kernels.capture import nan_flags
sok.configure(level=1, log_dest="off", trace_file="t.sgltrace", nan_flags=True, nan_flag_inputs=["other"])
@sok.debug_kernel_api(op_name="scale")
def scale(x):
    return x * 2
taken = []
for patterns in (["other"], ["sc*"], ["other"]):
    sok.configure(nan_flag_inputs=patterns)
    before = nan_flags._ring.made if nan_flags._ring else 0
    scale(torch.ones(2))
    taken.append(nan_flags._ring.made - before)  # its outputs' slot, and its arguments' where flagged
print(taken, sok.NATIVE)
""", tmp_path, env={"SGLANG_KERNEL_API_NATIVE": "1" if core == "compiled" else "0"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["[1,", "2,", "1]", str(core == "compiled")], proc.stdout
