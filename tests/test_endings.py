"""How a process ended, read from what it left, in real processes: an
exception no code caught (a device error raised at a synchronisation after
the call whose kernel caused it; a thread's), stopped
with SIGTERM (recorded, then SIGTERM does what it did before: the default
ends the process, an application's handler still runs, an ignored one
stays ignored, a forked worker
stopped by its parent leaves the parent's file alone), told to stop (an
engine's shutdown request: stopped, whether it then exits or is killed), a batch that raised
outside every recorded call (a failure: its requests and innermost frames),
and a process that died while a batch ran between kernel calls."""

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from conftest import clean_env

WORKER = r"""
import os, signal, sys, threading, time
mode = sys.argv[1]
if mode == "device error":  # an application's own hook, set before the recorder's: both run
    sys.excepthook = lambda *exc: (print("application hook ran", flush=True), sys.__excepthook__(*exc))
if mode == "handler":
    signal.signal(signal.SIGTERM, lambda *_: (print("application handler ran", flush=True), sys.exit(3)))
if mode == "ignores":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
import torch
import sglang_otel_kernels as sok
from sglang_otel_kernels.capture.requests import forward_batch

@sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
def rmsnorm(x):
    return x * 2

def lookup(table, ids):  # the op a batch fails in, not recorded
    return table[ids]

rmsnorm(torch.ones(2))
if mode == "fork":
    child = os.fork()
    if child == 0:
        time.sleep(30)
        os._exit(0)
    time.sleep(0.5)
    os.kill(child, signal.SIGTERM)
    _, status = os.waitpid(child, 0)
    print("child", os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
    os._exit(0)  # gone without an exit record: dead, and its file must not say "stopped"
if mode == "raises":
    with forward_batch([{"traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"}],
                       name="sglang.forward_batch"):
        rmsnorm(torch.ones(2))
        lookup(torch.ones(4), torch.tensor([7]))
if mode in ("told then exits", "told then killed"):  # an engine's shutdown request, as SGLang's ShutdownReq
    from sglang_otel_kernels.integrations.sglang import _record_stop
    _record_stop("the engine's shutdown request")
    if mode == "told then killed":  # its parent kills it while it stops
        with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("r1",)}):
            rmsnorm(torch.ones(2))
            os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(0)
if mode == "device error":  # as torch.cuda.synchronize() raises a kernel's device-side assert, after its call
    def synchronize():
        raise RuntimeError("CUDA error: device-side assert triggered\nCUDA kernel errors might be asynchronously "
                           "reported at some other API call")
    rmsnorm(torch.ones(3))
    synchronize()
if mode == "thread":
    def work():
        raise ValueError("a worker's bad input")
    worker = threading.Thread(target=work, name="detokenizer")
    worker.start()
    worker.join()
    sys.exit(0)
if mode == "interrupt":
    raise KeyboardInterrupt
if mode == "between":
    with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("r1", "r2")}):
        rmsnorm(torch.ones(2))
        print("ready", flush=True)
        time.sleep(30)
print("ready", flush=True)
time.sleep(30)
"""


def start(tmp_path, mode: str) -> subprocess.Popen:
    env = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                    SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t.sgltrace"))
    return subprocess.Popen([sys.executable, "-c", WORKER, mode], cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def ready(process: subprocess.Popen) -> None:
    line = process.stdout.readline()
    assert line.strip() == "ready", line + process.stderr.read()


def report(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path / "t.sgltrace"), *args],
                          capture_output=True, text=True, timeout=120, env=clean_env())


def test_a_process_stopped_with_sigterm_reads_as_stopped_and_still_ends(tmp_path):
    process = start(tmp_path, "default")
    ready(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == -signal.SIGTERM  # as without the recorder
    text = report(tmp_path)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "stopped (SIGTERM recorded)" in text.stdout and "died" not in text.stdout
    document = json.loads(report(tmp_path, "--json").stdout)
    assert document["files"][0]["state"] == "stopped" and document["files"][0]["fatal_signal"] == "SIGTERM"


def test_an_applications_sigterm_handler_still_runs(tmp_path):
    process = start(tmp_path, "handler")
    ready(process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) == 3
    assert "application handler ran" in process.stdout.read()
    assert json.loads(report(tmp_path, "--json").stdout)["files"][0]["state"] == "ended"


def test_a_process_that_ignores_sigterm_still_ignores_it(tmp_path):
    process = start(tmp_path, "ignores")
    ready(process)
    process.send_signal(signal.SIGTERM)
    time.sleep(1)
    assert process.poll() is None, process.stderr.read()  # nothing stopped it, nothing says it stopped
    process.kill()
    process.wait(timeout=60)
    assert (tmp_path / "t.sgltrace.traceback").read_text() == ""
    assert json.loads(report(tmp_path, "--json").stdout)["files"][0]["state"] == "died"


def test_a_worker_stopped_by_its_parent_leaves_the_parents_file_alone(tmp_path):
    process = start(tmp_path, "fork")
    out, err = process.communicate(timeout=60)
    assert "child 15" in out, out + err  # the worker still ends on SIGTERM
    document = json.loads(report(tmp_path, "--json").stdout)
    assert document["files"][0]["state"] == "died", document["files"]


@pytest.mark.parametrize("mode", ["told then exits", "told then killed"])
def test_a_process_told_to_stop_reads_as_stopped_whether_it_exits_or_is_killed(tmp_path, mode):
    process = start(tmp_path, mode)
    process.communicate(timeout=60)
    assert process.returncode == (0 if mode == "told then exits" else -signal.SIGKILL)
    text = report(tmp_path)
    assert text.returncode == 0, text.stdout + text.stderr
    assert "stopped (told to stop: the engine's shutdown request)" in text.stdout, text.stdout
    assert "died" not in text.stdout and "CRASHED" not in text.stdout, text.stdout
    document = json.loads(report(tmp_path, "--json").stdout)
    [info] = document["files"]
    assert (info["state"], info["stop_reason"]) == ("stopped", "the engine's shutdown request"), info
    assert not document["crashed"] and not document["batches_at_death"]
    assert (info["ending"]["kind"], info["ending"]["pages"]) == ("stopped", False), info["ending"]
    # What `watch` keeps of the file as it follows it reads the same way.
    from sglang_otel_kernels.recover.ranks import state_of
    from sglang_otel_kernels.live.watch import LiveFile

    live = LiveFile(str(tmp_path / "t.sgltrace"))
    try:
        live.poll()
        assert state_of(live.contents(), time.time_ns()) == "stopped"
    finally:
        live.close()


def test_a_batch_that_raised_outside_every_recorded_call_is_a_failure(tmp_path):
    process = start(tmp_path, "raises")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1 and "IndexError" in err
    text = report(tmp_path)
    assert text.returncode == 1, text.stdout + text.stderr
    first = text.stdout.splitlines()[0]
    assert first.startswith("the batch sglang.forward_batch (no request ids) failed in lookup (<string>:"), first
    assert first.endswith("IndexError: index 7 is out of bounds for dimension 0 with size 4"), first
    [batch] = json.loads(report(tmp_path, "--json").stdout)["failed_batches"]
    assert batch["failed_call"] is None and batch["frames"][0]["function"] == "lookup"
    assert batch["exception"]["type"] == "IndexError" and batch["state"] == "error"
    assert json.loads(report(tmp_path, "--json").stdout)["files"][0]["after_failure"]["exception"] == "IndexError"


def test_a_process_killed_between_kernel_calls_names_its_batch(tmp_path):
    process = start(tmp_path, "between")
    ready(process)
    time.sleep(0.3)
    process.kill()
    process.wait(timeout=60)
    text = report(tmp_path)
    assert text.returncode == 1, text.stdout + text.stderr
    assert text.stdout.startswith("the process died while its batch sglang.forward_batch served requests r1, r2"), \
        text.stdout
    document = json.loads(report(tmp_path, "--json").stdout)
    assert document["crashed"] and not document["in_flight"]
    [batch] = document["batches_at_death"]
    assert batch["request_ids"] == ["r1", "r2"] and batch["kernel_in_flight"] is False


@pytest.mark.parametrize("text, signal_name", [("Thread 0x00007f (most recent call first):\n  File ...", "SIGTERM"),
                                               ("Fatal Python error: Segmentation fault\n\nThread 0x7f", "SIGSEGV")])
def test_the_traceback_file_tells_sigterm_from_a_fatal_signal(tmp_path, text, signal_name):
    from sglang_otel_kernels.record.reader import fatal_signal

    path = tmp_path / "t.sgltrace"
    (tmp_path / "t.sgltrace.traceback").write_text(text)
    assert fatal_signal(str(path)) == signal_name
    os.remove(tmp_path / "t.sgltrace.traceback")


def test_a_device_error_raised_after_the_last_call_is_the_processs_failure(tmp_path):
    """At level 1 on an H100, a device-side assert in a decorated call was
    raised by the script's own synchronisation after it: every span ended ok
    and the report said nothing had failed."""
    process = start(tmp_path, "device error")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 1 and "application hook ran" in out and "device-side assert" in err, out + err
    text = report(tmp_path)
    assert text.returncode == 1, text.stdout + text.stderr
    assert text.stdout.splitlines()[0].startswith(
        "MainThread raised RuntimeError: CUDA error: device-side assert triggered and no code caught it, "), text.stdout
    assert "after its last kernel call ended (sglang.custom_op.rmsnorm)" in text.stdout.splitlines()[0]
    assert ", ended 0.0 s after it raised RuntimeError" in text.stdout
    assert "innermost frames: synchronize (<string>:" in text.stdout
    assert "that kernel was launched earlier, most likely by the last calls below" in text.stdout
    [info] = json.loads(report(tmp_path, "--json").stdout)["files"]
    [error] = info["uncaught"]
    assert (error["thread"], error["exception"]["type"], error["device_error"], error["last_call"]) == \
        ("MainThread", "RuntimeError", True, "sglang.custom_op.rmsnorm")
    assert error["exception"]["message"].startswith("CUDA error: device-side assert triggered\nCUDA kernel errors")
    assert [frame["function"] for frame in error["frames"]] == ["synchronize", "<module>"]
    assert 0 <= error["seconds_after_last_call"] < 10
    page = tmp_path / "report.html"
    assert report(tmp_path, "--html", str(page)).returncode == 1
    assert '<p class="verdict failed">FAILED: MainThread raised RuntimeError: CUDA error: device-side assert ' \
        'triggered and no code caught it' in page.read_text()


def test_a_threads_uncaught_exception_is_named_and_an_interrupt_is_not(tmp_path):
    process = start(tmp_path, "thread")
    out, err = process.communicate(timeout=60)
    assert process.returncode == 0 and "a worker's bad input" in err, out + err
    text = report(tmp_path)
    assert text.returncode == 1, text.stdout + text.stderr
    assert "detokenizer raised ValueError: a worker's bad input and no code caught it" in text.stdout
    [error] = json.loads(report(tmp_path, "--json").stdout)["files"][0]["uncaught"]
    assert (error["device_error"], error["frames"][0]["function"]) == (False, "work")
    assert "device error is raised by the next synchronisation" not in text.stdout

    (tmp_path / "t.sgltrace").unlink()
    process = start(tmp_path, "interrupt")
    process.communicate(timeout=60)
    assert process.returncode == -signal.SIGINT  # as Python ends on an uncaught KeyboardInterrupt
    text = report(tmp_path)
    assert text.returncode == 0 and "raised" not in text.stdout, text.stdout
    assert json.loads(report(tmp_path, "--json").stdout)["files"][0]["uncaught"] == []


def test_the_uncaught_exception_is_a_failed_span_a_back_end_receives(tmp_path):
    """The exception no code caught is a span (`sglang.process.exception`),
    so `replay` (and the sidecar, and an application's own exporter) takes
    it to Jaeger with the kernel calls: here over gRPC on loopback."""
    from otlp_receivers import GrpcReceiver

    process = start(tmp_path, "device error")
    process.communicate(timeout=60)
    receiver = GrpcReceiver()
    try:
        replay = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", str(tmp_path / "t.sgltrace"),
                                 "--endpoint", receiver.endpoint], capture_output=True, text=True, timeout=120,
                                env=clean_env())
        assert replay.returncode == 0, replay.stdout + replay.stderr
        spans = receiver.wait_for(lambda got: any(s["name"] == "sglang.process.exception" for s in got), timeout=30)
    finally:
        receiver.stop()
    [span] = [s for s in spans if s["name"] == "sglang.process.exception"]
    assert span["status"] == 2 and span["status_message"].startswith("RuntimeError: CUDA error: device-side assert")
    assert span["events"] == ["exception"] and span["attributes"]["thread.name"] == "MainThread"
    assert [s["name"] for s in spans if s["name"] != "sglang.process.exception"] == ["sglang.custom_op.rmsnorm"] * 2
