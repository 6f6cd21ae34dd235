"""The README's main job: the demo, in-process and with a real crash."""

import re
import subprocess
import sys

from otlp_receivers import GrpcReceiver
from conftest import clean_env


def demo(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "demo", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_demo_reports_the_failing_kernel_and_its_request(tmp_path):
    proc = demo(tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    bad_id = bad_request_id(out, "-> 500 ")
    assert '"error": "IndexError: index out of range in self"' in out.split("[12, 39]")[1].splitlines()[1]
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    report = out.split(f"Crash report from {trace_file}")[1]
    assert "No kernel call was running" in report
    failed = report.split("Failed calls (1):\n")[1]
    # The call names the process and file it ran in.
    pid = trace_file.name.split("_")[-1].split(".")[0]
    assert failed.startswith(f"  sglang.custom_op.embedding  (pid {pid}, {trace_file.name}; thread scheduler")
    assert "raised IndexError: index out of range in self" in failed
    assert_batch_inputs_match_requests(failed, bad_id)
    (text_log,) = tmp_path.glob("sglang_kernel_api_*.log")
    assert "SGLang Kernel API Exception: sglang.custom_op.embedding (IndexError" in text_log.read_text()


def test_demo_crash_reports_what_the_dead_process_left(tmp_path):
    proc = demo(tmp_path, "--crash")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "-> no answer: the server died" in out.split("[12, 39]")[1].splitlines()[1]
    assert "ended: killed by SIGABRT." in out
    crashed = out.split("CRASHED: 1 kernel call(s) were running when the process died:\n")[1]
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    pid = trace_file.name.split("_")[-1].split(".")[0]
    assert crashed.startswith(f"  sglang.custom_op.embedding  (pid {pid}, {trace_file.name}; thread scheduler")
    assert_batch_inputs_match_requests(crashed.split("Also unfinished")[0], None)
    assert "Fatal Python error: Aborted" in crashed
    assert "in embedding" in crashed  # where Python was, from the saved traceback
    # The five requests were one batch (the demo's batching window), as the README shows.
    batch = re.search(r"batch decode_batch: requests ((?:req-\d+, ){4}req-\d+) \(5 traces linked\)", crashed)
    assert batch and sorted(batch[1].split(", ")) == [f"req-000{i}" for i in range(1, 6)], crashed
    # No endpoint set: the hint is to replay the file to a local Collector.
    assert "replay sglang_kernel_trace_" in out and "--endpoint http://127.0.0.1:4317" in out
    # The spans around the call: one line per name with its traces, wrapped.
    # Each request's span is named by its id, so each line pairs a request with its trace.
    unfinished = crashed.split("Also unfinished")[1].split("\n\n")[0].splitlines()
    assert [re.sub(r"[0-9a-f]{32}", "T", line) for line in unfinished[1:6]] == [
        f"  POST /generate req-000{i} (1): trace T" for i in range(1, 6)]
    assert all(len(line) <= 110 for line in unfinished[1:])
    # The traceback: the thread that crashed first, the five HTTP threads waiting
    # in the same place collapsed into one entry.
    stacks = out.split("Python traceback")[1].split("\n\n", 1)[1].split("\n\nkernel ")[0]
    assert stacks.splitlines()[0].startswith("  Current thread 0x")
    assert "in embedding" in stacks.split("\n\n")[0]
    assert re.search(r"  Thread 0x[0-9a-f]+ and 4 more threads with the same stack", stacks)
    assert stacks.count(" in app\n") == 1
    assert all(len(line) <= 130 for line in stacks.splitlines() if 'File "' not in line)


def assert_batch_inputs_match_requests(block: str, request_id) -> None:
    """The token ids tensor has one row per request of the batch, and the
    batch names the request that carried the bad token."""
    match = re.search(r"arg0 = Tensor\(shape=\((\d+), (\d+)\), dtype=torch.int64", block)
    assert match, block
    ids = block.split("batch decode_batch: requests ")[1].split(" (")[0].split(", ")
    assert len(ids) == int(match.group(1))
    if request_id is not None:
        assert request_id in ids


def bad_request_id(out: str, marker: str) -> str:
    """The id the service gave the request with the out-of-range token."""
    outcome = out.split("[12, 39]")[1].splitlines()[1]
    assert marker in outcome, outcome
    return outcome.split('"id": "')[1].split('"')[0]


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr and proc.stderr.count("\n") == 1


def test_demo_crash_with_an_endpoint_exports_the_call_in_flight(tmp_path):
    receiver = GrpcReceiver()
    try:
        env = clean_env()
        env["OTEL_EXPORTER_OTLP_ENDPOINT"] = receiver.endpoint
        proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "demo", "--crash"], cwd=tmp_path,
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr
        # The sidecar, the default exporter, sends the call that was running when the server died.
        spans = receiver.wait_for(lambda got: any(s["attributes"].get("sglang.kernel.in_flight") and
                                                  s["name"] == "sglang.custom_op.embedding" for s in got))
        [dying] = [s for s in spans if s["name"] == "sglang.custom_op.embedding"
                   and s["attributes"].get("sglang.kernel.in_flight") and "sglang.kernel.copy_of" not in s["attributes"]]
        assert dying["status"] == 2 and dying["attributes"]["sglang.kernel.input.arg0.dtype"] == "torch.int64"
        assert any(s["name"] == "decode_batch" for s in spans)
        # And a copy of it in each of the five request traces its batch held (tests/test_backends.py opens them in Jaeger).
        traceparents = {int(line.split("traceparent 00-")[1][:32], 16) for line in proc.stdout.splitlines()
                        if "traceparent 00-" in line}
        spans = receiver.wait_for(lambda got: sum("sglang.kernel.copy_of" in s["attributes"] for s in got) == 5)
        copies = [s for s in spans if "sglang.kernel.copy_of" in s["attributes"]]
        assert {s["trace_id"] for s in copies} == traceparents and len(traceparents) == 5
        assert all(s["attributes"]["sglang.kernel.in_flight"] is True and s["status"] == 2 for s in copies)
        # The hint says what happened with this endpoint, not a replay to another one.
        assert f"The export sidecar sent these spans to {receiver.endpoint}" in proc.stdout
        assert "replay" not in proc.stdout.split("CRASHED")[1]
    finally:
        receiver.stop()
