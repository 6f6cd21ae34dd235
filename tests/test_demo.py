"""The README's main job runs and shows the failing kernel inside its request."""

import subprocess
import sys


def test_demo_runs_and_shows_the_failing_kernel(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_otel_kernels", "demo"], cwd=tmp_path, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "SGLang Kernel API Call: sglang.custom_op.embedding" in out
    assert "SGLang Kernel API Exception: sglang.custom_op.embedding (IndexError: index out of range in self)" in out
    assert "  arg[0]=Tensor(\n      shape=(1, 2)\n      dtype=torch.int64" in out
    (trace_file,) = list(tmp_path.glob("sglang_kernel_trace_*.sgltrace"))
    tree = out.split(f"Trace file {trace_file}: 10 spans\n")[1]
    assert "  Req req-0003  [ERROR index out of range in self]\n" \
           "    sglang.custom_op.embedding arg0.shape=[1, 2]  [ERROR IndexError: index out of range in self]\n" in tree
    assert out.rstrip().endswith("Failed requests: req-0003")


def test_cli_rejects_unknown_command():
    proc = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2
    assert "invalid choice" in proc.stderr
