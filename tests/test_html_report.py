"""`report --html`: one self-contained page, rendered by headless Chromium
(Debian's `chromium`, installed by .ci/install)."""

import shutil
import subprocess

from conftest import run_python
from test_report import DIES_IN_A_BATCH, cli


def _chromium(*args: str) -> subprocess.CompletedProcess:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Debian's chromium is needed (bash .ci/install installs it)"
    return subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", *args],
                          capture_output=True, text=True, timeout=120)


def test_html_report_renders_the_crash_in_headless_chromium(tmp_path):
    proc = run_python(DIES_IN_A_BATCH.replace("sys.argv[1]", "'crash'"), tmp_path)
    assert proc.returncode == 134, proc.stderr
    page = tmp_path / "report.html"
    made = cli("report", str(tmp_path / "t.sgltrace"), "--html", str(page))
    assert made.returncode == 1, made.stderr  # the crash: report's exit status, whatever the format
    text = page.read_text()
    assert "http://" not in text and "https://" not in text and "src=" not in text  # nothing fetched
    dom = _chromium("--dump-dom", page.as_uri())
    assert dom.returncode == 0, dom.stderr
    [crash] = [part for part in dom.stdout.split('<div class="in-flight-call">')[1:]]
    assert crash.startswith("In flight when the process ended:\n  sglang.custom_op.embedding")
    assert "batch decode_batch: requests req-1, req-2" in crash
    assert 'class="call in-flight" data-call' in dom.stdout and 'class="call nonfinite"' in dom.stdout
    shot = tmp_path / "report.png"
    taken = _chromium("--window-size=1000,600", f"--screenshot={shot}", page.as_uri())
    assert taken.returncode == 0, taken.stderr
    assert shot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and shot.stat().st_size > 10_000


def test_hostile_names_are_escaped(tmp_path):
    proc = run_python("import os, torch, sglang_otel_kernels as sok\n"
                      "sok.configure(level=3, log_dest='off', trace_file='t.sgltrace')\n"
                      "sok.debug_kernel_api(op_name='</script><script>alert(1)</script>')(lambda x: os._exit(3))"
                      "(torch.ones(1))\n", tmp_path)
    assert proc.returncode == 3, proc.stderr
    page = tmp_path / "report.html"
    assert cli("report", str(tmp_path / "t.sgltrace"), "--html", str(page)).returncode == 1
    text = page.read_text()
    assert "<script>alert(1)" not in text and "&lt;/script&gt;&lt;script&gt;alert(1)" in text
