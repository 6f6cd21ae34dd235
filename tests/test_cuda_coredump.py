"""CUDA core dumps: turned on before CUDA starts without overriding the
user's CUDA_* variables, read (or refused) exactly to NVIDIA's published
layout, and joined by `report` to the call or graph replay a killed process
was running. The dumps are synthetic (tests/cuda_dumps.py): no GPU here."""

import json
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest

import cuda_dumps
from conftest import clean_env
from otlp_receivers import GrpcReceiver
from sglang_otel_kernels.recover.cuda_coredump import CoreDumpError, read_cuda_coredump
from sglang_otel_kernels.recover.device_faults import matches
from sglang_otel_kernels.record.coredumps import LIGHTWEIGHT_FLAGS

TESTS = Path(__file__).resolve().parent
DEMANGLED = "void flashinfer::norm::RMSNormKernel<float>(float*, float*, float*, unsigned int, float)"
SHOW_ENV = "import json, os; print(json.dumps({k: v for k, v in os.environ.items() if k.startswith('CUDA_')}))"


def _run_env(tmp_path, *, extra=None, flag=True) -> dict:
    """The CUDA_* variables a command started by `run` sees."""
    env = clean_env(SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "traces" / "trace_%i.sgltrace"), **(extra or {}))
    for key in [key for key in env if key.startswith(("CUDA_", "SGLANG_CUDA_"))]:
        if key not in (extra or {}):
            del env[key]
    command = [sys.executable, "-m", "sglang_otel_kernels", "run", *(["--cuda-coredump"] if flag else []), "--",
               sys.executable, "-c", SHOW_ENV]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)


def test_run_cuda_coredump_sets_exactly_the_variables_beside_the_trace_files(tmp_path):
    seen = _run_env(tmp_path)
    assert seen == {"CUDA_ENABLE_COREDUMP_ON_EXCEPTION": "1", "CUDA_COREDUMP_GENERATION_FLAGS": LIGHTWEIGHT_FLAGS,
                    "CUDA_COREDUMP_SHOW_PROGRESS": "1",
                    "CUDA_COREDUMP_FILE": str(tmp_path / "traces" / "cuda_coredump_%h.%p.%t")}
    assert (tmp_path / "traces").is_dir()  # the driver does not make it
    assert _run_env(tmp_path, flag=False) == {}


def test_the_users_cuda_variables_and_sglangs_switch_are_kept(tmp_path):
    mine = {"CUDA_COREDUMP_FILE": "/var/dumps/core.%p", "CUDA_COREDUMP_SHOW_PROGRESS": "0"}
    seen = _run_env(tmp_path, extra=mine)
    assert seen["CUDA_COREDUMP_FILE"] == "/var/dumps/core.%p" and seen["CUDA_COREDUMP_SHOW_PROGRESS"] == "0"
    assert seen["CUDA_ENABLE_COREDUMP_ON_EXCEPTION"] == "1" and len(seen) == 4
    # SGLang's directory is where the dumps go; with its own switch on, SGLang sets them and this sets none.
    seen = _run_env(tmp_path, extra={"SGLANG_CUDA_COREDUMP_DIR": str(tmp_path / "sglang")})
    assert seen["CUDA_COREDUMP_FILE"] == str(tmp_path / "sglang" / "cuda_coredump_%h.%p.%t")
    assert _run_env(tmp_path, extra={"SGLANG_CUDA_COREDUMP": "1"}) == {}


@pytest.mark.parametrize("how", ["environment", "configure"])
def test_the_package_sets_them_in_its_own_process_before_cuda_starts(tmp_path, how):
    env = clean_env(SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"))
    env = {key: value for key, value in env.items() if not key.startswith("CUDA_")}
    if how == "environment":
        env["SGLANG_KERNEL_API_CUDA_COREDUMP"] = "1"
        script = "import sglang_otel_kernels\n" + SHOW_ENV
    else:
        script = "import sglang_otel_kernels as sok; sok.configure(cuda_coredump=True)\n" + SHOW_ENV
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["CUDA_COREDUMP_FILE"] == str(tmp_path / "cuda_coredump_%h.%p.%t")
    assert "already initialised" not in done.stderr


@pytest.mark.parametrize("generation", ["r346", "r575"])
def test_a_dump_names_the_faulting_kernel_lane_and_launch_whatever_its_entry_sizes(tmp_path, generation):
    """The baseline rows and the newest drivers' longer ones (whose added
    bytes the reader must skip) read the same."""
    path = tmp_path / "cuda_coredump_gpu-7.example.com.4242.1764680000"
    path.write_bytes(cuda_dumps.fault_dump(generation))
    dump = read_cuda_coredump(str(path))
    assert (dump.host, dump.pid, dump.time) == ("gpu-7.example.com", 4242, 1764680000)
    assert dump.driver == (None if generation == "r346" else "580.65 (CUDA 12.9)")
    assert dump.notes == []
    (fault,) = dump.faults
    assert (fault.exception, fault.code, fault.mangled) == ("WARP_ILLEGAL_ADDRESS", 14, cuda_dumps.KERNEL)
    assert fault.kernel == (DEMANGLED if shutil.which("c++filt") else cuda_dumps.KERNEL)
    assert (fault.device, fault.device_name, fault.sm, fault.warp, fault.lane) == (0, "NVIDIA H200", 3, 12, 5)
    assert (fault.grid, fault.block, fault.block_index, fault.thread_index) == ((6, 8, 1), (128, 1, 1), (2, 0, 0),
                                                                               (37, 0, 0))
    assert fault.error_pc == fault.pc == cuda_dumps.KERNEL_ENTRY + 0x230 and fault.grid_id == 7


def test_a_dump_alone_is_reported_unplaced(tmp_path):
    path = tmp_path / "cuda_coredump_host.1.2"
    path.write_bytes(cuda_dumps.fault_dump())
    done = _report(path, json_out=False)
    assert done.returncode == 1, done.stderr  # a device fault
    # The verdict first, as every report opens, then the fault itself.
    assert done.stdout.startswith("a device fault: WARP_ILLEGAL_ADDRESS in kernel void flashinfer::norm::RMSNormKernel")
    assert "\nDevice fault (CUDA core dump cuda_coredump_host.1.2): WARP_ILLEGAL_ADDRESS" in done.stdout
    assert "not placed: no trace file of its process was given" in done.stdout
    assert "No kernel call was running" not in done.stdout


def test_a_device_side_assert_and_a_dump_named_otherwise(tmp_path):
    path = tmp_path / "core.nvcudmp"
    path.write_bytes(cuda_dumps.fault_dump(exception=cuda_dumps.WARP_ASSERT, lane=0, timestamp=1764681234))
    dump = read_cuda_coredump(str(path))
    assert (dump.host, dump.pid, dump.time) == (None, None, 1764681234)  # the metadata's time
    assert [(f.exception, f.lane, f.thread_index) for f in dump.faults] == [("WARP_ASSERT", 0, (32, 0, 0))]


def _report(*paths, json_out=True) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *map(str, paths),
                           *(["--json"] if json_out else [])], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("damage", ["truncated", "random", "other ELF", "empty", "section table"])
def test_what_is_not_a_readable_dump_is_refused_with_one_line(tmp_path, damage):
    good = cuda_dumps.fault_dump()
    data = {"truncated": good[: len(good) // 2],
            "random": bytes(random.Random(5).getrandbits(8) for _ in range(4096)),
            "other ELF": good[:18] + b"\x3e\x00" + good[20:],  # machine x86-64
            "empty": b"",
            "section table": good[:60] + b"\xff\xff" + good[62:]}[damage]  # 65535 sections
    path = tmp_path / "cuda_coredump_host.1.2"
    path.write_bytes(data)
    with pytest.raises(CoreDumpError):
        read_cuda_coredump(str(path))
    done = _report(path)
    assert done.returncode == 2 and done.stdout == ""
    assert len(done.stderr.strip().splitlines()) == 1 and str(path) in done.stderr, done.stderr


def test_a_fifo_named_as_a_dump_is_refused_without_being_opened_for_reading(tmp_path):
    path = tmp_path / "cuda_coredump_host.1.2"
    os.mkfifo(path)
    done = _report(path)  # a reader opening it would wait for a writer: the timeout would fail this
    assert done.returncode == 2 and "FIFO" in done.stderr and len(done.stderr.strip().splitlines()) == 1


def test_a_table_past_the_end_of_the_file_is_skipped_and_said(tmp_path):
    """A dump cut inside a lane table whose section headers survive: what can
    be read is, and the note says what could not."""
    builder = cuda_dumps.DumpBuilder()
    devices = builder.add(".cudbg.devtbl", cuda_dumps.DEV_TABLE, bytes(72), entsize=72)
    data = bytearray(builder.build())
    # The device table's header (section 1) claims more rows than the file holds.
    header_at = int.from_bytes(data[40:48], "little") + 64 * devices
    data[header_at + 32: header_at + 40] = (72 * 20000).to_bytes(8, "little")
    path = tmp_path / "cuda_coredump_host.1.2"
    path.write_bytes(bytes(data))
    dump = read_cuda_coredump(str(path))
    assert dump.faults == [] and any("past the end of the file" in note for note in dump.notes)


CRASH = r"""
import os, signal, sys, torch
sys.path.insert(0, sys.argv[3])
import sglang_otel_kernels as sok
from stand_in_graph import StandInGraph, capturing
from sglang_otel_kernels.capture.graphs import record_graph_class
sok.configure(level=1, log_dest="off", trace_file=os.path.join(sys.argv[1], "trace_%i.sgltrace"), export_sidecar=False)
rmsnorm = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x: x)
silu = sok.debug_kernel_api(op_name="sglang.custom_op.silu_and_mul")(lambda x: x)
x = torch.ones(4, 8)
die = lambda *args: os.kill(os.getpid(), signal.SIGKILL)
if sys.argv[2] == "replay":
    record_graph_class(StandInGraph)
    graph = StandInGraph()
    with capturing():
        graph.capture_begin(); silu(x); rmsnorm(x); silu(x); graph.capture_end()
    graph.replay()
    StandInGraph.at, StandInGraph.then = 2, staticmethod(die)
    graph.replay()
elif sys.argv[2] == "after":  # eagerly: the faulting kernel ran on after its call returned
    rmsnorm(x); silu(x); die()
else:
    silu(x)
    sok.debug_kernel_api(op_name="sglang.custom_op.fused_add_rmsnorm")(die)(x)
"""


@pytest.mark.parametrize("where", ["call", "replay", "after"])
def test_report_joins_a_dump_to_the_call_or_replay_the_killed_process_was_running(tmp_path, where):
    run = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), where, str(TESTS)], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    (trace,) = tmp_path.glob("trace_*.sgltrace")
    pid = int(trace.stem.split("_")[1])
    dump = tmp_path / f"cuda_coredump_{socket.gethostname()}.{pid}.1764680000"
    dump.write_bytes(cuda_dumps.fault_dump())
    (tmp_path / "cuda_coredump_otherhost.1.2").write_bytes(b"not a dump")  # of a directory: skipped, said

    done = _report(tmp_path)
    assert done.returncode == 1, done.stderr
    assert "skipped" in done.stderr and "cuda_coredump_otherhost.1.2" in done.stderr
    (fault,) = json.loads(done.stdout)["device_faults"]
    assert (fault["exception"], fault["lane"], fault["joined_by"]) == ("WARP_ILLEGAL_ADDRESS", 5, "pid")
    call = fault["call"]
    if where == "call":
        assert fault["placed"] == "the call in flight"
        assert call["name"] == "sglang.custom_op.fused_add_rmsnorm" and call["in_flight_in_dead_process"]
    elif where == "after":
        assert fault["placed"] == "the newest call whose name matches the kernel (a kernel runs on after its call " \
                                  "returns)"
        assert call["name"] == "sglang.custom_op.rmsnorm" and not call["in_flight_in_dead_process"]
    else:
        assert fault["placed"] == "the CUDA graph replay in flight"
        assert call["graph"]["replay"] == 2
        assert [(k["name"], k["matches_kernel"]) for k in call["graph"]["calls"]] == [
            ("sglang.custom_op.silu_and_mul", False), ("sglang.custom_op.rmsnorm", True),
            ("sglang.custom_op.silu_and_mul", False)]
    text = _report(trace, dump, json_out=False).stdout
    assert "Device fault (CUDA core dump" in text and "WARP_ILLEGAL_ADDRESS" in text and "lane 5" in text
    if where == "replay":
        assert "captured calls whose name matches the kernel: 2. sglang.custom_op.rmsnorm" in text
    page = tmp_path / "report.html"
    assert _report(trace, dump, "--html", page, json_out=False).returncode == 1
    block = page.read_text().split('class="in-flight-call device-fault">')[1].split("</div>")[0]
    assert "WARP_ILLEGAL_ADDRESS" in block and "RMSNormKernel" in block


def test_kernel_names_match_the_calls_that_launch_them():
    assert matches("sglang.custom_op.rmsnorm", DEMANGLED)
    assert matches("flashinfer.norm.RMSNorm", "flashinfer::norm::RMSNormKernel<float>")
    assert not matches("sglang.custom_op.silu_and_mul", DEMANGLED)
    assert not matches("a.mm", "void gemm_kernel()")  # too short a name to tell
    assert not matches("sglang.custom_op.rmsnorm", None)
    assert not matches("sglang.custom_op.float", DEMANGLED)  # the arguments are not the kernel's name


@pytest.mark.parametrize("command", ["follow", "replay"])
def test_the_sidecar_and_replay_put_the_fault_on_the_call_in_flight(tmp_path, command):
    run = subprocess.run([sys.executable, "-c", CRASH, str(tmp_path), "replay", str(TESTS)], env=clean_env(),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    (trace,) = tmp_path.glob("trace_*.sgltrace")
    pid = int(trace.stem.split("_")[1])
    (tmp_path / f"cuda_coredump_{socket.gethostname()}.{pid}.1764680000").write_bytes(cuda_dumps.fault_dump())
    receiver = GrpcReceiver()
    try:
        done = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", command, str(trace), "--endpoint",
                               receiver.endpoint], env=clean_env(), capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        spans = receiver.wait_for(lambda got: any(s["name"] == "cuda_graph.replay" for s in got))
    finally:
        receiver.stop()
    running = [s for s in spans if s["attributes"].get("sglang.kernel.in_flight")]
    assert [s["name"] for s in running] == ["cuda_graph.replay"]
    assert running[0]["attributes"]["sglang.cuda.exception"] == "WARP_ILLEGAL_ADDRESS"
    assert running[0]["attributes"]["sglang.cuda.kernel"].startswith(
        "void flashinfer::norm::RMSNormKernel" if shutil.which("c++filt") else cuda_dumps.KERNEL)
    ended = [s for s in spans if not s["attributes"].get("sglang.kernel.in_flight")]
    assert ended and not any("sglang.cuda.exception" in s["attributes"] for s in ended)
