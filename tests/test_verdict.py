"""One verdict, read the same way by every reader: the text report's first
line, `report --json`'s `verdict`, the page's banner and the exit status,
in real processes for the endings an operator meets most: killed while
idle (no request to blame), hung alone in a call or frozen (a one-rank
server has no collective to wait in), and back once it resumes; a fatal
signal still read after the files were copied off the node (`cp`, `tar`);
a server restarted over a crashed one's directory (the live one first, the
old crash dated)."""

import html
import json
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tarfile
import time

import pytest

from conftest import clean_env

WORKER = r"""
import os, signal, sys, time
mode = sys.argv[1]
import torch
import sglang_otel_kernels as sok
from sglang_otel_kernels.capture.requests import forward_batch

@sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")
def rmsnorm(x):
    return x * 2

@sok.debug_kernel_api(op_name="sglang.custom_op.slow")
def slow(x):
    print("ready", flush=True)
    time.sleep(60)
    return x

@sok.debug_kernel_api(op_name="sglang.custom_op.fatal")
def fatal(x):
    os.abort()  # SIGABRT, as a device-side assert takes a server down

with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("done-ok-1",)}):
    rmsnorm(torch.ones(2))
if mode == "hangs":
    with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("c-long",)}):
        slow(torch.ones(2))
if mode == "between":  # a batch between its kernel calls (on the CPU most of a decode step is the engine's Python)
    with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("c-between",)}):
        rmsnorm(torch.ones(2))
        print("ready", flush=True)
        time.sleep(60)
if mode == "aborts":
    with forward_batch([], name="sglang.forward_batch", attributes={"sglang.batch.request_ids": ("bad-1",)}):
        fatal(torch.ones(2))
print("ready", flush=True)
time.sleep(60)  # idle: its batch served, nothing running
"""


def start(folder, mode: str, **env: str) -> subprocess.Popen:
    environment = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                            SGLANG_KERNEL_API_TRACEFILE=str(folder / "trace_%i.sgltrace"), **env)
    process = subprocess.Popen([sys.executable, "-c", WORKER, mode], cwd=folder, env=environment,
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    if mode != "aborts":
        line = process.stdout.readline()
        assert line.strip() == "ready", line + process.stderr.read()
    return process


def stop(process: subprocess.Popen) -> None:
    process.kill()
    process.wait(timeout=60)


def _timeless(text: str) -> str:
    return re.sub(r"\d+(\.\d+)? s\b|\d\d:\d\d:\d\d\.\d+", "T", text)


def verdict_of(path, *args: str, page=None) -> tuple[int, str, dict]:
    """(exit status, headline, the JSON's verdict) of `report`, after
    checking that the text, the JSON, the page and the exit status say the
    same."""
    run = lambda *more: subprocess.run(  # noqa: E731
        [sys.executable, "-m", "sglang_otel_kernels", "report", str(path), *args, *more],
        capture_output=True, text=True, timeout=120, env=clean_env())
    text, document = run(), run("--json")
    verdict = json.loads(document.stdout)["verdict"]
    first = text.stdout.splitlines()[0]
    assert _timeless(first) == _timeless(verdict["headline"]), (first, verdict)  # a live process's times run on
    assert text.returncode == document.returncode == verdict["exit_status"], (text.returncode, verdict)
    if page is not None:
        drawn = run("--html", str(page))
        assert drawn.returncode == verdict["exit_status"]
        banner = page.read_text().split('<p class="verdict ', 1)[1].split("</p>", 1)[0]
        assert _timeless(html.escape(verdict["headline"], quote=False)) in _timeless(banner), banner
    return text.returncode, first, verdict


def test_a_process_killed_while_idle_names_no_request(tmp_path):
    """The OOM killer takes a server seconds after its last request
    returned: a death, of no request (the batch had ended)."""
    process = start(tmp_path, "idle")
    stop(process)
    status, first, verdict = verdict_of(tmp_path, page=tmp_path / "report.html")
    assert status == 1 and verdict["kind"] == "died", first
    assert first.startswith("the process died with no kernel call or batch running at "), first
    assert "no fatal signal recorded: killed from outside" in first and "done-ok-1" not in first, first
    assert "DIED: the process died" in (tmp_path / "report.html").read_text()


def test_a_rank_killed_while_idle_names_no_request(tmp_path):
    process = start(tmp_path, "idle", RANK="0", WORLD_SIZE="1")
    stop(process)
    status, first, verdict = verdict_of(tmp_path)
    assert status == 1 and verdict["kind"] == "died", first
    assert first.startswith("rank 0 died at ") and "with no kernel call or batch running" in first, first
    assert "done-ok-1" not in first, first


@pytest.mark.parametrize("ranked", [False, True])
def test_a_call_past_the_threshold_is_a_hang_on_one_process(tmp_path, ranked):
    process = start(tmp_path, "hangs", **({"RANK": "0", "WORLD_SIZE": "1"} if ranked else {}))
    try:
        time.sleep(1.5)
        status, first, verdict = verdict_of(tmp_path, "--hang-seconds", "1", page=tmp_path / "report.html")
        assert status == 1 and verdict["kind"] == "hung", first
        assert "sglang.custom_op.slow" in first, first
        if ranked:
            assert first.startswith("rank 0 is stuck in sglang.custom_op.slow (running ") and \
                "past the 1 s that makes a hang" in first and "served request c-long" in first, first
        assert "HUNG: " in (tmp_path / "report.html").read_text()
        # Under the threshold it is no hang yet; a rank in a call for a twentieth of it is slow, never "no suspect".
        status, first, verdict = verdict_of(tmp_path, "--hang-seconds", "20")
        assert status == 0 and "no suspect" not in first, first
        if ranked:
            assert verdict["kind"] == "waiting" and first.startswith("rank 0 has been in sglang.custom_op.slow for "), first
    finally:
        stop(process)


def test_a_frozen_rank_is_a_hang_and_reads_healthy_again_once_it_resumes(tmp_path):
    process = start(tmp_path, "idle", RANK="0", WORLD_SIZE="1")
    try:
        os.kill(process.pid, signal.SIGSTOP)
        time.sleep(7)  # past the 5 s that make a heartbeat stale
        status, first, verdict = verdict_of(tmp_path, "--hang-seconds", "5")
        assert status == 1 and verdict["kind"] == "hung", first
        assert first.startswith("rank 0 is frozen: its heartbeat stopped at "), first
        os.kill(process.pid, signal.SIGCONT)
        deadline = time.monotonic() + 30
        while True:  # its heartbeat, once a second, comes back
            status, first, verdict = verdict_of(tmp_path, "--hang-seconds", "5")
            if status == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert status == 0 and verdict["kind"] == "clean" and "frozen" not in first, first
    finally:
        os.kill(process.pid, signal.SIGCONT)
        stop(process)


def test_a_fatal_signal_survives_the_files_being_copied_off_the_node(tmp_path):
    """`cp` without -p, `kubectl cp` and `scp` give the copies the time of
    the copy, a tar whole seconds: the traceback is tied to its trace file
    by the thread it names, not by when it was written."""
    node = tmp_path / "node"
    node.mkdir()
    process = start(node, "aborts")
    assert process.wait(timeout=120) == -signal.SIGABRT, process.stderr.read()
    status, first, _ = verdict_of(node)
    assert status == 1 and "(SIGABRT recorded)" in first, first
    time.sleep(2.5)  # past the two heartbeats within which a traceback's time is believed
    copied = tmp_path / "copied"
    copied.mkdir()
    for path in node.iterdir():
        shutil.copyfile(path, copied / path.name)  # the contents alone, as cp without -p
    with tarfile.open(tmp_path / "files.tar", "w", format=tarfile.USTAR_FORMAT) as archive:  # whole seconds
        archive.add(node, arcname="untarred")
    with tarfile.open(tmp_path / "files.tar") as archive:
        archive.extractall(tmp_path, **({"filter": "data"} if hasattr(tarfile, "data_filter") else {}))
    for folder in (copied, tmp_path / "untarred"):
        (trace,) = folder.glob("*.sgltrace")
        os.utime(str(trace) + ".traceback", (time.time() + 3600, time.time() + 3600))  # copied an hour later
        status, first, verdict = verdict_of(folder)
        assert status == 1 and verdict["kind"] == "crashed", first
        assert first.startswith("the process died in sglang.custom_op.fatal (SIGABRT recorded) at "), first
        assert "served request bad-1" in first, first


def test_a_server_restarted_over_a_crashed_ones_directory_leads_with_the_live_one(tmp_path):
    crashed = start(tmp_path, "aborts")
    assert crashed.wait(timeout=120) == -signal.SIGABRT
    live = start(tmp_path, "idle")
    try:
        status, first, verdict = verdict_of(tmp_path)
        assert status == 1 and verdict["kind"] == "crashed", first
        assert first.startswith(f"pid {live.pid} is running; another process, gone since 20"), first
        assert ": the process died in sglang.custom_op.fatal (SIGABRT recorded)" in first, first
    finally:
        stop(live)


def _line(process: subprocess.Popen, deadline: float) -> str:
    ready, _, _ = select.select([process.stdout], [], [], max(deadline - time.monotonic(), 0))
    assert ready, "no line in time"
    return process.stdout.readline()


@pytest.mark.parametrize("mode, says", [
    ("idle", "with no kernel call or batch running"),
    ("between", "while its batch sglang.forward_batch served request c-between (running")])
def test_watch_announces_every_death_between_kernel_calls_included(tmp_path, mode, says):
    """On the real server `watch` announced a SIGKILL between kernel calls
    in 1 of 3 runs: it kept no batch in flight, and a rank dead with nothing
    in flight was no suspect."""
    watcher = subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels", "watch", str(tmp_path), "--interval",
                                "0.5"], env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    process = None
    try:
        deadline = time.monotonic() + 120
        assert _line(watcher, deadline).startswith(f"watching {tmp_path}: ")
        process = start(tmp_path, mode, RANK="0", WORLD_SIZE="1")
        while "no suspect" not in (line := _line(watcher, deadline)):  # followed: its first verdict
            pass
        stop(process)
        line = _line(watcher, deadline)
        assert re.match(r"\d\d:\d\d:\d\d\.\d{6} job world size 1: rank 0 died", line) and says in line, line
    finally:
        watcher.kill()
        watcher.wait(timeout=30)
        if process is not None:
            stop(process)
