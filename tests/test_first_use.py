"""What a new user trips over (issue 16): each defect as a real run."""

import importlib.metadata
import os
import shutil
import subprocess
import sys
import textwrap

import sglang_otel_kernels as sok
from conftest import clean_env, run_python
from otlp_receivers import GrpcReceiver

CLI = os.path.join(os.path.dirname(sys.executable), "sglang-otel-kernels")  # the installed console script


def test_a_trace_file_size_below_the_minimum_says_so_and_uses_the_minimum(tmp_path):
    proc = run_python("import sglang_otel_kernels as sok, torch\n"
                      "sok.debug_kernel_api(op_name='k')(lambda x: x)(torch.ones(1))\n"
                      "print(sok.trace_file_path())",
                      tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                                 "SGLANG_KERNEL_API_TRACEFILE_SIZE": "1K"})
    assert proc.returncode == 0, proc.stderr
    assert "SGLANG_KERNEL_API_TRACEFILE_SIZE='1K' is below the minimum, 64K (65536 bytes): using 64K" in proc.stderr
    assert "cannot parse" not in proc.stderr
    assert os.path.getsize(proc.stdout.split()[-1]) <= 128 * 1024  # a 64 KiB ring and its header, not the 16 MiB default


def test_a_clean_exit_leaves_no_empty_traceback_and_a_crash_keeps_it(tmp_path):
    script = ("import os, sys, ctypes, torch, sglang_otel_kernels as sok\n"
              "sok.debug_kernel_api(op_name='k')(lambda x: x)(torch.ones(1))\n"
              "if sys.argv[-1] == 'crash': ctypes.string_at(0)\n")
    settings = {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                "SGLANG_KERNEL_API_TRACEFILE": "t_%i.sgltrace"}
    clean = run_python(script, tmp_path, settings)
    assert clean.returncode == 0, clean.stderr
    assert [name for name in os.listdir(tmp_path) if name.endswith(".traceback")] == []
    assert len([name for name in os.listdir(tmp_path) if name.endswith(".sgltrace")]) == 1
    crash = run_python(script.replace("sys.argv[-1]", "'crash'"), tmp_path, settings)
    assert crash.returncode == -11
    [traceback] = [name for name in os.listdir(tmp_path) if name.endswith(".traceback")]
    assert "Segmentation fault" in (tmp_path / traceback).read_text()


def test_rerun_function_finds_a_module_in_the_working_directory(tmp_path):
    (tmp_path / "mykernels.py").write_text("def scale(x, factor):\n    return x * factor\n")
    proc = run_python("import torch, sglang_otel_kernels as sok\n"
                      "import mykernels\n"
                      "sok.debug_kernel_api(mykernels.scale)(torch.ones(3), 2.0)\n",
                      tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
                                 "SGLANG_KERNEL_API_DUMP_DIR": "dumps", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    [dump] = [os.path.join(root, d) for root, dirs, _ in os.walk(tmp_path / "dumps") for d in dirs
              if os.path.exists(os.path.join(root, d, "metadata.json"))]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    rerun = subprocess.run([CLI, "rerun", dump, "--function", "mykernels:scale"], cwd=tmp_path, env=env,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert "reproduced" in rerun.stdout


def test_follow_without_pid_ends_when_the_writer_ends_and_prints_a_summary(tmp_path):
    receiver = GrpcReceiver()
    try:
        writer = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent("""
                import time, torch, sglang_otel_kernels as sok
                k = sok.debug_kernel_api(op_name="k")(lambda x: x)
                for _ in range(3):
                    k(torch.ones(1))
                time.sleep(2)
            """)], cwd=tmp_path, text=True,
            env={**clean_env(),
                 "SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                 "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace"})
        follow = subprocess.run([CLI, "follow", "t.sgltrace", "--endpoint", receiver.endpoint, "--interval", "0.1"],
                                cwd=tmp_path, capture_output=True, text=True, timeout=60)
        writer.wait(timeout=30)
        assert follow.returncode == 0, follow.stderr
        assert "followed t.sgltrace until its writer ended: 3 spans sent" in follow.stdout
        assert follow.stderr == ""
        receiver.wait_for(lambda got: len(got) == 3)
    finally:
        receiver.stop()


def test_report_rounds_statistics_and_version_is_printed(tmp_path):
    proc = run_python("import torch, sglang_otel_kernels as sok\n"
                      "sok.debug_kernel_api(op_name='k')(lambda x: 1 / 0)(torch.tensor([0.1, 0.2, 0.4]))\n",
                      tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "5", "SGLANG_KERNEL_API_LOGDEST": "off",
                                 "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace"})
    assert "ZeroDivisionError" in proc.stderr
    report = subprocess.run([CLI, "report", "t.sgltrace"], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert "min=0.1, max=0.4, mean=0.233333," in report.stdout, report.stdout
    version = subprocess.run([CLI, "--version"], capture_output=True, text=True, timeout=60)
    from sglang_otel_kernels.record import core
    from sglang_otel_kernels.record.tracefile import FORMAT_VERSION
    from sglang_otel_kernels.recover.report import REPORT_SCHEMA

    # The version, and what this build writes and reads: two builds that read different files differ here.
    assert version.returncode == 0 and version.stdout.splitlines() == [
        f"sglang-otel-kernels {sok.__version__}", f"trace file format: writes {FORMAT_VERSION}, reads 2, 3, 4, 5",
        f"report --json schema: {REPORT_SCHEMA}", f"recording core: {core.describe()}"]
    assert importlib.metadata.version("sglang-otel-kernels") == sok.__version__  # what pip installed says the same
    assert shutil.which(CLI)


def test_old_uneventful_trace_files_are_pruned_and_evidence_is_kept(tmp_path):
    from sglang_otel_kernels.record.retention import prune

    script = ("import os, sys, time, torch, sglang_otel_kernels as sok\n"
              "k = sok.debug_kernel_api(op_name='k')(lambda x, fail: 1 / 0 if fail else x)\n"
              "k(torch.ones(1), False)\n"
              "if MODE == 'fail':\n"
              "    try: k(torch.ones(1), True)\n"
              "    except ZeroDivisionError: pass\n"
              "if MODE == 'crash': sok.debug_kernel_api(op_name='dies')(lambda: os._exit(3))()\n"
              "time.sleep(float(os.environ.get('STAY', '0')))\n")
    settings = {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off",
                "SGLANG_KERNEL_API_TRACEFILE": "t_%i.sgltrace", "SGLANG_KERNEL_API_TRACEFILE_KEEP": "0"}
    made = {}
    for mode in ("clean", "fail", "crash"):
        before = set(os.listdir(tmp_path))
        run_python(f"MODE = {mode!r}\n" + script, tmp_path, settings)
        [made[mode]] = [name for name in set(os.listdir(tmp_path)) - before if name.endswith(".sgltrace")]
    # Twelve older clean runs, the failure and the crash oldest of all.
    for index in range(12):
        shutil.copy(tmp_path / made["clean"], tmp_path / f"t_{900000 + index}.sgltrace")
        os.utime(tmp_path / f"t_{900000 + index}.sgltrace", (1000 + index, 1000 + index))
        (tmp_path / f"t_{900000 + index}.sgltrace.delivered").write_bytes(b"its export sidecar's list")
    for age, mode in enumerate(("fail", "crash")):
        os.utime(tmp_path / made[mode], (10 + age, 10 + age))
    os.utime(tmp_path / made["clean"], (5000, 5000))
    removed = prune(str(tmp_path / "t_%i.sgltrace"), own=str(tmp_path / "t_1.sgltrace"), keep=5)
    left = sorted(name for name in os.listdir(tmp_path) if name.endswith(".sgltrace"))
    # The newest five stay; beyond them only the uneventful files went.
    assert len(removed) == 8 and made["fail"] in left and made["crash"] in left
    assert len(left) == 5 + 2
    # A removed file's list of delivered spans goes with it; a kept one's stays.
    assert sorted(name[: -len(".delivered")] for name in os.listdir(tmp_path) if name.endswith(".delivered")) == \
        sorted(name for name in left if name.startswith("t_9000"))
    # Wired to the start of a run: SGLANG_KERNEL_API_TRACEFILE_KEEP=2 leaves the newest two of the others.
    proc = run_python("MODE = 'clean'\n" + script, tmp_path,
                      dict(settings, SGLANG_KERNEL_API_TRACEFILE_KEEP="2", STAY="2"))
    assert proc.returncode == 0, proc.stderr
    left = sorted(name for name in os.listdir(tmp_path) if name.endswith(".sgltrace"))
    assert len(left) == 1 + 2 + 2 and made["fail"] in left and made["crash"] in left
