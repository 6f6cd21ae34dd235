"""Every GPU claim of the README and docs/, checked in one run on a machine with CUDA;
on a CPU every section runs and says what it skipped.

Self-contained for a lent machine that has torch but no OpenTelemetry and
no network: fetch the pure-Python wheels here, carry them, install them there.

    python bench/gpu_check.py --fetch-wheels .gpu-wheels        # here (gitignored folder)
    pip install -q --no-index --no-deps --target /tmp/sok-site .gpu-wheels/*.whl   # there
    PYTHONPATH=/tmp/sok-site:. python bench/gpu_check.py --out "$OUT/gpu_check.json"

Without CUDA, `--dry-run` runs decode, syncs and provenance on the CPU against stand-ins (their
code, children and fields checked; their figures say nothing of a GPU); the others say they skipped.

Sections (each isolated: one that fails never stops the others; children
time out after 90 s; about 6 minutes in all), each printed and written to the
JSON summary with what the documentation claims beside what was measured (the first three
are the newest, and run first):
  culprits   the culprit request of a failed batch (describe/culprits.py): a request asking for more
             top logprobs than the logits' width (torch's topk refuses it on the host) named apart from
             its batch mates; an out-of-range token id in an embedding, a device-side assert, in a
             child: the call's error recorded and, as docs/sglang.md says, no culprit named
  coredump   a device-side assert and an illegal address in a decorated call, eagerly and inside a
             replayed CUDA graph, with `run --cuda-coredump`: the dump written, and `report` naming
             the kernel, the exception, the lane and the call or replay it ran in
  nan_check  a graph of 4 decorated layers whose third makes NaN in its second replay, with
             SGLANG_KERNEL_API_GRAPH_NAN_CHECK=1: that replay's span names "3: ..."; 1000 replays
             timed with the check on and off; and killed by SIGKILL before any replay's flags
             were read: the report names it from the flags file (the graph's summary, copied
             into the ring, then by DMA into the file)
  syncs      synchronisations per call, each row a fresh configuration saying what it runs (file only:
             the production path; an in-process exporter; the black box; the NaN flags, with their
             copy at a step's end) at levels 1, 3, 5, 10, in both
             orders, two calls a row, how many the compiled core recorded; during graph capture beside
             the bare kernel captured
  stats      level-5 statistics on 1 GiB float32 and bfloat16 against one aminmax; a dtype sweep
  capture    a CUDA graph captured at levels 3, 5, 10 and in the black box, text log and trace
             file on, an argument object holding a CUDA tensor: captured, replayed
  assert     a device-side assert in a child at levels 1 and 5: span statuses, the crash report
  in_flight  a long kernel at level 5, the child killed by SIGKILL: the call in flight on disk
  level10    a failing CUDA call dumped in one child, re-run in another; after the dump limit a
             call with a 1 GiB input makes no copy
  decode     a decode-like step of 32 bf16 layers at levels 0, 1, 3, 5, the black box (once with
             the trace file on /dev/shm) and the NaN flags (level 1, the black box; level 0 and the flags
             with the step replayed as a CUDA graph), 3 rounds
             of fresh children pinned to one CPU, level 0 in each: the host's launch time of a step,
             its GPU time (behind torch.cuda._sleep), the wall time of steps in a row, page faults,
             calls the compiled core recorded; overhead as host us a call and as wall time of a step
  graphs     a CUDA graph of a 4-layer bf16 stack of decorated kernels: its call list in the trace
             file, 1000 replays timed bare and recorded (goal: the replay span at most 2 us), the
             level-5 output check flagging a replay that made NaN; a child killed while a graph
             holding torch.cuda._sleep runs: the report lists the graph's kernels
  provenance NaN in some rows of a batched bf16 output at level 5: the requests named
             (a row per request, and declared extend rows), the copies made, the synchronisations
             of a clean batched call against one with NaN, each beside the bare kernel's
"""

from __future__ import annotations

import argparse
import collections
import functools
import importlib.util
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch

CUDA = torch.cuda.is_available()
CHILD_TIMEOUT_S = 90
BUDGET_S = 360
WHEELS = ("opentelemetry-api==1.45.2", "opentelemetry-sdk==1.45.2", "opentelemetry-semantic-conventions==0.66b2")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Skip(Exception):
    """A section that cannot run here; the message says why."""


# `--dry-run` on a machine without CUDA: the sections that can, run on the CPU against stand-ins
# (STAND_INS: events timed by the host's clock, synchronize and _sleep doing nothing; host reads of
# tensor values counted where a GPU's synchronisations would be), so that their code and fields are
# checked before a GPU is lent. Their figures say nothing of a GPU.
DRY_RUN = False
STAND_INS = r"""
import time as _time, torch as _torch
class _Event:
    def __init__(self, enable_timing=False, **_):
        self.at = None
    def record(self, stream=None):
        self.at = _time.perf_counter()
    def elapsed_time(self, end):
        return (end.at - self.at) * 1e3
_torch.cuda.Event, _torch.cuda.synchronize, _torch.cuda._sleep = _Event, lambda device=None: None, lambda cycles: None
"""


def device() -> str:
    return "cpu" if DRY_RUN and not CUDA else "cuda"


def need_cuda(stand_in: bool = False) -> None:
    """Skip a section with no CUDA device, unless it runs on stand-ins in a dry run."""
    if not CUDA and not (DRY_RUN and stand_in):
        raise Skip("no CUDA device" + (", and no stand-in for this section" if DRY_RUN else ""))


def _sibling(name: str):
    """A module of bench/ (this file is run as a script and loaded by path from the tests)."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(os.path.dirname(__file__), f"{name}.py"))
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        sys.modules[name] = module
    return sys.modules[name]


def on_device(text: str) -> str:
    """A child's script on this run's device, behind the stand-ins in a dry run."""
    text = text.replace("__DEVICE__", repr(device()))
    return STAND_INS + text if device() == "cpu" else text


def _child_env(**env: str) -> dict:
    settings = {k: v for k, v in os.environ.items() if not k.startswith("SGLANG_KERNEL_API")}
    settings["PYTHONPATH"] = os.pathsep.join(filter(None, [ROOT, os.environ.get("PYTHONPATH")]))
    settings.update(env)
    return settings


def child(script: str, directory: str, timeout: float = CHILD_TIMEOUT_S, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", on_device(script)], cwd=directory, env=_child_env(**env),
                          capture_output=True, text=True, timeout=timeout)


def killed_child(script: str, trace_file: str, level: str, after_s: float) -> None:
    """`script` run at `level` into `trace_file`, killed by SIGKILL `after_s` after its first line."""
    proc = subprocess.Popen([sys.executable, "-c", on_device(script)], stdout=subprocess.PIPE, text=True, env=_child_env(
        SGLANG_KERNEL_API_LOGLEVEL=level, SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_TRACEFILE=trace_file))
    proc.stdout.readline()
    time.sleep(after_s)
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=CHILD_TIMEOUT_S)


def recorded(**settings):
    """Spans into memory at the given settings, not in a black box unless they
    say so (configure() keeps what it is not given: the black box one section
    set up kept every later section's spans from the exporter in the first
    run on an H100); returns the exporter."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    import sglang_otel_kernels as sok

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    sok.configure(tracer_provider=provider, **{"log_dest": "off", "trace_file": "off", "blackbox": False, **settings})
    return exporter


# -- syncs ------------------------------------------------------------------------


def sync_rows(directory: str) -> dict:
    """The rows of `syncs`, each a complete configuration of its own (so
    that none runs in what the row before it left on): label -> settings.
    "File only" is the production path: the trace file the provider's only
    processor (what runs with sidecar export, or none), kernel calls
    recorded by the compiled core where it is built."""
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    file_only, with_exporter = TracerProvider(), TracerProvider()
    with_exporter.add_span_processor(SimpleSpanProcessor(InMemorySpanExporter()))
    rows = {"level 1, file only": {"level": 1}, "level 3, file only": {"level": 3},
            "black box, level 1": {"level": 1, "blackbox": True}, "black box, level 3": {"level": 3, "blackbox": True},
            "level 1, in-process exporter": {"level": 1, "tracer_provider": with_exporter},
            "level 3, in-process exporter": {"level": 3, "tracer_provider": with_exporter},
            "level 5, file only": {"level": 5}, "level 10, file only": {"level": 10},
            "level 1, NaN flags, file only": {"level": 1, "nan_flags": True},
            "black box, NaN flags": {"level": 1, "blackbox": True, "nan_flags": True},
            "level 1, NaN flags and inputs": {"level": 1, "nan_flags": True, "nan_flag_inputs": ("*",)}}
    return {label: {"log_dest": "off", "spans": True, "blackbox": False, "nan_flags": False, "nan_flag_inputs": (),
                    "export_sidecar": False,
                    "tracer_provider": file_only, "dump_dir": os.path.join(directory, "sync-dumps"),
                    "trace_file": os.path.join(directory, f"sync-{number}.sgltrace"), **settings}
            for number, (label, settings) in enumerate(rows.items())}


def sync_table(labels: list, count) -> dict:
    """Each row counted in both orders (forward, then reversed: a row's
    figure must not come from its place), `count(label)` giving its entry."""
    table: dict = {label: {} for label in labels}
    for order, ordered in (("forward", labels), ("reversed", labels[::-1])):
        for label in ordered:
            table[label][order] = count(label)
    return table


def syncs(directory: str) -> dict:
    need_cuda(stand_in=True)
    import sglang_otel_kernels as sok
    from sglang_otel_kernels.capture import nan_flags
    from sglang_otel_kernels.record import core

    x = torch.randn(4, 4096, device=device(), dtype=torch.bfloat16)
    result: dict = {"claim": "0 at levels 1 and 3 and in the black box, file only and with an in-process exporter, "
                             "and with the NaN flags, the inputs' too (their step's end too); "
                             "2 at level 5 (one per side); none during graph capture; each beside the bare kernel's "
                             "own count"}

    def bare(t):  # the kernel every row decorates, counted undecorated first and last
        return t * 2

    bare(x)
    torch.cuda.synchronize()
    result["bare kernel"] = _sync_entry(lambda: bare(x))
    rows = sync_rows(directory)

    counted = iter(range(1 << 30))

    def count(label: str) -> dict:  # each count into a fresh file (a row is counted twice)
        sok.configure(**{**rows[label], "trace_file": rows[label]["trace_file"].replace(".sgltrace", f"-{next(counted)}.sgltrace")})
        kernel = sok.debug_kernel_api(op_name=f"sync.{label}")(bare)
        kernel(x)  # the file opens; a site's first calls go through Python
        kernel(x)
        torch.cuda.synchronize()
        before = core.native.recorded() if core.native is not None else 0
        entry = {"call": _sync_entry(lambda: kernel(x)), "next call": _sync_entry(lambda: kernel(x))}
        entry["of 2 recorded by the compiled core"] = (core.native.recorded() if core.native is not None else 0) - before
        if rows[label]["nan_flags"]:  # the flags copied into the flags file, as at a batch's end
            entry["step's end"] = _sync_entry(nan_flags.step_ended)
        return entry

    result.update(sync_table(list(rows), count))
    if not CUDA:
        result["during capture"] = "not stood in: needs CUDA graphs"
        sok.configure(level=0, trace_file="off")
        result["bare kernel, last"] = _sync_entry(lambda: bare(x))
        return result
    sok.configure(**{**rows["level 5, file only"], "trace_file": os.path.join(directory, "sync-capture.sgltrace")})
    kernel = sok.debug_kernel_api(op_name="sync.capture")(bare)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        kernel(x)
        bare(x)
    torch.cuda.synchronize()

    def captured(fn):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            fn(x)

    result["during capture, bare kernel"] = _sync_entry(lambda: captured(bare))
    result["during capture, level 5 (file only, no black box)"] = _sync_entry(lambda: captured(kernel))
    sok.configure(level=0, trace_file="off")
    result["bare kernel, last"] = _sync_entry(lambda: bare(x))
    return result


def _syncs_in(call) -> list[str]:
    """The synchronisations `call` made, each as the Python line it came from and
    torch's message: the line says whose code synchronised. On the stand-ins,
    the host reads of tensor values it made."""
    if not CUDA:
        with _sibling("host_reads").host_reads() as reads:
            call()
        return reads
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            call()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return [f"{os.path.relpath(w.filename, ROOT) if w.filename.startswith(ROOT) else w.filename}:{w.lineno}: "
            f"{str(w.message).splitlines()[0][:120]}" for w in seen if "synchroniz" in str(w.message)]


def _sync_entry(call) -> "int | dict":
    """A count, with where each synchronisation came from when there were any."""
    sites = _syncs_in(call)
    return {"count": len(sites), "where": sorted(set(sites))} if sites else 0


# -- stats ------------------------------------------------------------------------


def _cuda_ms(fn, repeats: int = 5) -> float:
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def stats(directory: str) -> dict:
    from sglang_otel_kernels.describe.statistics import fill_statistics
    from sglang_otel_kernels.describe.tensors import describe_tensor

    result: dict = {"claim": "two reads of each tensor (aminmax, mean), no float32 copy of a float32, bfloat16 or "
                             "float16 tensor: about 2x one aminmax (before: 2.1 float32, 7.5 bfloat16 on an H100)"}
    sweep = {
        "float8_e4m3fn": lambda d: torch.tensor([1.0, float("nan"), 2.0], device=d).to(torch.float8_e4m3fn),
        "float8_e5m2": lambda d: torch.tensor([1.0, float("inf"), 2.0], device=d).to(torch.float8_e5m2),
        "bool": lambda d: torch.tensor([True, False], device=d),
        "int32": lambda d: torch.tensor([3, -7], device=d, dtype=torch.int32),
        "complex64": lambda d: torch.tensor([3 + 4j, complex(float("nan"), 0)], device=d),
        "non-contiguous": lambda d: torch.arange(12.0, device=d).reshape(3, 4).t(),
        "expanded": lambda d: torch.ones(1, device=d).expand(1000),
    }
    device = "cuda" if CUDA else "cpu"
    for name, make in sweep.items():
        info = describe_tensor(make(device))
        fill_statistics([info])
        result[f"sweep {name}"] = info.stats if info.stats is not None else info.stats_note
    if not CUDA:
        result["1 GiB ratios"] = "skipped: no CUDA device"
        return result
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn((1 << 30) // torch.finfo(dtype).bits * 8, device="cuda", dtype=dtype)
        info = describe_tensor(x)
        base = _cuda_ms(functools.partial(torch.aminmax, x))
        ours = _cuda_ms(lambda: fill_statistics([info]))
        result[f"1 GiB {dtype}"] = {"aminmax_ms": round(base, 3), "statistics_ms": round(ours, 3),
                                    "ratio": round(ours / base, 2)}
        del x
        torch.cuda.empty_cache()
    return result


# -- capture ----------------------------------------------------------------------


class Holder:
    """An argument object holding a CUDA tensor: its repr formats it (and so
    would synchronise, which a capture does not allow)."""

    def __init__(self, tensor):
        self.tensor = tensor

    def __repr__(self):
        return f"Holder({self.tensor})"


def capture(directory: str) -> dict:
    need_cuda()
    import sglang_otel_kernels as sok

    result = {"claim": "capture succeeds and replays at every level, nothing synchronises"}
    settings = {"level 3": dict(level=3), "level 5": dict(level=5),
                "level 10": dict(level=10, dump_dir=os.path.join(directory, "capture-dumps")),
                "black box": dict(level=1, blackbox=True)}
    for label, options in settings.items():
        try:
            recorded(log_dest=os.path.join(directory, "capture.log"),
                     trace_file=os.path.join(directory, f"capture_{label.replace(' ', '_')}.sgltrace"), **options)
            kernel = sok.debug_kernel_api(op_name=f"capture_{label}")(lambda holder, x: x * 2)
            holder, static_in = Holder(torch.ones(4, device="cuda")), torch.ones(1024, device="cuda")
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                kernel(holder, static_in)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                static_out = kernel(holder, static_in)
            static_in.fill_(3.0)
            graph.replay()
            torch.cuda.synchronize()
            result[label] = "captured, replay " + ("right" if bool((static_out == 6).all()) else "WRONG")
        except Exception as exc:
            result[label] = f"FAILED: {type(exc).__name__}: {exc}"[:300]
    return result


# -- assert / in flight -----------------------------------------------------------

CHILD_ASSERT = r"""
import torch, sglang_otel_kernels as sok
embedding = sok.debug_kernel_api(op_name="sglang.custom_op.embedding")(torch.nn.functional.embedding)
scale = sok.debug_kernel_api(op_name="sglang.custom_op.scale")(lambda x: x * 2)
table = torch.randn(32, 8, device="cuda")
for step in range(3):
    scale(embedding(torch.tensor([[1, 2]], device="cuda"), table))
scale(embedding(torch.tensor([[1, 99]], device="cuda"), table))  # out of bounds: device-side assert
scale(torch.ones(4, device="cuda"))  # the next call: must not be blamed
torch.cuda.synchronize()
"""


def device_assert(directory: str) -> dict:
    need_cuda()
    from sglang_otel_kernels import read_trace_file
    from sglang_otel_kernels.recover.report import build_report, render_text

    result = {"claim": "level 5: the failing call ERROR with the CUDA error, the next call not blamed; level 1: the "
                       "error raised by the script's synchronisation after the calls, the report names it (uncaught, "
                       "a device error, after the last call) and exits 1"}
    for level in ("1", "5"):
        path = os.path.join(directory, f"assert_{level}.sgltrace")
        proc = child(CHILD_ASSERT, directory, SGLANG_KERNEL_API_LOGLEVEL=level, SGLANG_KERNEL_API_LOGDEST="off",
                     SGLANG_KERNEL_API_TRACEFILE=path)
        contents = read_trace_file(path)
        report = build_report([contents], last=3)
        result[f"level {level}"] = {
            "exit": proc.returncode,
            "uncaught": [(e["exception"]["type"], e["device_error"], e["last_call"]) for info in report["files"]
                         for e in info["uncaught"]],
            "spans": [(s.name, s.status_code, s.status_description[:160], s.in_flight) for s in contents.spans[-4:]],
            # The call after the failing one meets the same sticky error: its span must say it is not its own.
            "last span's note": (contents.spans[-1].status_description or "").split("\n")[-1][-240:],
            "report": render_text(report)[:1500],
        }
    return result


CHILD_SLEEP = r"""
import sys, torch, sglang_otel_kernels as sok
sleep = sok.debug_kernel_api(op_name="sglang.custom_op.long_kernel")(lambda x: torch.cuda._sleep(10**10) or x)
print("started", flush=True)
sleep(torch.ones(4, device="cuda"))
torch.cuda.synchronize()
"""


def in_flight(directory: str) -> dict:
    need_cuda()
    from sglang_otel_kernels import read_trace_file

    path = os.path.join(directory, "sleep.sgltrace")
    killed_child(CHILD_SLEEP, path, "5", 5)  # in the kernel (or in the statistics' synchronisation after it)
    spans = read_trace_file(path).spans
    return {"claim": "the call in flight, with its inputs, after SIGKILL",
            "in flight": [(s.name, s.attributes.get("sglang.kernel.input.arg0.shape")) for s in spans if s.in_flight]}


# -- level 10 ---------------------------------------------------------------------

CHILD_DUMP = r"""
import torch, sglang_otel_kernels as sok
from gpu_check_kernels import gather
table = torch.randn(32, 8, device="cuda")
sok.debug_kernel_api(gather)(table, torch.tensor([1, 99], device="cuda"))
torch.cuda.synchronize()
"""


def level10(directory: str) -> dict:
    need_cuda()
    with open(os.path.join(directory, "gpu_check_kernels.py"), "w") as handle:
        handle.write("def gather(table, index):\n    return table[index]\n")
    dumps = os.path.join(directory, "dumps10")
    child(CHILD_DUMP, directory, SGLANG_KERNEL_API_LOGLEVEL="10", SGLANG_KERNEL_API_LOGDEST="off",
          SGLANG_KERNEL_API_DUMP_DIR=dumps, SGLANG_KERNEL_API_TRACEFILE="off",
          PYTHONPATH=os.pathsep.join(filter(None, [directory, ROOT, os.environ.get("PYTHONPATH")])))
    found = [os.path.join(root, d) for root, dirs, _ in os.walk(dumps) for d in dirs
             if os.path.exists(os.path.join(root, d, "metadata.json"))]
    result: dict = {"claim": "rerun says 'reproduced a failure'; past the limit no device-to-host copy"}
    if found:
        rerun = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "rerun", found[0], "--function",
                                "gpu_check_kernels:gather"], cwd=directory, capture_output=True, text=True,
                               timeout=CHILD_TIMEOUT_S,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                                   filter(None, [directory, ROOT, os.environ.get("PYTHONPATH")]))})
        result["rerun"] = {"exit": rerun.returncode, "stdout": rerun.stdout[-1200:],
                           "stderr lines": len(rerun.stderr.splitlines()), "stderr tail": rerun.stderr[-300:]}
    else:
        result["rerun"] = "no dump was written"
    import sglang_otel_kernels as sok

    recorded(level=10, dump_dir=os.path.join(directory, "limit"), dump_max_count=1)
    kernel = sok.debug_kernel_api(op_name="big")(lambda pool, x: x)
    pool = torch.empty((1 << 30) // 4, device="cuda")
    kernel(torch.ones(1, device="cuda"), torch.ones(1, device="cuda"))  # the one dump allowed
    torch.cuda.synchronize()
    start = time.perf_counter()
    kernel(pool, torch.ones(1, device="cuda"))
    torch.cuda.synchronize()
    result["call with 1 GiB input after the limit (ms)"] = round((time.perf_counter() - start) * 1000, 2)
    return result


# -- decode -----------------------------------------------------------------------

# A stack of bf16 layers (LAYERS of HIDDEN), each one `kernel` call, and `step()` through them.
STACK = r"""
import json, os, statistics, sys, time, torch, sglang_otel_kernels as sok
layers = [torch.randn(HIDDEN, HIDDEN, device=__DEVICE__, dtype=torch.bfloat16) / 64 for _ in range(LAYERS)]
def layer(x, w):
    return torch.nn.functional.silu(x @ w)
kernel = layer if os.environ["SGLANG_KERNEL_API_LOGLEVEL"] == "0" else \
    sok.debug_kernel_api(op_name="sglang.custom_op.layer")(layer)
x = torch.randn(8, HIDDEN, device=__DEVICE__, dtype=torch.bfloat16)
from sglang_otel_kernels.capture.nan_flags import step_ended
def step():
    h = x
    for w in layers:
        h = kernel(h, w)
    step_ended()  # as a batch's end: the NaN flags (when on) copied into their file
    return h
"""


def stack(layers: int, hidden: int) -> str:
    return STACK.replace("LAYERS", str(layers)).replace("HIDDEN", str(hidden))


CHILD_DECODE = r"""
import resource
from sglang_otel_kernels.record import core
run = step
if os.environ.get("DECODE_IN_GRAPH") == "1":  # the step captured once, replayed (SGLang's decode)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3): step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    def run():
        graph.replay()
        step_ended()
for _ in range(5): run()
torch.cuda.synchronize()
faults = lambda: resource.getrusage(resource.RUSAGE_THREAD).ru_minflt
began, ended = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
rows = {"host_ms": [], "gpu_ms": [], "wall_ms": [], "faults": []}
for _ in range(7):
    torch.cuda.synchronize()  # the host's time to launch one step, from an idle GPU
    before, start = faults(), time.perf_counter()
    run()
    rows["host_ms"].append((time.perf_counter() - start) * 1e3)
    rows["faults"].append(faults() - before)
    torch.cuda.synchronize()
    torch.cuda._sleep(100_000_000)  # the GPU's time of one step, queued behind a sleep: the host cannot starve it
    began.record()
    run()
    ended.record()
    torch.cuda.synchronize()
    rows["gpu_ms"].append(began.elapsed_time(ended))
    start = time.perf_counter()  # steps in a row, as a server runs them
    for _ in range(10): run()
    torch.cuda.synchronize()
    rows["wall_ms"].append((time.perf_counter() - start) / 10 * 1e3)
found = {key: statistics.median(values) for key, values in rows.items()}
found["recorded_by_the_compiled_core"] = core.native.recorded() if core.native is not None else 0
print(json.dumps(found))
"""
# label -> (level, black box, where the trace file goes: None for the run's directory, the NaN flags, the step
# replayed as a CUDA graph). A graph's rows are measured against "level 0, graph".
DECODE_MODES = {"level 0": ("0", "0", None, "0", "0"), "level 1": ("1", "0", None, "0", "0"),
                "level 3": ("3", "0", None, "0", "0"), "level 5": ("5", "0", None, "0", "0"),
                "black box": ("1", "1", None, "0", "0"), "black box, level 3": ("3", "1", None, "0", "0"),
                "black box, /dev/shm": ("1", "1", "/dev/shm", "0", "0"),
                "NaN flags, level 1": ("1", "0", None, "1", "0"), "NaN flags, black box": ("1", "1", None, "1", "0"),
                "level 0, graph": ("0", "0", None, "0", "1"), "NaN flags, level 1, graph": ("1", "0", None, "1", "1")}
DECODE_ROUNDS = 3
DECODE_CALLS = 32  # recorded calls a step


def _pinned():
    """Children pinned to one CPU, the same for all: none runs on a core another left cold or busy."""
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    return (lambda: os.sched_setaffinity(0, {cpus[-1]})) if cpus else None


def decode_figures(found: dict) -> dict:
    """Medians and ranges over the rounds of each mode (`found`: label ->
    the children's rows), and the overhead two ways against level 0 of the
    same rounds (a graph's rows against level 0's graph): the host
    microseconds a recorded (or captured) call adds to the launch of a
    step, and the wall time it adds to steps in a row; and which side
    bounds the step."""
    result: dict = {}
    for label, rows in found.items():
        if not rows:
            continue
        figure = {key: {"median": round(statistics.median(row[key] for row in rows), 3),
                        "range": [round(min(row[key] for row in rows), 3), round(max(row[key] for row in rows), 3)]}
                  for key in ("host_ms", "gpu_ms", "wall_ms", "faults")}
        figure["bound_by"] = "host" if figure["host_ms"]["median"] > figure["gpu_ms"]["median"] else "gpu"
        figure["recorded_by_the_compiled_core"] = max(row["recorded_by_the_compiled_core"] for row in rows)
        result[label] = figure
    for label, figure in result.items():
        base = result.get("level 0, graph" if label.endswith(", graph") else "level 0")
        if base is not None and base is not figure:
            figure["added_host_us_a_call"] = round(
                (figure["host_ms"]["median"] - base["host_ms"]["median"]) * 1e3 / DECODE_CALLS, 2)
            figure["added_wall_of_a_step"] = f"{(figure['wall_ms']['median'] / base['wall_ms']['median'] - 1) * 100:.1f} %"
    return result


def decode(directory: str) -> dict:
    """A decode-like step of 32 bf16 layers in each mode: fresh children,
    DECODE_ROUNDS rounds in turn (level 0 in each), all pinned to one CPU;
    per mode the host's time to launch a step from an idle GPU, the GPU's
    time of a step (CUDA events, the step queued behind torch.cuda._sleep),
    the wall time of steps in a row, the calling thread's page faults a
    step and the calls the compiled core recorded (0: Python recorded
    them). A dry run's layers are 256 wide."""
    need_cuda(stand_in=True)
    found: dict = {label: [] for label in DECODE_MODES}
    failures: dict = {}
    pin = _pinned()
    code = on_device(stack(32, 4096 if CUDA else 256) + CHILD_DECODE)
    shm = tempfile.mkdtemp(prefix="sok-gpu-check-", dir="/dev/shm") if os.path.isdir("/dev/shm") else None
    try:
        for _ in range(DECODE_ROUNDS):
            for label, (level, blackbox, where, flags, graph) in DECODE_MODES.items():
                if where == "/dev/shm" and shm is None:
                    failures[label] = "no /dev/shm here"
                    continue
                if graph == "1" and not CUDA:
                    failures[label] = "not stood in: needs CUDA graphs"
                    continue
                folder = shm if where == "/dev/shm" else directory
                proc = subprocess.run(
                    [sys.executable, "-c", code], cwd=directory, capture_output=True, text=True,
                    timeout=CHILD_TIMEOUT_S, preexec_fn=pin, env=_child_env(
                        SGLANG_KERNEL_API_LOGLEVEL=level, SGLANG_KERNEL_API_LOGDEST="off",
                        SGLANG_KERNEL_API_BLACKBOX=blackbox, SGLANG_KERNEL_API_NAN_FLAGS=flags, DECODE_IN_GRAPH=graph,
                        SGLANG_KERNEL_API_TRACEFILE=os.path.join(folder, f"decode_{level}_{blackbox}_%i.sgltrace")))
                if proc.returncode != 0:
                    failures[label] = f"FAILED: {proc.stderr.strip()[-300:]}"
                    continue
                found[label].append(json.loads(proc.stdout.splitlines()[-1]))
    finally:
        if shm is not None:
            shutil.rmtree(shm, ignore_errors=True)
    return {"claim": "black box <= 2 %, level 1 <= 3 % of a host-bound 32-layer decode step's wall time "
                     "(added_wall_of_a_step), the host time a call adds beside it (added_host_us_a_call); "
                     "the NaN flags at most 5 % eager, 2 % in a CUDA graph (against level 0, graph)",
            **decode_figures(found), **failures}


# -- graphs -----------------------------------------------------------------------

CHILD_GRAPH = stack(4, 1024) + r"""
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    for _ in range(3):
        step()
torch.cuda.current_stream().wait_stream(stream)
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = step()
sok.watch_graph_outputs(graph, out)
recorded = graph.replay
bare = getattr(torch.cuda.CUDAGraph.replay, "__wrapped__", None)
def per_replay_us(fn, *args):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        fn(*args)
    launched = time.perf_counter()
    torch.cuda.synchronize()
    return (launched - start) * 1e3, (time.perf_counter() - start) * 1e3
result = {}
if bare is not None:
    rows = {"bare": [], "recorded": []}
    for _ in range(5):
        rows["bare"].append(per_replay_us(bare, graph))
        rows["recorded"].append(per_replay_us(recorded))
    for key, samples in rows.items():
        result[key + " launch us"] = round(statistics.median(s[0] for s in samples), 2)
        result[key + " with the GPU us"] = round(statistics.median(s[1] for s in samples), 2)
    result["replay span us (launch)"] = round(result["recorded launch us"] - result["bare launch us"], 2)
x.fill_(float("nan"))
graph.replay()
torch.cuda.synchronize()
print(json.dumps(result), flush=True)
"""

CHILD_GRAPH_SLEEP = r"""
import torch, sglang_otel_kernels as sok
layer = sok.debug_kernel_api(op_name="sglang.custom_op.layer")(lambda x, w: torch.nn.functional.silu(x @ w))
sleep = sok.debug_kernel_api(op_name="sglang.custom_op.long_kernel")(lambda x: torch.cuda._sleep(10**10) or x)
x, w = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16), torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
stream = torch.cuda.Stream()  # cuBLAS warmed up on a side stream, as before any capture; the sleep is not run
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    layer(x, w)
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = layer(sleep(layer(x, w)), w)
graph.replay()
print("replayed", flush=True)
torch.cuda.synchronize()  # where a process waits on a hung graph
"""


def graphs(directory: str) -> dict:
    need_cuda()
    from sglang_otel_kernels import read_trace_file
    from sglang_otel_kernels.recover.report import build_report, render_text

    result: dict = {"claim": "the call list kept; a replay span at most 2 us over a bare replay; NaN made inside "
                             "the graph flags its replay; a child killed during a replay: the report lists its kernels"}
    for level, check in (("1", "0"), ("5", "1")):
        path = os.path.join(directory, f"graph_{level}.sgltrace")
        proc = child(CHILD_GRAPH, directory, SGLANG_KERNEL_API_LOGLEVEL=level, SGLANG_KERNEL_API_LOGDEST="off",
                     SGLANG_KERNEL_API_TRACEFILE=path, SGLANG_KERNEL_API_GRAPH_OUTPUT_CHECK=check)
        if proc.returncode != 0:
            result[f"level {level}"] = f"FAILED: {proc.stderr.strip()[-400:]}"
            continue
        contents = read_trace_file(path)
        replays = [s for s in contents.spans if s.name == "cuda_graph.replay"]
        result[f"level {level}"] = {
            **json.loads(proc.stdout.strip().splitlines()[-1]),
            "graphs": {str(gid): [name for name, _, _ in calls] for gid, (calls, _) in contents.graphs.items()},
            "captured positions": [s.attributes.get("sglang.cuda_graph.position") for s in contents.spans
                                   if s.attributes.get("sglang.cuda_graph.position")],
            "replay spans": len(replays),
            "last replay": {k: v for k, v in replays[-1].attributes.items() if k != "sglang.kernel.name"}
            if replays else None,
        }
    path = os.path.join(directory, "graph_sleep.sgltrace")
    killed_child(CHILD_GRAPH_SLEEP, path, "1", 3)  # the graph's sleep kernel runs about 5 s
    report = build_report([read_trace_file(path)], last=3)
    result["killed during a replay"] = {
        "replay at death": [(c["graph"]["id"], c["graph"]["replay"], [k["name"] for k in c["graph"]["calls"]])
                            for c in report["graph_replay_at_death"]],
        "report": render_text(report)[:1500],
    }
    return result


# -- CUDA core dumps and the NaN check inside graphs -------------------------------

# Run from a file: Triton reads its kernels' source.
CHILD_FAULT = r"""
import sys, torch, sglang_otel_kernels as sok
kind, where = sys.argv[1], sys.argv[2]
layer = sok.debug_kernel_api(op_name="sglang.custom_op.layer")(lambda x, w: torch.nn.functional.silu(x @ w))
if kind == "illegal":
    import triton, triton.language as tl

    @triton.jit
    def gather_rows(out, table, index, width, BLOCK: tl.constexpr):
        # No bounds check: an index past the table reads outside it (an illegal address, not an assert).
        row, cols = tl.program_id(0), tl.arange(0, BLOCK)
        source = tl.load(index + row)
        tl.store(out + row * width + cols, tl.load(table + source * width + cols, mask=cols < width), mask=cols < width)

def lookup(table, index):
    if kind != "illegal":
        return table[index]  # bounds-checked on the device: a device-side assert
    out = torch.empty(index.numel(), table.shape[1], device=table.device)
    gather_rows[(index.numel(),)](out, table, index, table.shape[1], BLOCK=1024)
    return out
gather = sok.debug_kernel_api(op_name="sglang.custom_op.gather")(lookup)
table = torch.randn(64, 1024, device="cuda")
index = torch.zeros(8, dtype=torch.long, device="cuda")
w = torch.randn(1024, 1024, device="cuda")
bad = 10**9 if kind == "illegal" else 64
if where == "eager":
    layer(gather(table, index), w)
    torch.cuda.synchronize()
    index.fill_(bad)
    print("faulting", flush=True)
    layer(gather(table, index), w)
    torch.cuda.synchronize()
else:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        layer(gather(table, index), w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = layer(gather(table, index), w)
    graph.replay()
    torch.cuda.synchronize()
    index.fill_(bad)
    print("faulting", flush=True)
    graph.replay()
    torch.cuda.synchronize()
"""


def coredump(directory: str) -> dict:
    need_cuda()
    result: dict = {"claim": "a dump per fault, beside the trace file; report names the kernel, the exception, "
                             "the lane, and the call (eager) or the replay with its captured calls (graph)"}
    script = os.path.join(directory, "gpu_check_fault.py")
    with open(script, "w") as handle:
        handle.write(CHILD_FAULT)
    kinds = ["assert"]
    if importlib.util.find_spec("triton") is not None:
        kinds.append("illegal")
    else:
        result["illegal"] = "skipped: no Triton to write a kernel that reads outside its table"
    for kind in kinds:
        for where in ("eager", "graph"):
            folder = os.path.join(directory, f"dump_{kind}_{where}")
            os.makedirs(folder)
            started = time.monotonic()
            launcher = subprocess.Popen(
                [sys.executable, "-m", "sglang_otel_kernels", "run", "--cuda-coredump", "--level", "1", "--",
                 sys.executable, script, kind, where], cwd=folder, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, text=True, start_new_session=True, env=_child_env(
                    SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_TRACEFILE=os.path.join(folder, "t_%i.sgltrace")))
            try:
                _, stderr = launcher.communicate(timeout=CHILD_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                # The launcher and the faulting process with it, so that neither holds the GPU for the sections
                # after; a driver that hangs writing one dump would hang the others too, so they are not tried.
                os.killpg(launcher.pid, signal.SIGKILL)
                _, stderr = launcher.communicate()
                result[f"{kind} {where}"] = {"timed out after s": CHILD_TIMEOUT_S, "dumps": sorted(os.listdir(folder)),
                                             "stderr tail": stderr.strip()[-600:]}
                return result
            seconds = round(time.monotonic() - started, 1)
            report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", folder, "--json"],
                                    capture_output=True, text=True, timeout=CHILD_TIMEOUT_S, env=_child_env())
            entry: dict = {"exit": launcher.returncode, "seconds with the dump": seconds,
                           "dumps": sorted(name for name in os.listdir(folder) if name.startswith("cuda_coredump")),
                           "stderr tail": stderr.strip()[-600:]}
            try:
                faults = json.loads(report.stdout)["device_faults"]
                entry["faults"] = [{key: fault[key] for key in ("exception", "kernel", "device_name", "sm", "warp",
                                                                "lane", "grid", "block", "placed")}
                                   | {"call": (fault["call"] or {}).get("name"),
                                      "graph calls": [(k["name"], k["matches_kernel"]) for k in
                                                      ((fault["call"] or {}).get("graph") or {}).get("calls", [])]}
                                   for fault in faults[:2]]
            except (ValueError, KeyError) as exc:
                entry["report"] = f"{type(exc).__name__}: {report.stderr.strip()[-400:] or report.stdout[:400]}"
            result[f"{kind} {where}"] = entry
    return result


CHILD_NAN_GRAPH = r"""
import json, os, signal, statistics, time, torch, sglang_otel_kernels as sok
KILL = os.environ.get("NAN_GRAPH_KILL") == "1"
WEIGHT = os.environ.get("NAN_GRAPH_WEIGHT") == "1"  # the NaN in the layers' weight, from before the graph
if KILL:  # never read live: what the report names comes from the flags file the DMA wrote
    from sglang_otel_kernels.capture import nan_flags
    nan_flags.FlagRing._first_flagged = lambda self, start, end: None
scale = torch.ones(1, device="cuda")
layers = [sok.debug_kernel_api(op_name=f"sglang.custom_op.layer{i}")(
    (lambda x, w: torch.nn.functional.silu(x @ w) * scale) if i == 2 else (lambda x, w: torch.nn.functional.silu(x @ w)))
    for i in range(4)]
x, w = torch.randn(8, 1024, device="cuda"), torch.randn(1024, 1024, device="cuda") / 32
def step():
    y = x
    for layer in layers:
        y = layer(y, w)
    return y
stream = torch.cuda.Stream()
stream.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(stream):
    step()
torch.cuda.synchronize()
graph = torch.cuda.CUDAGraph()
with torch.cuda.graph(graph):
    out = step()
graph.replay()
saved = w[0, 0].clone()
(w[0, 0] if WEIGHT else scale).fill_(float("nan"))
graph.replay()
w[0, 0].copy_(saved)
scale.fill_(1.0)
graph.replay()
torch.cuda.synchronize()
if KILL:
    os.kill(os.getpid(), signal.SIGKILL)
samples = []
for _ in range(5):
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(1000):
        graph.replay()
    torch.cuda.synchronize()
    samples.append((time.perf_counter() - start) * 1e3)
print(json.dumps({"replay us": round(statistics.median(samples), 2)}), flush=True)
"""


def nan_check(directory: str) -> dict:
    need_cuda()
    from sglang_otel_kernels import read_trace_file

    result: dict = {"claim": "the second replay's span names '3: sglang.custom_op.layer2'; the others none; the "
                             "check's cost per replay (check on against off); killed by SIGKILL after the replays "
                             "without reading their flags, the report names it from the flags file alone; with the "
                             "NaN flags and the layers' inputs at level 1, a NaN put in their weight before the "
                             "second replay goes into '1: sglang.custom_op.layer0' through input.arg1, from the file"}
    for check in ("0", "1"):
        path = os.path.join(directory, f"nan_graph_{check}.sgltrace")
        proc = child(CHILD_NAN_GRAPH, directory, SGLANG_KERNEL_API_LOGLEVEL="5", SGLANG_KERNEL_API_LOGDEST="off",
                     SGLANG_KERNEL_API_TRACEFILE=path, SGLANG_KERNEL_API_GRAPH_NAN_CHECK=check)
        if proc.returncode != 0:
            result[f"check {check}"] = f"FAILED: {proc.stderr.strip()[-400:]}"
            continue
        replays = [s for s in read_trace_file(path).spans if s.name == "cuda_graph.replay"]
        result[f"check {check}"] = {**json.loads(proc.stdout.strip().splitlines()[-1]),
                                    "first three replays": [s.attributes.get("sglang.cuda_graph.first_nonfinite")
                                                            for s in replays[:3]]}
    path = os.path.join(directory, "nan_graph_killed.sgltrace")
    proc = child(CHILD_NAN_GRAPH, directory, SGLANG_KERNEL_API_LOGLEVEL="5", SGLANG_KERNEL_API_LOGDEST="off",
                 SGLANG_KERNEL_API_TRACEFILE=path, SGLANG_KERNEL_API_GRAPH_NAN_CHECK="1", NAN_GRAPH_KILL="1")
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path, "--json"],
                            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    try:
        first = json.loads(report.stdout)["first_nonfinite_output"] or {}
        result["check 1, killed"] = {"exit": proc.returncode, "seen by": first.get("nonfinite_seen_by"),
                                     "named": (first.get("graph") or {}).get("first_nonfinite")}
    except ValueError:
        result["check 1, killed"] = f"FAILED: {report.stderr.strip()[-400:]} {proc.stderr.strip()[-400:]}"
    path = os.path.join(directory, "nan_graph_inputs.sgltrace")
    proc = child(CHILD_NAN_GRAPH, directory, SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                 SGLANG_KERNEL_API_TRACEFILE=path, SGLANG_KERNEL_API_NAN_FLAGS="1",
                 SGLANG_KERNEL_API_NAN_FLAGS_INPUTS="sglang.custom_op.layer*", NAN_GRAPH_KILL="1", NAN_GRAPH_WEIGHT="1")
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", path, "--json"],
                            capture_output=True, text=True, timeout=CHILD_TIMEOUT_S)
    try:
        first = json.loads(report.stdout)["first_nonfinite_output"] or {}
        result["flags and inputs, weight poisoned, killed"] = {
            "exit": proc.returncode, "named": (first.get("graph") or {}).get("first_nonfinite"),
            "nonfinite_inputs": first.get("nonfinite_inputs")}
    except ValueError:
        result["flags and inputs, weight poisoned, killed"] = \
            f"FAILED: {report.stderr.strip()[-400:]} {proc.stderr.strip()[-400:]}"
    return result


# -- culprits --------------------------------------------------------------------

CHILD_EMBEDDING = r"""
import torch, sglang_otel_kernels as sok
from opentelemetry.trace import SpanContext, TraceFlags
from sglang_otel_kernels.describe.culprits import out_of_range

def lookup(ids, table):
    try:
        return torch.nn.functional.embedding(ids, table)
    except IndexError as exc:  # as the SGLang integration's rule: read on the CPU only
        out_of_range(exc, ids, table, "the embedding")
        raise

embedding = sok.debug_kernel_api(op_name="embedding")(lookup)
members = [(SpanContext(0xA0 + n, 0xB0 + n, True, TraceFlags(1)), f"r{n}") for n in range(3)]
with sok.forward_batch(members, name="extend", rows=[2, 2, 2]):
    embedding(torch.tensor([5, 6, 7, 99999, 8, 9], device="cuda"), torch.randn(320, 8, device="cuda"))
torch.cuda.synchronize()
"""


def culprits(directory: str) -> dict:
    """The culprit rules on a GPU: the sampler's, in process; the embedding's, in a child (a device-side assert)."""
    need_cuda()
    import sglang_otel_kernels as sok
    from opentelemetry.trace import SpanContext, TraceFlags
    from sglang_otel_kernels import read_trace_file
    from sglang_otel_kernels.describe.culprits import more_than

    exporter = recorded(level=1)

    def sample(logits, top_logprobs_nums):
        try:
            return torch.log_softmax(logits, dim=-1).topk(max(top_logprobs_nums), dim=-1)
        except RuntimeError as exc:  # as the SGLang integration's rule for Sampler.forward
            if "selected index k out of range" in str(exc):
                more_than(exc, top_logprobs_nums, logits.shape[-1], "top_logprobs_num", "tokens of the vocabulary")
            raise

    sampler = sok.debug_kernel_api(op_name="sampler")(sample)
    members = [(SpanContext(0xA0 + n, 0xB0 + n, True, TraceFlags(1)), f"r{n}") for n in range(3)]
    raised = None
    with sok.forward_batch(members, name="decode"):
        try:
            sampler(torch.zeros(3, 320, device="cuda"), [2, 500, 1])
        except RuntimeError as exc:
            raised = str(exc).splitlines()[0]
    [call] = [s for s in exporter.get_finished_spans()
              if s.name == "sampler" and "sglang.kernel.copy_of" not in s.attributes]
    path = os.path.join(directory, "embedding.sgltrace")
    proc = child(CHILD_EMBEDDING, directory, SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                 SGLANG_KERNEL_API_TRACEFILE=path, CUDA_LAUNCH_BLOCKING="1")
    lookups = [s for s in read_trace_file(path).spans if s.name == "embedding"] if os.path.exists(path) else []
    return {"claim": "the sampler: RuntimeError raised in the call, culprit_requests ('r1',); the embedding: the "
                     "child fails with the device-side assert, its call ERROR, no culprit named",
            "sampler raised": raised, "sampler culprit": list(call.attributes.get("sglang.kernel.culprit_requests")
                                                            or ()),
            "sampler why": call.attributes.get("sglang.kernel.culprit"),
            "embedding child exit": proc.returncode, "embedding stderr": proc.stderr.strip()[-300:],
            "embedding spans": [(s.status_code, (s.status_description or "")[:160],
                                 s.attributes.get("sglang.kernel.culprit")) for s in lookups]}


# -- provenance ------------------------------------------------------------------


def provenance(directory: str) -> dict:
    """NaN rows of a batched CUDA output mapped to their requests, and what a
    clean batch costs, each beside the bare kernel's own synchronisations
    (its `y[rows] = nan` with a Python list index makes some)."""
    need_cuda(stand_in=True)
    import sglang_otel_kernels as sok

    exporter = recorded(level=5)

    def nan_rows(x, rows):
        y = x * 2
        y[rows] = float("nan")
        return y

    from opentelemetry.trace import SpanContext, TraceFlags

    kernel = sok.debug_kernel_api(op_name="provenance")(nan_rows)
    # Eight requests from a client's traceparents.
    members = [(SpanContext(0xA0 + index, 0xB0 + index, True, TraceFlags(1)), f"r{index}") for index in range(8)]
    x = torch.randn(8, 4096, device=device(), dtype=torch.bfloat16)
    flat = torch.randn(24, 4096, device=device(), dtype=torch.bfloat16)
    nan_rows(x, [])
    with sok.forward_batch(members, name="decode"):
        kernel(x, [])
        torch.cuda.synchronize()
        bare = {"clean": _sync_entry(lambda: nan_rows(x, [])), "with NaN": _sync_entry(lambda: nan_rows(x, [5]))}
        clean = _sync_entry(lambda: kernel(x, []))
        flagged = _sync_entry(lambda: kernel(x, [5]))
    with sok.forward_batch(members, name="extend", rows=[3] * 8):
        kernel(flat, [4, 23])  # rows 3-5: r1; 21-23: r7
    finished = exporter.get_finished_spans()
    sok.configure(level=0)
    calls = [s for s in finished if s.name == "provenance" and "sglang.kernel.copy_of" not in s.attributes]
    named = [s.attributes.get("sglang.kernel.nonfinite_requests") for s in calls[-2:]]
    copies = sum("sglang.kernel.copy_of" in s.attributes for s in finished)
    return {"claim": "a clean batched call: level 5's two synchronisations (one per side) over the bare kernel's; "
                     "with NaN: 4 (the counts, then the rows) over the bare kernel's; rows mapped to r5 (decode) and "
                     "r1, r7 (extend rows); 3 copies",
            "runs": "level 5 (the Python core), an in-process exporter, no trace file, no black box",
            "syncs clean": clean, "syncs with NaN": flagged,
            "syncs clean, bare kernel": bare["clean"], "syncs with NaN, bare kernel": bare["with NaN"],
            "named": [list(n or ()) for n in named], "copies": copies,
            "spans": dict(collections.Counter(s.name for s in finished)),
            "last call's statistics": {k: v for k, v in (calls[-1].attributes.items() if calls else ())
                                       if k.endswith((".stats", ".has_nan", ".nan_count"))}}


SECTIONS = {"culprits": culprits, "coredump": coredump, "nan_check": nan_check, "syncs": syncs, "stats": stats, "capture": capture, "assert": device_assert, "in_flight": in_flight,
            "level10": level10, "decode": decode, "graphs": graphs, "provenance": provenance}


def environment(directory: str) -> dict:
    """What a per-call figure depends on besides the code: the clock the
    kernel reads time from (a clock read is a system call where it is no
    `tsc`: kvm-clock, hpet, xen), what one `time.time_ns()` costs here, and
    the filesystem of the trace files (a network one makes the first lap's
    pages round trips)."""
    from sglang_otel_kernels.filesystems import filesystem_of

    try:
        with open("/sys/devices/system/clocksource/clocksource0/current_clocksource") as source:
            clocksource = source.read().strip()
    except OSError:
        clocksource = None
    reads, rounds = 200_000, []
    for _ in range(5):
        began = time.perf_counter_ns()
        for _ in range(reads):
            time.time_ns()
        middle = time.perf_counter_ns()
        for _ in range(reads):
            pass
        rounds.append((2 * middle - began - time.perf_counter_ns()) / reads)  # the reads less the loop
    return {"clocksource": clocksource, "time_ns_cost_ns": round(max(sorted(rounds)[2], 0.0), 1),
            "trace_dir": directory, "trace_dir_filesystem": filesystem_of(directory),
            "dev_shm_filesystem": filesystem_of("/dev/shm") if os.path.isdir("/dev/shm") else None}


def fetch_wheels(folder: str) -> int:
    """The pure-Python wheels the lent machine lacks, downloaded here."""
    os.makedirs(folder, exist_ok=True)
    return subprocess.call([sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", "--only-binary=:all:",
                            "-d", folder, *WHEELS])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", help="where to write the JSON summary")
    parser.add_argument("--fetch-wheels", metavar="FOLDER", help="download the wheels to carry, and stop")
    parser.add_argument("--only", nargs="*", choices=sorted(SECTIONS), help="run only these sections")
    parser.add_argument("--budget", type=float, default=BUDGET_S, metavar="SECONDS",
                        help="sections not begun this long after the start are skipped (the lent machine's time)")
    parser.add_argument("--dry-run", action="store_true",
                        help="without CUDA, run the decode, syncs and provenance sections on the CPU against "
                             "stand-ins (their code and fields checked; their figures say nothing of a GPU)")
    options = parser.parse_args(argv)
    if options.fetch_wheels:
        return fetch_wheels(options.fetch_wheels)
    global DRY_RUN
    DRY_RUN = options.dry_run
    if DRY_RUN and not CUDA:
        exec(STAND_INS, {})
    started = time.monotonic()
    from sglang_otel_kernels.record import core

    summary: dict = {"dry_run": DRY_RUN and not CUDA, "torch": torch.__version__, "python": sys.version.split()[0],
                     "device": torch.cuda.get_device_name() if CUDA else "cpu", "core": core.describe(),
                     "sections": {}}
    print(f"== {summary['device']}, torch {summary['torch']}, Python {summary['python']}, core {summary['core']}",
          flush=True)
    directory = tempfile.mkdtemp(prefix="sok-gpu-check-")
    summary["environment"] = environment(directory)
    print(f"== environment: {json.dumps(summary['environment'])}", flush=True)
    for name in options.only or SECTIONS:
        if time.monotonic() - started > options.budget:
            outcome: dict = {"status": "skipped", "reason": f"over the {options.budget:g} s budget"}
        else:
            try:
                outcome = {"status": "ran", **SECTIONS[name](directory)}
            except Skip as skip:
                outcome = {"status": "skipped", "reason": str(skip)}
            except Exception as exc:  # one section failing never stops the others
                outcome = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:500]}
        summary["sections"][name] = outcome
        print(f"== {name}: {json.dumps(outcome, default=repr)[:2000]}", flush=True)
    summary["seconds"] = round(time.monotonic() - started, 1)
    if options.out:
        with open(options.out, "w") as handle:
            json.dump(summary, handle, indent=1, default=repr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
