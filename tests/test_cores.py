"""The two recording cores (record/core.py): the compiled one that `pip
install` builds here, and the pure-Python one (SGLANG_KERNEL_API_NATIVE=0, or
where no compiler is). They write the same records: the same program gives
the same report through either, and the crash and trust suites pass with
the core this run does not use (this run's is the one its environment says)."""

import contextvars
import functools
import json
import os
import random
import re
import subprocess
import sys
import sysconfig
import tarfile
import zipfile
import zlib
from pathlib import Path

import pytest

import sglang_otel_kernels as sok
from conftest import CORE_VARIABLE, clean_env
from sglang_otel_kernels.record import core, tracefile

ROOT = Path(__file__).resolve().parent.parent
PYTHON_CORE = os.environ.get(CORE_VARIABLE, "").strip().lower() in ("0", "false", "off", "no")
# The suites of crashes (real processes killed mid-call, forks, threads, laps,
# signals) and of trust (hostile files, evidence never destroyed).
OTHER_CORE_SUITES = ["tests/test_crash.py", "tests/test_blackbox.py", "tests/test_tracefile.py",
                     "tests/test_threads.py", "tests/test_spans.py", "tests/test_evidence.py",
                     "tests/test_bad_input.py", "tests/test_silence.py", "tests/test_compile.py"]

PROGRAM = r"""
import os, sys, threading, torch
import sglang_otel_kernels as sok

@sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
def rmsnorm(x, weight, eps=1e-6):
    return x * weight

@sok.debug_kernel_api(op_name="sglang.custom_op.layer")
def layer(x, weight):
    return rmsnorm(x, weight) + rmsnorm(x, weight, eps=1e-5)

@sok.debug_kernel_api(op_name="sglang.custom_op.bad")
def bad(x):
    raise ValueError("shape mismatch")

class Attention:
    @sok.debug_kernel_api(op_name="sglang.custom_op.attention")
    def forward(self, q, k):
        return q + k

@sok.debug_kernel_api(op_name="sglang.custom_op.fatal")
def fatal(x, ids, cache, scale, die=False):
    if die:
        os.abort()
    return x

x, w = torch.ones(4, 8), torch.ones(8)
for _ in range(3):
    layer(x, w)
Attention().forward(x, x)
try:
    bad(x)
except ValueError:
    pass
worker = threading.Thread(target=lambda: [rmsnorm(x, w) for _ in range(5)], name="worker")
worker.start(); worker.join()
with sok.forward_batch([{}], name="decode_batch"):
    layer(x, w)

# Values at the edges of what the compiled core writes itself (its second call's; the first is Python's).
@sok.debug_kernel_api(op_name="sglang.custom_op.odd")
def odd(*args, **kwargs):
    return args[0]

for _ in range(2):
    odd(torch.empty(0, 3), torch.ones(1, 4).t(), torch.tensor(2.0), 2**40, -2**63, 2**64, float("nan"),
        float("-inf"), "r\u00e9sum\u00e9 \u2713", "x" * 300, None, [x, w], label="na\u00efve", big=-2**40)

# A thread's first call goes through Python, which names the thread: its arguments are described
# once (an object's own code runs once), not by the compiled core first.
looked = []
class Watched:
    def __getattr__(self, name):
        looked.append(name)
        raise AttributeError(name)
first = threading.Thread(target=odd, args=(Watched(),), name="first")
first.start(); first.join()

# Objects, identified by what their own __dict__ holds (the compiled core writes those it can alone).
import dataclasses, enum
class Mode(enum.IntEnum):
    DECODE = 1
@dataclasses.dataclass
class Batch:
    forward_mode: Mode
    batch_size: int
class Layer(torch.nn.Module):
    def __init__(self, prefix, **sizes):
        super().__init__()
        self.prefix, self.weight = prefix, torch.nn.Parameter(torch.ones(2))
        self.__dict__.update(sizes)
class Shaped(torch.nn.Module):  # a buffer named like a tensor's field: shown as SGLang's log shows it
    def __init__(self):
        super().__init__()
        self.register_buffer("shape", torch.ones(1))
class Info:
    def __init__(self, **fields):
        self.__dict__.update(fields)
class Wide(Info):
    pass
class Counted(Info):
    pass
class Slotted:
    __slots__ = ("layer_id",)
    def __init__(self):
        self.layer_id = 3
class Lazy:
    def __getattr__(self, name):
        return 1

@sok.debug_kernel_api(op_name="sglang.custom_op.objects")
def objects(*args, **kwargs):
    return args[0]

for size in (4, 5, 6):
    objects(Layer("model.layers.0.mlp", input_size=128, output_size=64), Batch(Mode.DECODE, size),
            Info(device="cpu"), Info(layer_id=size, head_dim=16.5, prefix="p" * 100), Layer("\udc80", num_heads=2),
            Wide(prefix="\u00e9t\u00e9 " * 40, layer_id=1, input_size=2, output_size=3, num_heads=4, head_dim=5,
                 in_features=6, out_features=7, num_embeddings=8, embedding_dim=9),
            Shaped(), Slotted(), Lazy(), Mode.DECODE, layer=Layer("k", layer_id=True),
            counted=Counted(batch_size=2**70 + size, layer_id=-12, num_heads=False))

# Lists and tuples: those of plain items the compiled core writes itself, item by item; those
# holding containers (whose items are elided) and subclasses (a namedtuple, torch.Size) go through Python.
import collections
Pair = collections.namedtuple("Pair", "a b")
shared = []
class Clearing:  # describing it empties the list it sits in
    def __getattr__(self, name):
        shared.clear()
        raise AttributeError(name)

@sok.debug_kernel_api(op_name="sglang.custom_op.sequences")
def sequences(*args, **kwargs):
    return args[0]

for _ in range(2):
    shared[:] = [Clearing(), x, 3, None, w]
    sequences((x, w), [x, 1.5, "s", None, w, w], [], (Batch(Mode.DECODE, 2), Mode.DECODE), [[x], (w,)],
              Pair(x, w), x.shape, shared, ids=[x] * 300)

# A CUDA graph (the tests' stand-in, through the same seam): captured, then
# replayed alone and in a batch's context, then a device error it is blamed for.
sys.path.insert(0, sys.argv[1])
from stand_in_graph import StandInGraph, capturing
from sglang_otel_kernels.capture.graphs import record_graph_class, replay_attributes
record_graph_class(StandInGraph)
graph = StandInGraph()
with capturing():
    graph.capture_begin()
    layer(x, w)
    graph.capture_end()
for _ in range(2):
    graph.replay()
for size in (2, 3):
    with replay_attributes(**{"sglang.batch.size": size, "sglang.batch.request_ids": ("a", "b", "c")[:size]}):
        graph.replay()

@sok.debug_kernel_api(op_name="sglang.custom_op.sync")
def sync(x):
    raise RuntimeError("CUDA error: an illegal memory access was encountered")

try:
    sync(x)
except RuntimeError:
    pass
from sglang_otel_kernels.record import core
# Tensors of several dtypes, strides and devices (meta stands for an accelerator's), twice: the first
# call of a kernel goes through Python, which writes its name; the second dies in it.
arguments = (x.half().t(), torch.arange(12, dtype=torch.int32)[::3], torch.empty(2, 3, device="meta", dtype=torch.bfloat16), 0.5)
fatal(*arguments)
print(sok.NATIVE, core.native.recorded() if sok.NATIVE else 0, len(looked), flush=True)
fatal(*arguments, die=True)
"""


def test_the_core_in_use_is_the_one_this_environment_asks_for():
    """`pip install` here builds the compiled core: NATIVE, and --version
    names it; SGLANG_KERNEL_API_NATIVE=0 gives the Python one."""
    assert sok.NATIVE is (not PYTHON_CORE)
    version = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "--version"], capture_output=True,
                             text=True, timeout=60).stdout
    assert ("recording core: pure Python (SGLANG_KERNEL_API_NATIVE=0)" if PYTHON_CORE
            else "recording core: compiled (C)") in version


@pytest.mark.skipif(core.native is None, reason="checks the compiled core against zlib and the Python writer")
def test_the_compiled_rings_records_are_the_python_writers_byte_for_byte(tmp_path):
    """Each record the compiled ring copies (header, sequence, CRC, payload)
    is byte for byte what the Python writer's inline path copies."""
    sample = random.Random(7)
    for size in (*range(200), 1000):  # every path: a byte and 8 at a time, folded 64 then 16 at a time from 64 up
        data = bytes(sample.getrandbits(8) for _ in range(size))
        assert core.native.crc32(data) == zlib.crc32(data)
    payloads = [(5, bytes(sample.getrandbits(8) for _ in range(63))), (1, bytes(range(17))), (0, b"\x00" * 5)]
    rings = []
    for ring, write in ((core.native.Ring(), tracefile.TraceFileWriter._write_compiled),
                        (tracefile.PyRing(), tracefile.TraceFileWriter._write_python)):
        writer = tracefile.TraceFileWriter(str(tmp_path / f"{type(ring).__name__}.sgltrace"), 1 << 16)
        writer._core = ring
        writer.write_record = functools.partial(write, writer)  # the ring's own path (the EXIT at close too)
        write(writer, 0, tracefile.encode(("Y", 1, "first")))  # creates the file, and sets the inline limit
        first = ring.offset
        for encoding, payload in payloads:
            write(writer, encoding, payload)
        assert ring.offset == first + 8 * sum((24 + len(p) + 7) // 8 for _, p in payloads)
        rings.append(bytes(writer._ring[: ring.offset]))
        writer.close()
    assert rings[0] == rings[1]


# What differs between two runs of one program: ids, times, pids, paths.
# What differs between two runs of one program: ids, files, times and durations (a loaded machine
# stretches them: `seconds_before_death` read 0.1 through one core and 0.0 through the other).
_RUN_KEYS = {"trace_id", "span_id", "batch_span_id", "pid", "file", "files", "start", "duration_us", "seconds",
             "seconds_before_death", "total_us", "tracebacks", "request_traces", "job"}


def _normalised(value):
    """What a report says of calls (names, statuses, arguments, nesting),
    without what differs between two runs."""
    if isinstance(value, dict):
        return {key: _normalised(item) for key, item in value.items() if key not in _RUN_KEYS}
    if isinstance(value, list):
        return [_normalised(item) for item in value]
    if isinstance(value, str):
        value = re.sub(r"/\S*\.sgltrace", "FILE", value)
        value = re.sub(r"\b\d+(\.\d+)?\s?(s|us|ms)\b", "TIME", value)
        return re.sub(r"pid \d+|\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d+|0x[0-9a-f]+|\b[0-9a-f]{16,32}\b", "#", value)
    return value


def _report_of_a_run(tmp_path: Path, python_core: bool, level: int, blackbox: bool) -> dict:
    folder = tmp_path / ("python" if python_core else "compiled")
    folder.mkdir()
    env = clean_env(SGLANG_KERNEL_API_LOGLEVEL=str(level), SGLANG_KERNEL_API_LOGDEST="off",
                    SGLANG_KERNEL_API_TRACEFILE=str(folder / "trace_%i.sgltrace"),
                    SGLANG_KERNEL_API_BLACKBOX="1" if blackbox else "0")
    env.pop(CORE_VARIABLE, None)
    if python_core:
        env[CORE_VARIABLE] = "0"
    run = subprocess.run([sys.executable, "-c", PROGRAM, str(ROOT / "tests")], cwd=folder, env=env, capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == -6, run.stderr  # the abort inside sglang.custom_op.fatal
    native, recorded, looked = run.stdout.split()
    assert native == str(not python_core)
    # Watched's lookups in its thread's first call (shape, dtype, device as an argument, then as the
    # result): at level 3 alone, and once (the compiled core used to describe the argument first: 9).
    assert int(looked) == (6 if level == 3 else 0), run.stdout
    # The compiled core recorded 21 of the 35 calls and replays: Python the first of each of the eight kernels
    # and of the replays into the file (it writes their names), the worker thread's first (it writes the
    # thread's name) and the three calls made while the graph was captured.
    # Level 3 leaves to Python what it leaves at level 1, and the three replays C took there (their hooks describe them).
    assert int(recorded) == (0 if python_core else 21 if level == 1 else 18), run.stdout
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(folder), "--json"],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 1, report.stderr  # a crash
    return json.loads(report.stdout)


@pytest.mark.skipif(core.native is None, reason="compares the compiled core with the Python one")
@pytest.mark.parametrize("level, blackbox", [(1, False), (1, True), (3, False), (3, True)])
def test_the_same_program_gives_the_same_report_through_either_core(tmp_path, level, blackbox):
    compiled = _report_of_a_run(tmp_path, False, level, blackbox)
    python = _report_of_a_run(tmp_path, True, level, blackbox)
    assert compiled["crashed"] and python["crashed"]
    assert _normalised(compiled) == _normalised(python)
    assert [call["name"] for call in compiled["in_flight"]] == ["sglang.custom_op.fatal"]
    inputs = compiled["in_flight"][0]["inputs"]
    if level == 1:
        assert inputs == {}
    else:  # what the compiled core described: the call died in C's record
        assert inputs["arg0"] == {"shape": [8, 4], "dtype": "torch.float16", "device": "cpu", "stride": [1, 8],
                                  "contiguous": False, "requires_grad": False}
        assert inputs["arg1"]["stride"] == [3] and inputs["arg1"]["dtype"] == "torch.int32"
        assert inputs["arg2"]["device"] == "meta" and inputs["arg2"]["dtype"] == "torch.bfloat16"
        assert inputs["arg3"] == 0.5 and inputs["die"] is True
    assert [call["name"] for call in compiled["failed"]] == ["sglang.custom_op.bad", "sglang.custom_op.sync"]
    assert compiled["summary"]["sglang.custom_op.rmsnorm"]["calls"] == 15
    assert compiled["summary"]["cuda_graph.replay"]["calls"] == 4
    assert "replay 4 of graph 1" in json.dumps(compiled["failed"][1])
    odd = [_span_attributes(tmp_path / folder, "sglang.custom_op.odd") for folder in ("compiled", "python")]
    assert odd[0] == odd[1]
    if level == 3:
        described = {key.removeprefix("sglang.kernel.input."): value for key, value in odd[0][1].items()
                     if key.startswith("sglang.kernel.input.")}
        assert described["arg0.shape"] == (0, 3) and described["arg0.contiguous"] is True  # empty: contiguous
        assert described["arg1.stride"] == (1, 4) and described["arg1.contiguous"] is True  # a dim of size 1
        assert described["arg2.shape"] == () and described["arg2.stride"] == ()
        assert (described["arg3"], described["arg4"], described["big"]) == (2**40, -2**63, -2**40)
        assert (described["arg6"], described["arg7"]) == ("nan", "-inf")
        assert (described["arg8"], described["label"], described["arg10"]) == ("r\u00e9sum\u00e9 \u2713", "na\u00efve", "None")
        assert described["arg11.0.shape"] == (4, 8) and len(described["arg9"]) <= 200
    objects = [_span_attributes(tmp_path / folder, "sglang.custom_op.objects") for folder in ("compiled", "python")]
    assert objects[0] == objects[1] and len(objects[0]) == 3
    if level == 3:
        shown = [{key.removeprefix("sglang.kernel.input."): value for key, value in call.items()
                  if key.startswith("sglang.kernel.input.")} for call in objects[0]]
        assert shown[2]["arg0"] == "Layer(prefix=model.layers.0.mlp, input_size=128, output_size=64)"
        assert [call["arg1"] for call in shown] == [f"Batch(forward_mode=DECODE, batch_size={n})" for n in (4, 5, 6)]
        assert shown[2]["arg2"] == "Info(device=cpu)"  # a field SGLang's log shows: not its identity
        assert shown[2]["arg3"] == f"Info(layer_id=6, prefix={'p' * 64}, head_dim=16.5)"
        # A type's identity fields are those its first instance shown by them had; a lone surrogate mended.
        assert shown[2]["arg4"] == "Layer(prefix=\\udc80)"
        assert len(shown[2]["arg5"]) == 200 and shown[2]["arg5"].startswith("Wide(layer_id=1, prefix=\u00e9t\u00e9 ")
        assert shown[2]["arg6"] == "Shaped(shape=tensor([1.]))"
        assert (shown[2]["arg7"], shown[2]["arg8"], shown[2]["arg9"]) == \
            ("Slotted", "Lazy(shape=1, dtype=1, device=1)", "<Mode.DECODE: 1>")  # its __getattr__ ran
        assert shown[2]["layer"] == "Layer(prefix=k)"
        assert shown[2]["counted"] == f"Counted(batch_size={2**70 + 6}, layer_id=-12, num_heads=False)"
    sequences = [_span_attributes(tmp_path / folder, "sglang.custom_op.sequences") for folder in ("compiled", "python")]
    assert sequences[0] == sequences[1] and len(sequences[0]) == 2
    if level == 3:
        shown = {key.removeprefix("sglang.kernel."): value for key, value in sequences[0][1].items()}
        assert (shown["input.arg0"], shown["input.arg0.1.shape"], shown["output"], shown["output.0.shape"]) == \
            ("tuple[2]", (8,), "tuple[2]", (4, 8))
        assert (shown["input.arg1"], shown["input.arg1.1"], shown["input.arg1.2"], shown["input.arg1.3"]) == \
            ("list[6]", 1.5, "s", "None")
        assert "input.arg1.3.shape" not in shown and "input.arg1.4.shape" not in shown  # the first 4 items
        assert shown["input.arg2"] == "list[0]" and not any(key.startswith("input.arg2.") for key in shown)
        assert (shown["input.arg3.0"], shown["input.arg3.1"]) == ("Batch(forward_mode=DECODE, batch_size=2)", "<Mode.DECODE: 1>")
        assert (shown["input.arg4"], shown["input.arg4.0"], shown["input.arg4.0.0"]) == ("list[2]", "list[1]", "Tensor(...)")
        assert (shown["input.arg5"], shown["input.arg6"], shown["input.arg6.0"]) == ("tuple[2]", "tuple[2]", 4)
        # All four items the call was given, though describing the first emptied the list.
        assert (shown["input.arg7"], shown["input.arg7.0"], shown["input.arg7.2"]) == ("list[5]", "Clearing", 3)
        assert shown["input.arg7.1.shape"] == (4, 8)
        assert shown["input.ids"] == "list[300]" and "input.ids.4.shape" not in shown
    replays = [_span_attributes(tmp_path / folder, "cuda_graph.replay") for folder in ("compiled", "python")]
    assert replays[0] == replays[1]
    assert [r["sglang.cuda_graph.replay"] for r in replays[0]] == [1, 2, 3, 4]
    assert replays[0][3]["sglang.batch.request_ids"] == ("a", "b", "c")


def _span_attributes(folder: Path, name: str) -> list:
    (path,) = folder.glob("*.sgltrace")
    return [dict(span.attributes) for span in sok.read_trace_file(str(path)).spans if span.name == name]



@pytest.mark.skipif(core.native is None, reason="the other core is the Python one only where the compiled one is built")
def test_the_crash_and_trust_suites_pass_with_the_other_core():
    env = dict(os.environ)
    if PYTHON_CORE:
        env.pop(CORE_VARIABLE)
    else:
        env[CORE_VARIABLE] = "0"
    # Two files at a time (pytest-xdist, of the test extra): these suites wait on their children more than on the cores.
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-n", "2", "--dist", "loadfile",
                          *OTHER_CORE_SUITES],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-2000:]
    assert re.search(r"\d+ passed", run.stdout) and " skipped" not in run.stdout.splitlines()[-1], run.stdout[-2000:]


def test_the_wheel_holds_the_compiled_core_and_the_sdist_installs_without_a_compiler(tmp_path):
    """The wheel built here holds `_native`; the sdist, where no compiler
    runs, installs the pure-Python core, which says so once."""
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    built = subprocess.run([*pip, "wheel", "--no-deps", "-w", str(tmp_path / "wheel"), str(ROOT)],
                           capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    (wheel,) = (tmp_path / "wheel").glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert any(re.fullmatch(r"sglang_otel_kernels/_native\.[^/]*\.so", name) for name in names), names

    sdist = subprocess.run([sys.executable, "-m", "build", "--sdist", "-o", str(tmp_path / "sdist"), str(ROOT)],
                           cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert sdist.returncode == 0, sdist.stdout[-3000:] + sdist.stderr[-3000:]
    (archive,) = (tmp_path / "sdist").glob("*.tar.gz")
    assert any(name.endswith("sglang_otel_kernels/_native.c") for name in tarfile.open(archive).getnames())
    target = tmp_path / "site"
    env = clean_env(CC="/bin/false", CXX="/bin/false")
    env.pop(CORE_VARIABLE, None)
    installed = subprocess.run([*pip, "install", "--no-deps", "--target", str(target),
                                str(archive)], env=env, capture_output=True, text=True, timeout=600)
    assert installed.returncode == 0, installed.stdout[-3000:] + installed.stderr[-3000:]
    assert not list(target.glob("sglang_otel_kernels/_native*.so"))
    # -S: not this environment's editable install (its finder would win over the path); its packages, plainly.
    script = (f"import sys; sys.path[:0] = [{str(target)!r}]; sys.path += {sysconfig.get_paths()['purelib']!r}, "
              f"{sysconfig.get_paths()['platlib']!r}\nimport sglang_otel_kernels as s; print(s.NATIVE, s.__file__)")
    check = subprocess.run([sys.executable, "-S", "-c", script], env=env, cwd=tmp_path, capture_output=True,
                           text=True, timeout=120)
    assert check.stdout.split() == ["False", str(target / "sglang_otel_kernels" / "__init__.py")], check.stderr
    assert check.stderr.count("the pure-Python recording core runs: the compiled core is not built here") == 1


TIMED = r"""
import time, sglang_otel_kernels as sok
from sglang_otel_kernels.record import core
sok.configure(level=1, log_dest="off", trace_file="t.sgltrace", export_sidecar=False)
inner = sok.debug_kernel_api(op_name="inner")(lambda: time.sleep(0.002))
outer = sok.debug_kernel_api(op_name="outer")(lambda: inner())
outer(), outer()  # the first calls go through Python, which names the kernels in the file
(calls, own, closed), recorded = core.native.timing(), core.native.recorded()
for _ in range(50):
    outer()
after = core.native.timing()
for _ in range(10):
    with sok.forward_batch([None]):
        pass
print(sok.__file__, after[0] - calls, core.native.recorded() - recorded, after[1] - own, after[2] - closed,
      core.native.timing()[2] - after[2])
"""


@pytest.mark.skipif(core.native is None, reason="built by the compiler that built the compiled core")
def test_the_timing_build_sums_the_own_time_of_the_calls_it_records(tmp_path, monkeypatch):
    """bench/sglang_own_time.py's build of the core (SOK_TIMING) counts the
    calls it records and their time outside their kernels: a nested call's
    time is not its caller's own; and apart, the time batch spans take to
    close and end."""
    monkeypatch.syspath_prepend(str(ROOT / "bench"))
    from sglang_own_time import timing_build

    root = timing_build(str(tmp_path))
    run = subprocess.run([sys.executable, "-c", TIMED], cwd=tmp_path, env=clean_env(PYTHONPATH=root),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    path, calls, recorded, own, closed_by_calls, closed = run.stdout.split()
    assert path == str(Path(root) / "sglang_otel_kernels" / "__init__.py")
    assert int(calls) == int(recorded) == 100
    # 100 calls' own time, each a few microseconds, far under the 50 sleeps of 2 ms inside the outer calls.
    assert 0 < int(own) < 20_000_000
    assert int(closed_by_calls) == 0 < int(closed)


@pytest.mark.skipif(core.native is None, reason="the compiled wrapper's own check")
def test_the_compiled_wrapper_calls_straight_through_while_torch_compiles(tmp_path):
    """While torch.compiler says it compiles (an export's or AOT trace's
    Python run), the compiled wrapper calls the kernel and records nothing."""
    import torch

    sok.configure(level=1, log_dest="off", trace_file=str(tmp_path / "t.sgltrace"), export_sidecar=False)
    kernel = sok.debug_kernel_api(op_name="sglang.custom_op.traced")(lambda x: x + 1)
    assert type(kernel) is core.native.Recorded
    kernel(torch.ones(2))
    kernel(torch.ones(2))  # the first went through Python (the name into the file), this one through C
    before = core.native.recorded()
    torch.compiler._is_compiling_flag = True
    try:
        assert kernel(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        torch.compiler._is_compiling_flag = False
    assert core.native.recorded() == before
    kernel(torch.ones(2))
    assert core.native.recorded() == before + 1
    calls = [s for s in sok.read_trace_file(str(tmp_path / "t.sgltrace")).spans if s.name == "sglang.custom_op.traced"]
    assert [s.attributes["sglang.kernel.seq"] for s in calls] == sorted(s.attributes["sglang.kernel.seq"] for s in calls)
    assert len(calls) == 3
    sok.configure(level=0, trace_file="off")


@pytest.mark.skipif(core.native is None, reason="the compiled core's own batch spans")
def test_the_compiled_core_opens_a_file_only_batch_itself(tmp_path, capsys):
    """A batch of the trace file alone with no request spans (every decode step
    of an untraced request) is opened by the compiled core; its context is
    detached when it closes, and one already detached is told, not raised."""
    from opentelemetry import context as context_api
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.sampling import ALWAYS_ON

    from sglang_otel_kernels.capture.requests import open_batch

    path = tmp_path / "t.sgltrace"
    sok.configure(level=1, log_dest="off", trace_file=str(path), tracer_provider=TracerProvider(sampler=ALWAYS_ON))
    kernel = sok.debug_kernel_api(op_name="k")(lambda: None)
    kernel()
    before = context_api.get_current()
    opened = open_batch([(None, "a")], "step", None, (1, ("a",)), None, False)
    assert isinstance(opened, core.native.BatchScope)
    assert context_api.get_current() is not before
    kernel()
    opened.close(None)
    assert context_api.get_current() is before
    with pytest.raises(RuntimeError, match="closed twice"):
        opened.close(None)
    # Opened in another context (whose token this one's variable refuses), closed here.
    inner = contextvars.copy_context().run(open_batch, [(None, "a")], "inner", None, None, None, False)
    inner.close(None)
    assert "detaching a batch's context failed (ValueError" in capsys.readouterr().err
    assert context_api.get_current() is before
    sok.configure(level=0)
    spans = {span.name: span for span in sok.read_trace(path)}
    assert spans["step"].attributes["sglang.batch.kernel_calls"] == 1 and not spans["step"].in_flight
    assert [span.parent_span_id for span in sok.read_trace(path) if span.name == "k"][1] == spans["step"].span_id
    assert not spans["inner"].in_flight
