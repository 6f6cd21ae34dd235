"""Whether a change of the code changed what `report` says: the text, the
JSON, the HTML page and the exit status of `report` over the same trace
files, run by the code of a git revision and by the working tree, side by
side (a restructuring must leave them identical).

    python bench/compare_reports.py REVISION [TRACE_FILE_OR_DIR ...]

Without files, every `*.sgltrace` the test suite left under pytest's
temporary directory (run the tests first); each is copied first, with what
lies beside it. The revision is checked out into
a temporary worktree and run from there with its compiled core built. Each
difference is printed with the file; the exit status is 1 when any. The
HTML page's generation time differs by nature and is left out of the
comparison.
"""

from __future__ import annotations

import argparse
import difflib
import glob
import os
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _outputs(root: str, path: str, scratch: str) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=root, SGLANG_KERNEL_API_LOGLEVEL="0")
    found = {}
    for name, args in (("text", []), ("json", ["--json"])):
        run = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", *args, path], cwd=root, env=env,
                             capture_output=True, text=True, timeout=300)
        found[name] = run.stdout
        found[f"{name} exit status"] = str(run.returncode)
    page = os.path.join(scratch, "page.html")
    run = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", "--html", page, path], cwd=root,
                         env=env, capture_output=True, text=True, timeout=300)
    found["html exit status"] = str(run.returncode)
    try:
        with open(page, encoding="utf-8", errors="replace") as handle:
            found["html"] = handle.read()
        os.unlink(page)
    except OSError:
        found["html"] = ""
    return found


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("revision")
    parser.add_argument("paths", nargs="*")
    options = parser.parse_args()
    paths = []
    for path in options.paths or [os.path.join(tempfile.gettempdir(), f"pytest-of-{os.environ.get('USER', 'root')}")]:
        paths += sorted(glob.glob(os.path.join(path, "**", "*.sgltrace"), recursive=True)) if os.path.isdir(path) \
            else [path]
    with tempfile.TemporaryDirectory() as scratch:
        # Copies, with what lies beside each (its traceback, its delivery ledger): pytest's own directories are
        # pruned while the tests run, and a file gone between the two runs would read as a difference.
        copies = []
        for number, path in enumerate(paths):
            folder = os.path.join(scratch, "files", str(number))
            os.makedirs(folder)
            for beside in glob.glob(glob.escape(path) + "*"):
                shutil.copy2(beside, folder)
            copies.append(os.path.join(folder, os.path.basename(path)))
        paths = [path for path in copies if os.path.exists(path)]
        before = os.path.join(scratch, "before")
        subprocess.run(["git", "worktree", "add", "--detach", before, options.revision], cwd=ROOT, check=True,
                       capture_output=True)
        try:
            subprocess.run([sys.executable, "setup.py", "build_ext", "--inplace"], cwd=before, check=True,
                           capture_output=True)
            differing = 0
            for path in paths:
                old, new = _outputs(before, path, scratch), _outputs(ROOT, path, scratch)
                for key in old:
                    if old[key] != new[key]:
                        differing += 1
                        print(f"{path}: {key} differs")
                        print("".join(list(difflib.unified_diff(old[key].splitlines(True), new[key].splitlines(True),
                                                                "before", "after", n=1))[:40]))
            print(f"{len(paths)} trace files, {differing} outputs differ (text, JSON, HTML and their exit statuses)")
            return 1 if differing else 0
        finally:
            subprocess.run(["git", "worktree", "remove", "--force", before], cwd=ROOT, capture_output=True)


if __name__ == "__main__":
    sys.exit(main())
