"""`sglang-otel-kernels report` on trace files left by real crashed children."""

import json
import os
import subprocess
import sys

import pytest

from conftest import run_python

DIES_IN_A_BATCH = """
import os, sys, torch, sglang_otel_kernels as sok
sok.configure(level=5, log_dest="off", trace_file="t.sgltrace")
norm = sok.debug_kernel_api(op_name="sglang.custom_op.rmsnorm")(lambda x: x / x.abs().max())
@sok.debug_kernel_api(op_name="sglang.custom_op.embedding")
def embedding(ids, table):
    if sys.argv[1] == "crash":
        os._exit(134)  # as an illegal memory access takes the process down
    return torch.nn.functional.embedding(ids, table)
norm(torch.ones(3))
norm(torch.zeros(3))  # 0/0: the first NaN, from finite inputs
carriers = [("00-" + "a" * 32 + "-" + "b" * 16 + "-01", "req-1"), ("00-" + "c" * 32 + "-" + "d" * 16 + "-01", "req-2")]
with sok.forward_batch(carriers, name="decode_batch"):
    try:
        embedding(torch.tensor([[1, 99]]), torch.ones(4, 2))
    except IndexError:
        pass
"""


def cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", *args], cwd=cwd, capture_output=True,
                          text=True, timeout=120)


@pytest.fixture(params=["crash", "raise"])
def left_file(request, tmp_path):
    proc = run_python(DIES_IN_A_BATCH.replace("sys.argv[1]", repr(request.param)), tmp_path)
    assert proc.returncode == (134 if request.param == "crash" else 0), proc.stderr
    return request.param, tmp_path / "t.sgltrace"


def test_report_names_the_call_its_inputs_and_its_requests(left_file):
    mode, path = left_file
    proc = cli("report", str(path))
    assert proc.returncode == 1, proc.stderr  # calls in flight or failed: documented exit status 1
    out = proc.stdout
    section = "CRASHED: 1 kernel call(s) were running" if mode == "crash" else "Failed calls (1):"
    assert section in out
    block = out.split(section)[1]
    assert "sglang.custom_op.embedding" in block
    assert "arg0 = Tensor(shape=(1, 2), dtype=torch.int64" in block
    assert "batch decode_batch: requests req-1, req-2 (2 traces linked)" in block
    if mode == "raise":
        assert "raised IndexError: index out of range in self" in block
    assert "First call that produced NaN/Inf from finite inputs:\n  sglang.custom_op.rmsnorm" in out
    assert "sglang.custom_op.rmsnorm" in out.split("kernel ")[-1]  # the per-kernel summary


def test_report_shows_the_output_that_proves_the_nan_and_words_statuses(left_file):
    _, path = left_file
    out = cli("report", str(path)).stdout
    first = out.split("First call that produced NaN/Inf from finite inputs:\n")[1].split("\n\n")[0]
    assert "arg0 = Tensor(shape=(3,), dtype=torch.float32" in first and "nan_count=0" in first
    assert "  -> output = Tensor(shape=(3,), dtype=torch.float32" in first and "nan_count=3" in first
    last = out.split("completed calls:\n")[1].split("\n\n")[0].splitlines()
    assert [line.split("  ")[-1] for line in last] == ["ok", "ok"] + (["error"] if "raise" in str(left_file) else [])
    assert "UNSET" not in out


def test_a_first_call_does_not_carry_the_recorders_set_up(tmp_path):
    script = """
import time, sglang_otel_kernels as sok
from sglang_otel_kernels.record import tracefile
opened = tracefile.TraceFileWriter._open
def slow_open(self):  # the file's creation, made slow: it must not count as the call's time
    time.sleep(0.5)
    return opened(self)
tracefile.TraceFileWriter._open = slow_open
sok.configure(level=1, log_dest="off", trace_file="t.sgltrace")
noop = sok.debug_kernel_api(op_name="noop")(lambda: None)
noop()
noop()
"""
    assert run_python(script, tmp_path).returncode == 0
    report = json.loads(cli("report", str(tmp_path / "t.sgltrace"), "--json").stdout)
    durations = [call["duration_us"] for call in report["last_calls"]]
    assert len(durations) == 2 and max(durations) < 100_000, durations


def test_report_json_parses_and_holds_the_same(left_file):
    mode, path = left_file
    proc = cli("report", str(path), "--json", "--last", "2")
    report = json.loads(proc.stdout)
    calls = report["in_flight"] if mode == "crash" else report["failed"]
    (call,) = calls
    assert call["name"] == "sglang.custom_op.embedding"
    assert call["inputs"]["arg0"]["shape"] == [1, 2]
    assert call["requests"]["request_ids"] == ["req-1", "req-2"]
    assert report["crashed"] is (mode == "crash")
    assert len(report["last_calls"]) == 2
    assert report["summary"]["sglang.custom_op.rmsnorm"]["calls"] == 2


def test_clean_file_exits_zero_and_ranks_merge(tmp_path):
    script = (
        "import torch, sglang_otel_kernels as sok\n"
        "sok.configure(level=1, log_dest='off', trace_file='r%i.sgltrace')\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda: None)\n"
        "for _ in range(3): k()\n"
    )
    for _ in range(2):
        assert run_python(script, tmp_path).returncode == 0
    files = sorted(str(p) for p in tmp_path.glob("r*.sgltrace"))
    proc = cli("report", *files)
    assert proc.returncode == 0, proc.stderr
    assert "No kernel call was running" in proc.stdout
    assert proc.stdout.count(" spans\n") == 2
    assert "k " in proc.stdout and "      6 " in proc.stdout  # 6 calls across both files


def test_nan_from_finite_inputs_and_nothing_worse_exits_3(tmp_path):
    """A gate tells numerics from crashes: NaN alone is 3, NaN beside a failure or a crash is 1 (left_file)."""
    script = DIES_IN_A_BATCH.split("carriers =")[0]  # the two norm calls, the second making NaN; no embedding
    assert run_python(script, tmp_path).returncode == 0
    for options in ([], ["--json"], ["--html", str(tmp_path / "r.html")]):
        proc = cli("report", str(tmp_path / "t.sgltrace"), *options)
        assert proc.returncode == 3, proc.stderr
    text = cli("report", str(tmp_path / "t.sgltrace")).stdout
    assert "First call that produced NaN/Inf from finite inputs:\n  sglang.custom_op.rmsnorm" in text
    # What the on-call engineer reads first: the numerics, not "nothing found".
    assert text.startswith("the first NaN/Inf from finite inputs came out of sglang.custom_op.rmsnorm"), text
    page = (tmp_path / "r.html").read_text()
    assert '<p class="verdict nonfinite">NaN/Inf: the first NaN/Inf from finite inputs came out of sglang.custom_op.rmsnorm' in page
    assert "3 a call made NaN/Inf from finite inputs" in cli("report", "--help").stdout


@pytest.mark.parametrize("args, message", [
    (["report", "missing.sgltrace"], "no such file"),
    (["report", "--last", "-1", "x"], "--last must be 0 or more"),
])
def test_report_errors(tmp_path, args, message):
    proc = cli(*args, cwd=tmp_path)
    assert proc.returncode == 2
    assert message in proc.stderr and proc.stderr.count("\n") == 1
    assert "Traceback" not in proc.stderr


def test_export_chrome_timeline(left_file, tmp_path):
    mode, path = left_file
    out = tmp_path / "timeline.json"
    proc = cli("export", str(path), "--format", "chrome", "-o", str(out))
    assert proc.returncode == 0, proc.stderr
    timeline = json.loads(out.read_text())
    events = [e for e in timeline["traceEvents"] if e["ph"] == "X"]
    names = [e["name"] for e in events]
    assert names.count("sglang.custom_op.rmsnorm") == 2
    thread_names = [e for e in timeline["traceEvents"] if e["ph"] == "M" and e["name"] == "thread_name"]
    assert [t["args"]["name"] for t in thread_names] == ["MainThread"]
    embedding = next(e for e in events if e["name"].startswith("sglang.custom_op.embedding"))
    if mode == "crash":
        assert embedding["name"].endswith("[IN FLIGHT]") and embedding["cname"] == "terrible"
    else:
        assert embedding["cname"] == "bad" and embedding["args"]["status"] == "ERROR"
    assert embedding["args"]["sglang.kernel.input.arg0.shape"] == [1, 2]
    # One small tid for the one thread (Perfetto's importer takes 32-bit tids).
    assert all(e["dur"] >= 0 and e["tid"] == embedding["tid"] == 1 for e in events)
    if mode == "crash":  # the call in flight is the newest record: it is drawn, not zero-wide
        assert embedding["dur"] >= 1000 and "unknown" in embedding["args"]["end"]


def test_report_and_timeline_from_our_own_otlp_json_export(left_file, tmp_path):
    mode, path = left_file
    exported = tmp_path / "spans.jsonl"
    assert cli("export", str(path), "-o", str(exported)).returncode == 0
    from_file, from_json = cli("report", str(path)), cli("report", str(exported))
    assert from_json.returncode == from_file.returncode == 1, from_json.stderr
    section = "CRASHED: 1 kernel call(s) were running" if mode == "crash" else "Failed calls (1):"
    assert section in from_json.stdout
    assert "batch decode_batch: requests req-1, req-2 (2 traces linked)" in from_json.stdout
    assert "First call that produced NaN/Inf from finite inputs:\n  sglang.custom_op.rmsnorm" in from_json.stdout
    timeline = tmp_path / "timeline.json"
    assert cli("export", str(exported), "--format", "chrome", "-o", str(timeline)).returncode == 0
    names = [e["name"] for e in json.loads(timeline.read_text())["traceEvents"] if e["ph"] == "X"]
    assert names.count("sglang.custom_op.rmsnorm") == 2


def test_an_archive_with_another_services_spans_reports_only_the_processes_with_kernel_calls(left_file, tmp_path):
    _, path = left_file
    archive = tmp_path / "archive"
    archive.mkdir()
    assert cli("export", str(path), "-o", str(archive / "kernels.jsonl")).returncode == 0
    jaeger = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "jaeger"}}]},
                                 "scopeSpans": [{"spans": [{"traceId": "1" * 32, "spanId": "2" * 16, "name": "/api/services",
                                                            "startTimeUnixNano": "1", "endTimeUnixNano": "2"}]}]}]}
    with open(archive / "kernels.jsonl", "a") as handle:
        handle.write(json.dumps(jaeger) + "\n")
    proc = cli("report", str(archive))
    assert "pid None" not in proc.stdout and "/api/services" not in proc.stdout
    assert "(skipped 1 process(es) of OTLP JSON files without kernel calls" in proc.stdout
    assert "thread MainThread" in proc.stdout  # thread names come through the archive
    only_jaeger = tmp_path / "jaeger.jsonl"
    only_jaeger.write_text(json.dumps(jaeger) + "\n")
    refused = cli("report", str(only_jaeger))
    assert refused.returncode == 2 and "no kernel calls in 1 process(es)" in refused.stderr


def test_a_process_split_over_several_archives_is_reported_as_one(left_file, tmp_path):
    """Each gateway of a two-tier layout archives the traces routed to it:
    one process's spans in several files, as here (half the spans in each,
    and the calls in flight at its death all in the second, which the first
    file alone reads as a process that ended)."""
    mode, path = left_file
    exported = tmp_path / "all.jsonl"
    assert cli("export", str(path), "-o", str(exported)).returncode == 0
    [document] = [json.loads(line) for line in exported.read_text().splitlines()]
    spans = document["resourceSpans"][0]["scopeSpans"]

    def in_flight(span: dict) -> bool:
        return any(a["key"] == "sglang.kernel.in_flight" and a["value"].get("boolValue") for a in span["attributes"])

    for n in (0, 1):
        os.makedirs(tmp_path / f"gateway-{n}")
        part = json.loads(json.dumps(document))
        for scope, original in zip(part["resourceSpans"][0]["scopeSpans"], spans):
            ended = [span for span in original["spans"] if not in_flight(span)]
            scope["spans"] = ended[n::2] + ([span for span in original["spans"] if in_flight(span)] if n else [])
        (tmp_path / f"gateway-{n}" / "kernels.jsonl").write_text(json.dumps(part) + "\n")
    whole = json.loads(cli("report", str(exported), "--json").stdout)
    split = cli("report", str(tmp_path / "gateway-0"), str(tmp_path / "gateway-1"), "--json")
    merged = json.loads(split.stdout)
    assert len(merged["files"]) == 1 and merged["files"][0]["path"].endswith("(and 1 more file(s))")
    assert merged["summary"] == whole["summary"] and merged["files"][0]["spans"] == whole["files"][0]["spans"]
    assert [c["name"] for c in merged["in_flight"] + merged["failed"]] == \
        [c["name"] for c in whole["in_flight"] + whole["failed"]]
    ending = [(f["state"], f["fatal_signal"]) for f in (merged["files"][0], whole["files"][0])]
    assert ending[0] == ending[1] == (("died", "") if mode == "crash" else ("ended", None)), ending  # os._exit: no signal


@pytest.mark.parametrize("content, message", [
    (b"{not json\n", "no OTLP JSON spans"),
    (b'{"resourceSpans": 5}\n', "no OTLP JSON spans"),
    (b'{"resourceSpans": [{"scopeSpans": [{"spans": [{"name": "x", "traceId": "zz", "spanId": 3}]}]}]}\n',
     "no OTLP JSON spans"),
])
def test_hostile_otlp_json_is_a_clear_error(tmp_path, content, message):
    path = tmp_path / "archive.jsonl"
    path.write_bytes(content)
    proc = cli("report", str(path))
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_malformed_spans_in_otlp_json_are_left_out_and_counted(tmp_path):
    good = {"name": "k", "traceId": "ab" * 16, "spanId": "cd" * 8, "startTimeUnixNano": "1000",
            "endTimeUnixNano": "2000", "status": {"code": 2, "message": "boom"},
            "attributes": [{"key": "sglang.kernel.name", "value": {"stringValue": "k"}},
                           {"key": "deep", "value": {"arrayValue": {"values": [{"doubleValue": "NaN"}]}}}]}
    bad = [dict(good, traceId="00"), dict(good, startTimeUnixNano="-5"), dict(good, attributes=[{"value": {}}]),
           dict(good, events=[5]), "not a span"]
    line = {"resourceSpans": [{"resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "s"}}]},
                               "scopeSpans": [{"scope": {"name": "t"}, "spans": [good, *bad]}]}]}
    path = tmp_path / "archive.jsonl"
    path.write_text(json.dumps(line) + "\nnot json\n")
    proc = cli("report", "--json", str(path))
    assert proc.returncode == 1, proc.stderr  # the ERROR span is a failed call
    report = json.loads(proc.stdout)
    [failed] = report["failed"]
    assert failed["name"] == "k" and failed["description"] == "boom"
    problems = json.dumps(report)
    assert "5 malformed span(s) left out" in problems and "line 2: not JSON" in problems


@pytest.mark.parametrize("protocol", ["grpc", "http/protobuf"])
def test_replay_lands_spans_with_their_ids_under_their_requests(left_file, protocol):
    from otlp_receivers import GrpcReceiver, HttpReceiver

    import sglang_otel_kernels as sok

    mode, path = left_file
    recovered = sok.read_trace(path)
    receiver = GrpcReceiver() if protocol == "grpc" else HttpReceiver()
    try:
        proc = cli("replay", str(path), "--endpoint", receiver.endpoint, "--protocol", protocol)
        assert proc.returncode == 0, proc.stderr
        # The failed (or dying) embedding call also goes, copied, into the traces of its batch's two requests.
        spans = receiver.wait_for(lambda got: len(got) >= len(recovered) + 2)
    finally:
        receiver.stop()
    in_flight = sum(s.in_flight for s in recovered)
    assert proc.stdout == f"replayed {len(recovered) + 2} spans ({in_flight} in flight, 2 copies into request " \
        f"traces) from 1 file(s) to {receiver.endpoint + ('/v1/traces' if protocol != 'grpc' else '')}\n"
    copies = [s for s in spans if "sglang.kernel.copy_of" in s["attributes"]]
    spans = [s for s in spans if s not in copies]
    assert {(s["trace_id"], s["span_id"], s["parent_span_id"]) for s in spans} == {
        (s.trace_id, s.span_id, s.parent_span_id) for s in recovered}
    embedding = next(s for s in spans if s["name"] == "sglang.custom_op.embedding")
    batch = next(s for s in spans if s["name"] == "decode_batch")
    assert embedding["parent_span_id"] == batch["span_id"]
    assert sorted(trace for trace, _ in batch["links"]) == [int("a" * 32, 16), int("c" * 32, 16)]
    members = [s for s in spans if s["name"] == "decode_batch.request"]
    assert sorted(m["trace_id"] for m in members) == [int("a" * 32, 16), int("c" * 32, 16)]
    assert sorted((c["trace_id"], c["parent_span_id"]) for c in copies) == \
        sorted((m["trace_id"], m["span_id"]) for m in members)
    assert all(c["name"] == embedding["name"] and c["status"] == 2 for c in copies)
    assert embedding["status"] == 2
    if mode == "crash":
        assert embedding["attributes"]["sglang.kernel.in_flight"] is True
        assert embedding["end"] >= embedding["start"]


def test_replay_errors(left_file, tmp_path):
    import socket

    _, path = left_file
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = cli("replay", str(path), "--endpoint", f"http://127.0.0.1:{port}", "--protocol", "http/protobuf",
               "--timeout", "1")
    assert proc.returncode == 2
    assert proc.stderr.startswith(f"sglang-otel-kernels: cannot replay to http://127.0.0.1:{port}/v1/traces")
    assert proc.stderr.count("\n") == 1
    env_free = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", str(path)],
                              capture_output=True, text=True, timeout=60,
                              env={k: v for k, v in __import__("os").environ.items() if not k.startswith("OTEL_")})
    assert env_free.returncode == 2 and "no OTLP endpoint" in env_free.stderr


def test_replay_shows_a_progress_bar_on_a_terminal(left_file):
    import os

    from otlp_receivers import GrpcReceiver

    _, path = left_file
    receiver = GrpcReceiver()
    master, slave = os.openpty()
    try:
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "replay", str(path),
                               "--endpoint", receiver.endpoint], stdout=subprocess.PIPE, stderr=slave, text=True,
                              timeout=120)
        os.close(slave)
        terminal = b""
        while True:
            try:
                chunk = os.read(master, 4096)
            except OSError:
                break
            if not chunk:
                break
            terminal += chunk
    finally:
        os.close(master)
        receiver.stop()
    assert proc.returncode == 0
    total = len(__import__("sglang_otel_kernels").read_trace(path)) + 2  # and the copies into two request traces
    assert f"] {total}/{total} spans".encode() in terminal
    assert b"[" + b"#" * 30 + b"]" in terminal
