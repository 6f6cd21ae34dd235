"""The command line as a new user meets it: each command's --help, the
argument names, and what `run` says when it will record nothing."""

import json
import os
import subprocess
import sys

import pytest

from conftest import clean_env, run_python

COMMANDS = ("demo", "report", "replay", "export", "rerun", "follow", "watch", "run")


def cli(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize("command", COMMANDS)
def test_each_commands_help_opens_with_what_it_does_and_lists_its_exit_codes(command):
    proc = cli(command, "--help")
    assert proc.returncode == 0, proc.stderr
    after_usage = proc.stdout.split("\n\n")[1]  # the paragraph after the usage lines
    first = after_usage.split(". ")[0].split(".\n")[0]
    assert first[0].isupper() and first.split()[0].endswith("s"), after_usage  # "Prints ...", "Runs ..."
    exits = proc.stdout.split("Exit status: ")[1]
    assert "2 bad usage" in exits
    if command not in ("run",):
        assert exits.startswith("0 ")


def test_arguments_say_file_or_path_as_they_take_a_directory_or_not():
    usage = {command: cli(command, "--help").stdout.split("\n\n")[0] for command in COMMANDS}
    for command in ("replay", "export", "watch"):
        assert "PATH [PATH ...]" in usage[command], usage[command]
    assert "[PATH ...]" in usage["report"]  # paths, or --jaeger, or both
    assert usage["follow"].rstrip().endswith("FILE")


def test_export_accepts_a_directory_like_report(tmp_path):
    script = ("import sglang_otel_kernels as sok\n"
              "sok.configure(level=1, log_dest='off', trace_file='t_%i.sgltrace')\n"
              "sok.debug_kernel_api(op_name='one')(lambda: None)()\n")
    for _ in range(2):
        assert run_python(script, tmp_path).returncode == 0
    proc = cli("export", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    pids = set()
    for line in proc.stdout.splitlines():
        for resource in json.loads(line)["resourceSpans"]:
            attributes = {a["key"]: a["value"] for a in resource["resource"]["attributes"]}
            pids.add(attributes["process.pid"]["intValue"])
    assert len(pids) == 2  # both files of the directory
    timeline = cli("export", str(tmp_path), "--format", "chrome")
    assert timeline.returncode == 0 and len({e["pid"] for e in json.loads(timeline.stdout)["traceEvents"]}) >= 2


def test_run_without_a_level_says_it_records_nothing(tmp_path):
    env = clean_env()
    quiet = cli("run", "--", sys.executable, "-c", "print('app ran')", cwd=tmp_path, env=env)
    assert quiet.returncode == 0 and quiet.stdout == "app ran\n"
    assert "the level is 0" in quiet.stderr and "--level 1" in quiet.stderr
    assert len(quiet.stderr.strip().splitlines()) == 1
    recorded = cli("run", "--level", "1", "--", sys.executable, "-c", "print('app ran')", cwd=tmp_path, env=env)
    assert recorded.returncode == 0 and "the level is 0" not in recorded.stderr


def test_ci_runs_exactly_the_readmes_test_command_and_the_main_job_needs_no_test_tooling():
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    readme = open(os.path.join(root, "README.md")).read()
    main_job = readme.split("no collector\nneeded):\n\n```sh\n")[1].splitlines()[0].strip()
    tests = readme.split("Tests (the command CI runs;")[1].split("```sh\n")[1].splitlines()[0].strip()
    assert main_job == "bash .ci/install && .venv/bin/python -m sglang_otel_kernels demo"
    assert open(os.path.join(root, ".ci", "run")).read().rstrip().splitlines()[-1] == tests
    install = open(os.path.join(root, ".ci", "install")).read()
    light = [line for line in install.split('[ "$tests" = 1 ] || exit 0')[0].splitlines()  # what the main job runs
             if not line.lstrip().startswith("#")]
    assert not [line for line in light if "chromium" in line or ".ci/backends" in line] and "--tests" in tests
