"""Crashes and hangs across ranks, with real processes: four ranks of a job on
the gloo backend on the CPU (tests/rank_worker.py: each step two kernels and
an all-reduce, or a pipeline of sends and receives), no mock of
torch.distributed. The collectives are recorded in each rank's trace file;
`report` over the files (live, then after a watchdog's SIGKILL) lines the
ranks up and names the rank and the kernel at fault; the sidecar exports a
hung call to a real Jaeger while the ranks still run."""

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time

import pytest

import sglang_otel_kernels as sok
from backends import Jaeger, clean_env, ensure_built, port, wait
from test_html_report import _chromium
from test_report_schema import check

TESTS = os.path.dirname(os.path.abspath(__file__))
WORKER = os.path.join(TESTS, "rank_worker.py")


class Job:
    """The ranks of one job, each a process writing trace_<pid>.sgltrace in `directory`."""

    def __init__(self, directory, scenario: str, steps: int = 0, world: int = 4, **settings) -> None:
        self.directory = directory
        rendezvous = port()
        env = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                        SGLANG_KERNEL_API_TRACEFILE=str(directory / "trace_%i.sgltrace"), **settings)
        env.pop("RANK", None)  # as SGLang's schedulers: the rank is an argument
        self.processes = [
            subprocess.Popen([sys.executable, WORKER, str(rank), str(world), str(rendezvous), scenario, str(steps)],
                             cwd=directory, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for rank in range(world)]

    def path(self, rank: int) -> str:
        return str(self.directory / f"trace_{self.processes[rank].pid}.sgltrace")

    def spans(self, rank: int) -> list:
        try:
            return sok.read_trace(self.path(rank))
        except sok.TraceFileError:
            return []  # not created yet

    def in_flight(self, rank: int) -> list:
        """The kernel calls rank `rank` is in now (names and collective numbers)."""
        return [(s.name, s.attributes.get("sglang.collective.seq")) for s in self.spans(rank)
                if s.in_flight and "sglang.kernel.name" in s.attributes]

    def wait_until(self, what: str, probe, timeout: float = 90.0) -> None:
        def check():
            for process in self.processes:
                if process.poll() is not None and process.returncode not in (0, None):
                    raise AssertionError(f"a rank exited {process.returncode}: {process.stderr.read()[-3000:]}")
            return probe()

        wait(what, check, timeout)

    def alive(self) -> bool:
        return all(process.poll() is None for process in self.processes)

    def kill(self) -> None:
        """SIGKILL every rank, as a watchdog does."""
        for process in self.processes:
            if process.poll() is None:
                process.kill()
        for process in self.processes:
            process.communicate(timeout=60)

    def finish(self, timeout: float = 120) -> list[int]:
        for process in self.processes:
            process.communicate(timeout=timeout)
        return [process.returncode for process in self.processes]


@pytest.fixture
def jobs():
    started: list[Job] = []
    yield lambda *args, **kwargs: started.append(Job(*args, **kwargs)) or started[-1]
    for job in started:
        job.kill()


def report(*paths, hang_seconds: float | None = None) -> tuple[int, str, dict]:
    """`report` as text and as JSON: (exit status, text, JSON document)."""
    options = ["--hang-seconds", str(hang_seconds)] if hang_seconds is not None else []
    results = [subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *map(str, paths), *options,
                               *extra], capture_output=True, text=True, timeout=120) for extra in ([], ["--json"])]
    text, document = results
    assert text.returncode == document.returncode, (text.stderr, document.stderr)
    parsed = json.loads(document.stdout)
    check(parsed)  # what docs/report.schema.json documents
    return text.returncode, text.stdout, parsed


def _entry(verdict: dict, op: str, seq: int) -> dict:
    [entry] = [e for e in verdict["collectives"] if e["op"] == op and e["seq"] == seq]
    return entry


def test_a_stuck_rank_is_named_while_the_job_hangs_and_after_a_watchdog_kills_it(jobs, tmp_path):
    ensure_built()
    jaeger = Jaeger(tmp_path)
    try:
        job = jobs(tmp_path, "stuck", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{jaeger.otlp}",
                   OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_SERVICE_NAME="ranks-stuck",
                   SGLANG_KERNEL_API_HANG_SECONDS="2")
        job.wait_until("rank 2 stuck, the others in all_reduce #5", lambda: job.in_flight(2) == [("layer.stuck", None)]
                       and all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3)))

        # Jaeger shows the hang while the ranks still run: each hung call exported early, marked.
        def hung_in_jaeger():
            found = [span for trace_id in jaeger.search("ranks-stuck", {"sglang.kernel.hung": "true"})
                     for span in jaeger.trace(trace_id)["spans"]]
            hung = [span for span in found if _tags(span).get("sglang.kernel.hung")]
            names = sorted(span["operationName"] for span in hung if "sglang.kernel.copy_of" not in _tags(span))
            # And a copy of each in the traces of the batch's two requests.
            copies = sorted(span["operationName"] for span in hung if "sglang.kernel.copy_of" in _tags(span))
            return found if names == ["layer.stuck"] + ["torch.distributed.all_reduce"] * 3 and \
                copies == sorted(names * 2) else None

        early = wait("the hung calls in Jaeger", hung_in_jaeger, timeout=60)
        assert job.alive()
        [snapshot] = [s for s in early if s["operationName"] == "layer.stuck" and _tags(s).get("sglang.kernel.hung")
                      and "sglang.kernel.copy_of" not in _tags(s)]
        assert _tags(snapshot)["sglang.kernel.in_flight"] is True and _tags(snapshot)["sglang.kernel.in_flight_seconds"] >= 2
        request_traces = {int(carrier.split("-")[1], 16) for carrier in ("00-" + "a1" * 16, "00-" + "a2" * 16)}
        assert {int(s["traceID"], 16) for s in early if "sglang.kernel.copy_of" in _tags(s)} == request_traces

        status, text, document = report(tmp_path, hang_seconds=2)
        verdict = document["cross_rank"]
        assert status == 1
        first = text.splitlines()[0]
        assert first.startswith("rank 2 is stuck in layer.stuck (running ") and first.endswith(
            ") and never entered all_reduce #5 of group default_pg, which ranks 0, 1, 3 wait in"), first
        suspect = verdict["suspects"][0]
        assert (suspect["rank"], suspect["reason"], suspect["call"]) == (2, "missing", "layer.stuck")
        assert suspect["seconds"] >= 2 and len(verdict["suspects"]) == 1
        stuck_for = suspect["seconds"]
        entry = _entry(verdict, "all_reduce", 5)
        assert (entry["group"], entry["waiting"], entry["missing"], entry["hang"]) == ("default_pg", [0, 1, 3], [2], True)
        assert {r["rank"]: r["state"] for r in verdict["ranks"]} == {0: "running", 1: "running", 2: "running",
                                                                     3: "running"}
        # Every call in flight names its rank, process and file, and how long it has run.
        [stuck_line] = [line for line in text.splitlines() if line.startswith("  layer.stuck  (")]
        assert stuck_line.startswith(f"  layer.stuck  (rank 2, pid {job.processes[2].pid}, "
                                     f"trace_{job.processes[2].pid}.sgltrace; thread MainThread")
        assert "    running for " in text
        [in_flight] = [call for call in document["in_flight"] if call["name"] == "layer.stuck"]
        assert in_flight["rank"] == 2 and in_flight["seconds"] >= 2

        job.kill()
        # A hang the watchdog killed is no crash: no fatal signal recorded, the call stuck past the threshold.
        # (Its last sign of life, the heartbeat once a second, may be up to a second before the kill.)
        status, text, document = report(tmp_path, hang_seconds=1)
        verdict = document["cross_rank"]
        assert status == 1
        assert re.fullmatch(r"rank 2 was stuck in layer\.stuck for [1-9][\d.]* s when it was killed from outside \(no "
                            r"fatal signal recorded\), while its batch decode_batch served requests req-1, req-2; it "
                            r"never entered all_reduce #5 of group default_pg, which ranks 0, 1, 3 waited in",
                            text.splitlines()[0]), text
        assert (verdict["suspects"][0]["rank"], verdict["suspects"][0]["call"]) == (2, "layer.stuck")
        assert verdict["suspects"][0]["reason"] == "killed_while_stuck"
        assert _entry(verdict, "all_reduce", 5)["missing"] == [2]
        assert {r["state"] for r in verdict["ranks"]} == {"died"}
        assert {r["fatal_signal"] for r in verdict["ranks"]} == {""}
        assert f"  rank 2: died (no fatal signal recorded), pid {job.processes[2].pid}" in text
        # Killed after seconds stuck: its heartbeat (once a second) says how long it was.
        assert verdict["suspects"][0]["seconds"] >= stuck_for - 1.0
        # Under the threshold it is not called stuck; still no crash.
        status, text, document = report(tmp_path, hang_seconds=600)
        assert document["cross_rank"]["suspects"][0]["reason"] == "died"
        assert re.match(r"rank 2 died in layer\.stuck \(running [\d.]+ s when it was last alive; no fatal signal "
                        r"recorded\)", text), text
        subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path), "--hang-seconds", "1",
                        "--html", str(tmp_path / "page.html")], capture_output=True, timeout=120)
        page = (tmp_path / "page.html").read_text()
        assert "rank 2: died (no fatal signal recorded), pid" in page and "(suspect 1: killed_while_stuck)" in page

        # In Jaeger the sidecar's final span of the call (in flight at the kill) holds the early one.
        def final_in_jaeger():
            spans = jaeger.trace(int(snapshot["traceID"], 16))["spans"]
            finals = [s for s in spans if s["operationName"] == "layer.stuck" and not _tags(s).get("sglang.kernel.hung")]
            return finals or None

        [final] = wait("the final span of the stuck call", final_in_jaeger, timeout=60)
        assert _tags(final)["sglang.kernel.in_flight"] is True and _tags(final)["otel.status_code"] == "ERROR"
        assert {"refType": "CHILD_OF", "traceID": final["traceID"], "spanID": final["spanID"]} in snapshot["references"]
        # Up to the rank's last sign of life, at least as long as the early export said (microseconds).
        assert final["duration"] >= snapshot["duration"] >= 2_000_000
    finally:
        jaeger.close()


def _tags(span: dict) -> dict:
    return {tag["key"]: tag["value"] for tag in span["tags"]}


def test_a_rank_that_aborts_in_a_kernel_is_the_first_suspect_and_explains_the_others(jobs, tmp_path):
    job = jobs(tmp_path, "abort", steps=8)
    codes = job.finish()
    assert codes[2] == -signal.SIGABRT and all(code != 0 for code in codes), codes
    status, text, document = report(tmp_path)
    verdict = document["cross_rank"]
    assert status == 1
    assert [(s["rank"], s["reason"], s["call"]) for s in verdict["suspects"]] == [(2, "crashed", "layer.boom")]
    assert text.splitlines()[0].startswith("rank 2 crashed in layer.boom (SIGABRT, running ")
    assert [r["fatal_signal"] for r in verdict["ranks"]] == [None, None, "SIGABRT", None]
    assert f"  rank 2: died (SIGABRT recorded), pid {job.processes[2].pid}" in text
    assert text.splitlines()[0].endswith("never entered all_reduce #5 of group default_pg, which ranks 0, 1, 3 "
                                         "entered and failed in"), text
    entry = _entry(verdict, "all_reduce", 5)
    assert (entry["failed"], entry["missing"]) == ([0, 1, 3], [2])
    assert {r["rank"]: r["state"] for r in verdict["ranks"]} == {0: "ended", 1: "ended", 2: "died", 3: "ended"}

    # The page: one lane per rank on one time axis, the suspect's marked, its call in flight drawn.
    page = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 1, made.stderr
    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    lanes = re.findall(r'<div class="lane( suspect)?" data-rank="(\d+)">(.*?)</svg>', dom.stdout, re.S)
    assert [(marked, rank) for marked, rank, _ in lanes] == [("", "0"), ("", "1"), (" suspect", "2"), ("", "3")]
    suspect = lanes[2][2]
    assert "rank 2: died (SIGABRT recorded), pid" in suspect and "(suspect 1: crashed)" in suspect
    assert 'class="call in-flight" data-call' in suspect and 'data-name="layer.boom"' in suspect
    assert all('class="call failed collective"' in lane for _, rank, lane in lanes if rank != "2")


def test_a_collective_of_another_shape_is_a_mismatch_naming_both_shapes(jobs, tmp_path):
    job = jobs(tmp_path, "mismatch", steps=8)
    job.wait_until("rank 3 left behind in all_reduce #5", lambda: job.in_flight(3) == [("torch.distributed.all_reduce", 5)]
                   and all(job.in_flight(r) == [("torch.distributed.all_reduce", 6)] for r in (0, 1, 2)))
    status, text, document = report(tmp_path, hang_seconds=1)
    verdict = document["cross_rank"]
    assert status == 1
    [mismatch] = verdict["mismatches"]
    assert (mismatch["op"], mismatch["seq"], mismatch["field"], mismatch["odd"]) == ("all_reduce", 5, "input shapes", [3])
    assert mismatch["values"] == {"0": "(4,)", "1": "(4,)", "2": "(4,)", "3": "(8,)"}
    assert (verdict["suspects"][0]["rank"], verdict["suspects"][0]["reason"]) == (3, "mismatch")
    assert text.splitlines()[0].startswith("rank 3's all_reduce #5 of group default_pg has input shapes (8,), "
                                           "ranks 0, 1, 2 have (4,)"), text


def test_a_send_whose_peer_never_receives_names_both_ranks(jobs, tmp_path):
    job = jobs(tmp_path, "pipeline", steps=8)
    job.wait_until("rank 1 waiting in send #5 to rank 2", lambda: job.in_flight(1) == [("torch.distributed.send", 5)]
                   and job.in_flight(3) == [("torch.distributed.recv", 5)] and job.in_flight(2) == [])
    time.sleep(1.5)  # longer than --hang-seconds
    status, text, document = report(tmp_path, hang_seconds=1)
    verdict = document["cross_rank"]
    assert status == 1
    first = text.splitlines()[0]
    assert first.startswith("rank 2 is idle (no call in flight"), first
    assert "never posted recv #5 from rank 1, which waits in send #5 to it" in first
    assert "never sent #5 to rank 3, which waits in recv #5 from it" in first
    assert (verdict["suspects"][0]["rank"], verdict["suspects"][0]["reason"]) == (2, "missing")
    sends = [e for e in verdict["collectives"] if e.get("source") == 1 and e.get("destination") == 2]
    assert [(e["op"], e["seq"], e["waiting"], e["missing"]) for e in sends] == [("send", 5, [1], [2])]
    # Rank 0 waits in turn, for rank 1, which waits itself: a victim, not a suspect.
    assert 1 not in [s["rank"] for s in verdict["suspects"]]


def test_a_healthy_live_job_has_no_suspect(jobs, tmp_path):
    job = jobs(tmp_path, "healthy")
    job.wait_until("a few dozen steps", lambda: sum(s.name == "torch.distributed.all_reduce" for s in job.spans(0)) > 30)
    status, text, document = report(tmp_path)
    verdict = document["cross_rank"]
    assert status == 0, text
    assert verdict["suspects"] == [] and text.startswith("no suspect: 4 ranks (4 running)"), text
    assert {r["state"] for r in verdict["ranks"]} == {"running"}


def test_two_jobs_in_one_directory_get_two_verdicts(jobs, tmp_path):
    # Two jobs at once, and then a third on the first one's rendezvous: never mixed.
    first, second = jobs(tmp_path, "healthy", steps=5, world=2), jobs(tmp_path, "healthy", steps=7, world=2)
    assert first.finish() == second.finish() == [0, 0]
    status, text, document = report(tmp_path)
    assert status == 0, text
    verdicts = document["cross_rank_jobs"]
    assert len(verdicts) == 2 and verdicts[0]["job"] != verdicts[1]["job"]
    assert sorted(len(v["ranks"]) for v in verdicts) == [2, 2]
    counts = sorted(v["ranks"][0]["last_collectives"]["default_pg"]["seq"] for v in verdicts)
    assert counts == [6, 8]  # each job's all-reduces and its closing barrier
    assert text.count("no suspect: 2 ranks (2 ended)") == 2


def test_a_job_run_again_on_the_same_rendezvous_is_another_job(tmp_path):
    directory = tmp_path
    rendezvous = port()
    for steps in (3, 4):
        env = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                        SGLANG_KERNEL_API_TRACEFILE=str(directory / "trace_%i.sgltrace"))
        processes = [subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(rendezvous), "healthy", str(steps)],
                                      cwd=directory, env=env) for rank in range(2)]
        assert [process.wait(timeout=120) for process in processes] == [0, 0]
    status, text, document = report(directory)
    verdicts = document["cross_rank_jobs"]
    assert len(verdicts) == 2 and verdicts[0]["job"] == verdicts[1]["job"]
    assert sorted(v["ranks"][0]["last_collectives"]["default_pg"]["seq"] for v in verdicts) == [4, 5]


def test_every_ranks_kernels_of_a_batch_share_its_trace_in_jaeger(tmp_path):
    ensure_built()
    jaeger = Jaeger(tmp_path)
    try:
        env = clean_env(SGLANG_KERNEL_API_LOGLEVEL="1", SGLANG_KERNEL_API_LOGDEST="off",
                        SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "trace_%i.sgltrace"),
                        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{jaeger.otlp}", OTEL_EXPORTER_OTLP_INSECURE="true",
                        OTEL_SERVICE_NAME="ranks-batch")
        rendezvous = port()
        processes = [subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(rendezvous), "healthy", "3"],
                                      cwd=tmp_path, env=env) for rank in range(2)]
        assert [process.wait(timeout=120) for process in processes] == [0, 0]

        def batch_traces():
            found = {}
            for trace_id in jaeger.search("ranks-batch"):
                trace = jaeger.trace(trace_id)
                if sum(s["operationName"] == "decode_batch" for s in trace["spans"]) == 2 and \
                        sum(s["operationName"] == "torch.distributed.all_reduce" for s in trace["spans"]) == 2:
                    found[trace_id] = trace
            return found if len(found) == 3 else None

        for trace in wait("three batch traces, each with both ranks' spans", batch_traces, timeout=60).values():
            ranks = {pid: {t["key"]: t["value"] for t in process["tags"]}.get("sglang.rank")
                     for pid, process in trace["processes"].items()}
            batches = [s for s in trace["spans"] if s["operationName"] == "decode_batch"]
            assert sorted(ranks[b["processID"]] for b in batches) == [0, 1]
            for batch in batches:
                children = sorted(s["operationName"] for s in trace["spans"] if {
                    "refType": "CHILD_OF", "traceID": batch["traceID"], "spanID": batch["spanID"]} in s["references"])
                assert children == ["layer.attn", "layer.mlp", "torch.distributed.all_reduce"]
                assert all(s["processID"] == batch["processID"] for s in trace["spans"]
                           if any(r["spanID"] == batch["spanID"] for r in s["references"]))
    finally:
        jaeger.close()


def test_report_over_the_jaeger_free_archive_of_a_dead_job_gives_the_same_verdict(jobs, tmp_path):
    """The verdict from OTLP JSON (what `export` and a Collector's archive
    hold) names the same rank and kernel as from the trace files."""
    job = jobs(tmp_path, "abort", steps=8)
    job.finish()
    archive = tmp_path / "archive"
    archive.mkdir()
    for rank in range(4):
        exported = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "export", job.path(rank), "-o",
                                   str(archive / f"rank{rank}.jsonl")], capture_output=True, text=True, timeout=120)
        assert exported.returncode == 0, exported.stderr
    _, _, document = report(archive)
    assert [(s["rank"], s["reason"], s["call"]) for s in document["cross_rank"]["suspects"]] == \
        [(2, "crashed", "layer.boom")]  # the signal went with the call in flight (sglang.process.fatal_signal)


def test_a_report_over_some_ranks_files_names_the_ranks_without_one_first(jobs, tmp_path):
    """The other node's files not copied yet: ranks 2 and 3 have none, and ranks 0 and 1, which only
    waited for them, are never the culprit."""
    job = jobs(tmp_path, "stuck")
    job.wait_until("rank 2 stuck, the others in all_reduce #5", lambda: job.in_flight(2) == [("layer.stuck", None)]
                   and all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3)))
    job.kill()
    status, text, document = report(job.path(0), job.path(1))
    verdict = document["cross_rank"]
    assert status == 1
    assert text.splitlines()[0] == ("no file for ranks 2, 3 of 4 (the likely culprits); ranks 0, 1 waited in "
                                    "all_reduce #5 of group default_pg for them"), text
    assert verdict["missing_ranks"] == [2, 3] and verdict["world_size"] == 4
    assert [(s["rank"], s["reason"]) for s in verdict["suspects"]] == [(2, "no_file"), (3, "no_file")]


def test_a_live_wait_under_the_threshold_names_the_rank_everyone_waits_for(jobs, tmp_path):
    job = jobs(tmp_path, "stuck")
    job.wait_until("rank 2 stuck, the others in all_reduce #5", lambda: job.in_flight(2) == [("layer.stuck", None)]
                   and all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3)))
    time.sleep(3)  # past a twentieth of the threshold
    status, text, document = report(tmp_path, hang_seconds=60)
    verdict = document["cross_rank"]
    assert status == 0  # no hang yet: nothing to fail a gate on
    first = text.splitlines()[0]
    assert re.fullmatch(r"ranks 0, 1, 3 have waited [\d.]+ s in all_reduce #5 of group default_pg for rank 2 "
                        r"\(in layer\.stuck for [\d.]+ s\); a hang at 60 s", first), first
    assert verdict["waiting_for"]["ranks"] == [2] and verdict["waiting_for"]["seconds"] >= 3
    assert verdict["suspects"] == [] and "No suspect" not in text and "no suspect" not in text
    # The live page says the same, never "no crash, no failure".
    page = tmp_path / "live.html"
    made = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 0, made.stderr
    html = page.read_text()
    assert '<p class="verdict waiting">ranks 0, 1, 3 have waited' in html and "no crash, no failure" not in html


def test_a_rank_blocked_outside_any_kernel_is_shown_where_it_waits(jobs, tmp_path):
    job = jobs(tmp_path, "blocked", SGLANG_KERNEL_API_HANG_SECONDS="2")
    job.wait_until("the others in all_reduce #5, rank 2 in no call",
                   lambda: all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3))
                   and job.in_flight(2) == [] and sok.read_trace_file(job.path(2)).stacks)
    status, text, document = report(tmp_path, hang_seconds=2)
    first = text.splitlines()[0]
    assert first.startswith("rank 2 is in wait_for_nothing (rank_worker.py:") and \
        " <- step (rank_worker.py:" in first and "silent for" in first, first
    job.kill()
    status, text, document = report(tmp_path)
    first = text.splitlines()[0]
    assert status == 1
    assert re.match(r"rank 2 was in wait_for_nothing \(rank_worker\.py:\d+\) <- step \(rank_worker\.py:\d+\) <- "
                    r"main \(rank_worker\.py:\d+\) when it died, silent for [\d.]+ s and never entered all_reduce #5 "
                    r"of group default_pg, which ranks 0, 1, 3 waited in", first), first
    [suspect] = document["cross_rank"]["suspects"]
    assert suspect["rank"] == 2 and suspect["reason"] == "missing"
    assert [frame["function"] for frame in suspect["stack"][:3]] == ["wait_for_nothing", "step", "main"]
    assert suspect["stack"][0]["file"].endswith("rank_worker.py") and suspect["stack"][0]["line"] > 0
    assert "its thread's stack when it went silent (innermost first):\n         wait_for_nothing (" in text
    page = tmp_path / "report.html"
    made = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(tmp_path), "--html", str(page)],
                          capture_output=True, text=True, timeout=120)
    assert made.returncode == 1, made.stderr  # a suspect, as in the text
    assert "rank 2 was in wait_for_nothing (rank_worker.py:" in page.read_text()


def test_a_rank_that_holds_the_gil_in_c_is_frozen_with_the_time_of_its_last_beat(jobs, tmp_path):
    job = jobs(tmp_path, "frozen", SGLANG_KERNEL_API_HANG_SECONDS="2")
    job.wait_until("the others in all_reduce #5", lambda: all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)]
                                                            for r in (0, 1, 3)))
    heartbeat = lambda: sok.read_trace_file(job.path(2)).heartbeat  # noqa: E731
    beat = heartbeat()
    time.sleep(6.5)  # past the 5 s that make a stopped heartbeat a frozen process
    assert heartbeat() == beat and job.alive()
    status, text, document = report(tmp_path, hang_seconds=2)
    first = text.splitlines()[0]
    assert re.match(r"rank 2 is frozen: its heartbeat stopped at \d\d:\d\d:\d\d\.\d{6}, [\d.]+ s ago \(a thread holds "
                    r"the GIL\) and never entered all_reduce #5 of group default_pg, which ranks 0, 1, 3 wait in", first), first
    states = {rank["rank"]: rank["state"] for rank in document["cross_rank"]["ranks"]}
    assert states == {0: "running", 1: "running", 2: "frozen", 3: "running"}
    assert [f["state"] for f in document["files"] if f["path"] == job.path(2)] == ["frozen"]


def test_watch_says_each_new_verdict_and_puts_it_in_jaeger_through_the_shipped_collector(jobs, tmp_path):
    from backends import Collector

    ensure_built()
    jaeger = Jaeger(tmp_path)
    collector = Collector(tmp_path, jaeger, 100, str(tmp_path / "archive" / "kernels.jsonl"))
    watcher = None
    try:
        job = jobs(tmp_path, "stuck", OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint, OTEL_EXPORTER_OTLP_INSECURE="true",
                   OTEL_SERVICE_NAME="ranks-watch", SGLANG_KERNEL_API_HANG_SECONDS="2", OTEL_METRIC_EXPORT_INTERVAL="1000")
        watcher = subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels", "watch", str(tmp_path), "--interval", "1",
                                    "--hang-seconds", "2"], env=clean_env(OTEL_EXPORTER_OTLP_ENDPOINT=collector.endpoint,
                                                                          OTEL_EXPORTER_OTLP_INSECURE="true",
                                                                          OTEL_SERVICE_NAME="ranks-watch",
                                                                          OTEL_METRIC_EXPORT_INTERVAL="1000"),
                                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        assert watcher.stdout.readline().startswith(f"watching {tmp_path}: the verdict every 1 s, each new one exported")
        lines = []
        deadline = time.monotonic() + 90
        while not any("rank 2 is stuck in layer.stuck" in line for line in lines):
            assert time.monotonic() < deadline, lines
            lines.append(watcher.stdout.readline())
        assert re.match(r"\d\d:\d\d:\d\d\.\d{6} job tcp://127\.0\.0\.1:\d+: rank 2 is stuck in layer\.stuck \(running ",
                        lines[-1]), lines
        assert job.alive()

        def verdict_in_jaeger():  # the hang's (an earlier one may say that the others wait for rank 2)
            traces = [jaeger.trace(trace_id) for trace_id in jaeger.search("ranks-watch", {"sglang.verdict.reason": "missing"})]
            found = [(span, trace["processes"][span["processID"]]) for trace in traces
                     for span in trace["spans"] if span["operationName"] == "sglang.verdict"]
            return found or None

        [(verdict, process)] = wait("the verdict in Jaeger", verdict_in_jaeger, timeout=60)
        tags = _tags(verdict)
        assert (tags["sglang.verdict.rank"], tags["sglang.verdict.call"], tags["error"]) == (2, "layer.stuck", True)
        assert tags["sglang.verdict.detail"].startswith("rank 2 is stuck in layer.stuck") and tags["sglang.verdict.seconds"] >= 2
        assert tags["sglang.job"].startswith("tcp://127.0.0.1:")
        # The suspect's host and pid, on the span; the host watch runs on, on its process; and the verdict lasts
        # from the first sign (the call stuck that long) to when it was said.
        assert (tags["sglang.verdict.host"], tags["sglang.verdict.pid"]) == (socket.gethostname(), job.processes[2].pid)
        process = {tag["key"]: tag["value"] for tag in process["tags"]}
        assert process["host.name"] == socket.gethostname() and process["process.pid"] == watcher.pid
        assert verdict["duration"] >= tags["sglang.verdict.seconds"] * 1e6 - 1  # (microseconds)
        # Linked to rank 2's call in flight, the span the hung export sits in.
        [stuck] = [s for s in job.spans(2) if s.in_flight and s.name == "layer.stuck"]
        assert {(int(ref["traceID"], 16), int(ref["spanID"], 16)) for ref in verdict["references"]
                if ref["refType"] == "FOLLOWS_FROM"} == {(stuck.trace_id, stuck.span_id)}
        # The Collector serves the metrics to Prometheus: rank 2's longest call in flight (the sidecars'), the
        # job's suspect (watch's), and every rank's calls.
        def prometheus():
            samples = collector.samples("sglang_", "PROMETHEUS_PORT")
            value = lambda name, *labels: [float(line.rsplit(" ", 1)[1]) for line in samples  # noqa: E731
                                           if line.startswith(name + "{") and all(label in line for label in labels)]
            longest, suspect = value("sglang_kernel_in_flight_longest_seconds", 'sglang_rank="2"'), \
                value("sglang_job_suspect", 'sglang_rank="2"', 'reason="missing"')
            calls = {rank: value("sglang_kernel_calls_total", f'sglang_rank="{rank}"') for rank in range(4)}
            return (longest, suspect, calls) if longest and longest[0] >= 2 and suspect == [1.0] and all(
                calls.values()) else None

        longest, suspect, calls = wait("rank 2's metrics in Prometheus", prometheus, timeout=60)
        assert all(sum(values) >= 4 for values in calls.values()), calls  # at least the first steps' kernels
        watcher.send_signal(signal.SIGTERM)
        assert watcher.wait(timeout=30) == 0, watcher.stderr.read()
    finally:
        if watcher is not None and watcher.poll() is None:
            watcher.kill()
        collector.close()
        jaeger.close()


def test_report_from_jaeger_alone_names_the_rank_and_its_kernel_after_the_files_are_gone(jobs, tmp_path):
    ensure_built()
    jaeger = Jaeger(tmp_path)
    try:
        job = jobs(tmp_path, "stuck", OTEL_EXPORTER_OTLP_ENDPOINT=f"http://{jaeger.otlp}",
                   OTEL_EXPORTER_OTLP_INSECURE="true", OTEL_SERVICE_NAME="ranks-jaeger")
        job.wait_until("rank 2 stuck, the others in all_reduce #5", lambda: job.in_flight(2) == [("layer.stuck", None)]
                       and all(job.in_flight(r) == [("torch.distributed.all_reduce", 5)] for r in (0, 1, 3)))
        time.sleep(2)  # stuck a while
        job.kill()
        wait("the four calls in flight in Jaeger", lambda: len(jaeger.search("ranks-jaeger",
                                                                          {"sglang.kernel.in_flight": "true"})) >= 1
             and _in_flight_in_jaeger(jaeger) >= 4, timeout=60)
        for path in tmp_path.glob("trace_*"):
            path.unlink()  # nothing on disk: Jaeger alone
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger", jaeger.query,
                               "--service", "ranks-jaeger", "--since", "10m", "--json", "--hang-seconds", "1"],
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode == 1, proc.stderr
        verdict = json.loads(proc.stdout)["cross_rank"]
        # As the files said it (the running time up to the last sign of life the sidecar exported, and
        # how the process ended, which the sidecar put on the calls it left in flight).
        assert re.fullmatch(r"rank 2 was stuck in layer\.stuck for [1-9][\d.]* s when it was killed from outside "
                            r"\(no fatal signal recorded\), while its batch decode_batch served requests req-1, req-2; "
                            r"it never entered all_reduce #5 of group default_pg, which ranks 0, 1, 3 waited in",
                            verdict["verdict"]), verdict["verdict"]
        assert [(s["rank"], s["call"], s["reason"]) for s in verdict["suspects"]] == \
            [(2, "layer.stuck", "killed_while_stuck")]
        assert sorted(rank["rank"] for rank in verdict["ranks"]) == [0, 1, 2, 3]
        text = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger", jaeger.query,
                               "--service", "ranks-jaeger"], capture_output=True, text=True, timeout=120).stdout
        assert "layer.stuck  (rank 2, pid " in text
        # No Jaeger there, a page under Jaeger's address that is not its API, not an http URL: one line and exit 2.
        for url in (f"http://127.0.0.1:{port()}", f"{jaeger.query}/not-jaeger", "ftp://127.0.0.1/"):
            bad = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--jaeger", url, "--service",
                                  "ranks-jaeger"], capture_output=True, text=True, timeout=120)
            assert bad.returncode == 2 and bad.stderr.count("\n") == 1, bad.stderr
    finally:
        jaeger.close()


def _in_flight_in_jaeger(jaeger) -> int:
    return sum(1 for trace_id in jaeger.search("ranks-jaeger", {"sglang.kernel.in_flight": "true"})
               for span in jaeger.trace(trace_id)["spans"]
               if _tags(span).get("sglang.kernel.in_flight") is True and _tags(span).get("sglang.kernel.name")
               and "sglang.kernel.copy_of" not in _tags(span))


def test_watch_says_soon_when_nothing_it_follows_is_live_and_then_follows_a_new_job(jobs, tmp_path):
    """On an empty directory, then on one whose job died: a line within 10 s
    each time that says so and what to run; a job that starts meanwhile is
    followed at once."""
    watcher = subprocess.Popen([sys.executable, "-m", "sglang_otel_kernels", "watch", str(tmp_path), "--interval", "30"],
                               env=clean_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert watcher.stdout.readline().startswith(f"watching {tmp_path}: the verdict every 30 s")
        began = time.monotonic()  # from its first line: its interpreter's start, slow in a loaded CI, is not its wait
        line = watcher.stdout.readline()
        assert line.startswith(f"no trace file in {tmp_path} yet (*.sgltrace); still watching for new ones"), line
        assert time.monotonic() - began < 10 + 5  # (5: a loaded machine)
        job = jobs(tmp_path, "healthy", world=2)
        line = watcher.stdout.readline()  # followed at once, not 30 s later: the job's first verdict
        assert re.match(r"\d\d:\d\d:\d\d\.\d{6} job tcp://127\.0\.0\.1:\d+: no suspect", line), line
        job.kill()
        died = time.monotonic()
        line = watcher.stdout.readline()
        if not line.startswith("nothing live"):  # its last verdict first, where the kill changed it
            assert re.match(r"\d\d:\d\d:\d\d\.\d{6} job tcp://", line), line
            line = watcher.stdout.readline()
        assert line.startswith(f"nothing live in {tmp_path}: 2 trace file(s), no process writing one now; still "
                               f"watching for new ones. What ended is read with: sglang-otel-kernels report {tmp_path}"), line
        assert time.monotonic() - died < 10 + 30  # (30: the death is seen at the next verdict)
    finally:
        watcher.kill()
        watcher.wait(timeout=30)
