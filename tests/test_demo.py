"""The README's main job: the demo, in-process and with a real crash."""

import subprocess
import sys


def demo(tmp_path, *args):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "demo", *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)


def test_demo_reports_the_failing_kernel_and_its_request(tmp_path):
    proc = demo(tmp_path)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("-> 200 ") == 4
    assert '-> 500 {"id": "req-0005", "error": "IndexError: index out of range in self"}' in out
    (trace_file,) = tmp_path.glob("sglang_kernel_trace_*.sgltrace")
    report = out.split(f"Crash report from {trace_file}")[1]
    assert "No kernel call was running" in report
    failed = report.split("Failed calls (1):\n")[1]
    assert failed.startswith("  sglang.custom_op.embedding  (thread scheduler")
    assert "raised IndexError: index out of range in self" in failed
    assert "arg0 = Tensor(shape=(1, 2), dtype=torch.int64" in failed
    assert "batch decode_batch: requests req-0005" in failed
    (text_log,) = tmp_path.glob("sglang_kernel_api_*.log")
    assert "SGLang Kernel API Exception: sglang.custom_op.embedding (IndexError" in text_log.read_text()


def test_demo_crash_reports_what_the_dead_process_left(tmp_path):
    proc = demo(tmp_path, "--crash")
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert out.count("-> 200 ") == 4
    assert "-> no answer: the server died" in out
    assert "ended: killed by SIGABRT." in out
    crashed = out.split("CRASHED: 1 kernel call(s) were running when the process died:\n")[1]
    assert crashed.startswith("  sglang.custom_op.embedding  (thread scheduler")
    assert "arg0 = Tensor(shape=(1, 2), dtype=torch.int64" in crashed
    assert "batch decode_batch: requests req-0005" in crashed
    assert "Fatal Python error: Aborted" in crashed
    assert "in embedding" in crashed  # where Python was, from the saved traceback


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
