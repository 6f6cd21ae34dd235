"""`report --html`: one self-contained page, rendered by headless Chromium
(Debian's `chromium`, installed by `.ci/install --tests`)."""

import html
import json
import re
import shutil
import subprocess
import sys

from conftest import run_python
from test_report import DIES_IN_A_BATCH, cli


def _chromium(*args: str) -> subprocess.CompletedProcess:
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    assert browser, "Debian's chromium is needed (bash .ci/install --tests installs it)"
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


ONE_PROCESS = """
import os, sys, time, torch, sglang_otel_kernels as sok
trace, name, ending, cue = sys.argv[1:5]
sok.configure(level=5, log_dest="off", trace_file=trace)  # statistics: report lines wider than the window
# The crashing one, started first, waits for the other's cue, given as its last call ends: neither
# torch's import nor an interpreter's exit is on the time axis, however slow the machine.
while ending == "crash" and not os.path.exists(cue):
    time.sleep(0.01)
@sok.debug_kernel_api(op_name=name)
def kernel(x, note=None):
    time.sleep(0.3)  # wide enough on the page to carry its name
    if note == "die":
        os._exit(134)
    return x
kernel(torch.ones(2))
kernel(torch.ones(2), note="die" if ending == "crash" else None)
open(cue, "w").close()
"""

# Loads the report in a 1000-pixel frame and writes what its layout did
# into #out: how far anything scrolls sideways, and the bars' labels.
MEASURE = """<!DOCTYPE html><html><body>
<iframe id="page" src="report.html" style="width:1000px;height:800px;border:0"></iframe>
<pre id="out">not measured</pre>
<script>
document.getElementById('page').onload = () => {
  const page = document.getElementById('page').contentDocument;
  const boxes = [...page.querySelectorAll('pre, h2, p, #details, .in-flight-call, .track-name')];
  document.getElementById('out').textContent = JSON.stringify({
    page: page.documentElement.scrollWidth - page.documentElement.clientWidth,
    boxes: Math.max(...boxes.map(box => box.scrollWidth - box.clientWidth)),
    labels: [...page.querySelectorAll('text.label')].map(text => text.textContent),
  });
};
</script></body></html>"""


def test_the_page_wraps_its_text_names_wide_bars_and_lines_processes_up_on_one_axis(tmp_path):
    # Process b calls its kernel once a's last call has ended: the gap between
    # them, and so the axis, does not grow on a slow machine.
    go = tmp_path / "a-ended"
    b = subprocess.Popen([sys.executable, "-c", ONE_PROCESS, "b.sgltrace", "sglang.custom_op.embedding", "crash",
                          str(go)], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        a = subprocess.run([sys.executable, "-c", ONE_PROCESS, "a.sgltrace", "sglang.custom_op.rmsnorm", "exit",
                            str(go)], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    finally:
        go.touch()  # b is never left waiting
    _, b_err = b.communicate(timeout=120)
    assert a.returncode == 0, a.stderr
    assert b.returncode == 134, b_err
    page = tmp_path / "report.html"
    assert cli("report", str(tmp_path / "a.sgltrace"), str(tmp_path / "b.sgltrace"), "--html", str(page)).returncode == 1
    # One time axis: process b ran after process a ended, so its bars start right of a's.
    bars = {}
    for name, x, width in re.findall(r'data-name="([^"]+)" x="([\d.]+)%" y="3" width="([\d.]+)%"', page.read_text()):
        bars.setdefault(name, []).append((float(x), float(width)))
    a_end = max(x + w for x, w in bars["sglang.custom_op.rmsnorm"])
    assert a_end <= min(x for x, _ in bars["sglang.custom_op.embedding"]), bars
    measure = tmp_path / "measure.html"
    measure.write_text(MEASURE)
    dom = _chromium("--allow-file-access-from-files", "--window-size=1100,900", "--virtual-time-budget=5000",
                    "--dump-dom", measure.as_uri())
    assert dom.returncode == 0, dom.stderr
    measured = json.loads(html.unescape(re.search(r'<pre id="out">(.*?)</pre>', dom.stdout, re.S).group(1)))
    assert measured["page"] <= 0 and measured["boxes"] <= 0, measured  # nothing cut off behind a scroll bar
    # 0.3 s bars over a 1 s axis in a 1000-pixel frame: each carries its kernel's name, or its last part.
    assert {"sglang.custom_op.rmsnorm", "sglang.custom_op.embedding"} <= set(measured["labels"]) or \
        {"rmsnorm", "embedding"} <= set(measured["labels"]), measured
