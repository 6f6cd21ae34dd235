"""Level 10: input dumps written before the call, linked to its span, limits,
filters, crash survival, and `sglang-otel-kernels rerun`."""

import json
import os
import random
import signal
import re
import stat
import subprocess
import sys

import pytest
import torch

import dump_kernels
import sglang_otel_kernels as sok
from conftest import clean_env, run_python
from sglang_otel_kernels.__main__ import main as cli

K = "sglang.kernel."
TESTS = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture
def dumping(record, tmp_path):
    """`dumping(**settings)` turns level 10 on into tmp_path/dumps, spans into
    memory; returns (decorated kernels, exporter)."""

    def setup(log_dest: str = "off", **settings):
        exporter = record(level=10, log_dest=log_dest)
        sok.configure(dump_dir=str(tmp_path / "dumps"), **settings)
        return dump_kernels.decorate_all(), exporter

    return setup


def dump_dirs(tmp_path) -> list:
    root = tmp_path / "dumps"
    return sorted(root.iterdir(), key=lambda p: p.name) if root.exists() else []


def metadata(directory) -> dict:
    return json.loads((directory / "metadata.json").read_text())


def test_a_completed_call_leaves_inputs_outputs_and_metadata_linked_to_its_span(dumping, tmp_path):
    kernels, exporter = dumping(log_dest=str(tmp_path / "log.txt"))
    x = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    result = kernels["scale"](x, 2.0, dtype=torch.float64, bias=None)
    assert torch.equal(result, (x * 2).double())
    [directory] = dump_dirs(tmp_path)
    assert re.fullmatch(rf"\d{{8}}_\d{{6}}_\d{{3}}_pid{os.getpid()}_test\.scale_call0001", directory.name)
    assert sorted(p.name for p in directory.iterdir()) == ["inputs.pt", "metadata.json", "outputs.pt"]
    meta = metadata(directory)
    assert meta["function_name"] == "test.scale" and meta["process_id"] == os.getpid()
    assert meta["execution_status"] == "completed"
    assert meta["input_tensor_keys"] == ["arg_0"] and meta["output_tensor_keys"] == ["result"]
    assert meta["input_metadata"] == {"arg_1": 2.0, "kwarg_dtype": {"type": "torch.dtype", "value": "torch.float64"},
                                      "kwarg_bias": None}
    assert meta["function"] == "dump_kernels:scale"
    assert torch.equal(torch.load(directory / "inputs.pt")["arg_0"], x)
    assert torch.equal(torch.load(directory / "outputs.pt")["result"], result)
    [span] = exporter.get_finished_spans()
    assert span.attributes[K + "dump_dir"] == str(directory)
    context = span.get_span_context()
    assert meta["span_id"] == f"{context.span_id:016x}" and meta["trace_id"] == f"{context.trace_id:032x}"
    log = (tmp_path / "log.txt").read_text()
    assert f"Dumped inputs to: {directory}\n" in log and f"Dumped outputs to: {directory}\n" in log
    # SGLang's order: arguments, the input dump, (the call), the output dump, the output section.
    assert log.index("Keyword input arguments:") < log.index("Dumped inputs") < log.index("Dumped outputs") \
        < log.index("Output:")
    assert not list(directory.glob("*.tmp*"))


def test_directories_and_files_are_private_whatever_the_umask(tmp_path):
    script = (
        "import os, torch, sglang_otel_kernels as sok\n"
        "os.umask(0)\n"
        "k = sok.debug_kernel_api(op_name='k')(lambda x: x + 1)\n"
        "k(torch.ones(3))\n"
    )
    proc = run_python(script, tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
                                         "SGLANG_KERNEL_API_TRACEFILE": "off", "SGLANG_KERNEL_API_DUMP_DIR": "d_%i"})
    assert proc.returncode == 0, proc.stderr
    [root] = tmp_path.glob("d_*")  # %i became the pid
    assert re.fullmatch(r"d_\d+", root.name)
    assert stat.S_IMODE(root.stat().st_mode) == 0o700
    [call] = root.iterdir()
    assert stat.S_IMODE(call.stat().st_mode) == 0o700
    for name in ("inputs.pt", "metadata.json", "outputs.pt"):
        assert stat.S_IMODE((call / name).stat().st_mode) == 0o600
    # One warning that the dumps hold tensor data, naming where.
    assert proc.stderr.count("may hold sensitive data") == 1 and str(root) in proc.stderr


def test_a_raising_kernel_is_marked_exception_and_the_error_still_reaches_the_caller(dumping, tmp_path):
    kernels, exporter = dumping()
    with pytest.raises(IndexError, match="out of range"):
        kernels["gather"](torch.ones(4, 2), torch.tensor([1, 9]))
    [directory] = dump_dirs(tmp_path)
    meta = metadata(directory)
    assert meta["execution_status"] == "exception"
    assert meta["exception"] == {"type": "IndexError", "message": "index 9 out of range for 4 rows"}
    assert not (directory / "outputs.pt").exists()
    [span] = exporter.get_finished_spans()
    assert span.attributes[K + "dump_dir"] == str(directory) and not span.status.is_ok


@pytest.mark.parametrize("how", ["sigkill", "exit"])
def test_a_process_killed_inside_the_kernel_leaves_its_inputs_and_the_span_points_at_them(tmp_path, how):
    rng = random.Random(how)
    for trial in range(4):
        die_at = rng.randrange(1, 6)
        workdir = tmp_path / f"trial{trial}"
        workdir.mkdir()
        script = (
            "import torch, sglang_otel_kernels as sok, dump_kernels\n"
            "die = dump_kernels.decorate_all()['die']\n"
            f"for call in range(1, 7):\n"
            f"    die(torch.full((3,), float(call)), 'sigkill' if call == {die_at} and '{how}' == 'sigkill' else\n"
            f"        'exit' if call == {die_at} else 'live')\n"
        )
        proc = run_python(script, workdir, {
            "PYTHONPATH": TESTS, "SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
            "SGLANG_KERNEL_API_TRACEFILE": "trace.sgltrace", "SGLANG_KERNEL_API_DUMP_DIR": "dumps"})
        assert proc.returncode == (-9 if how == "sigkill" else 7), proc.stderr
        calls = sorted((workdir / "dumps").iterdir(), key=lambda p: p.name)
        assert len(calls) == die_at
        for number, directory in enumerate(calls, start=1):
            meta = metadata(directory)
            assert torch.equal(torch.load(directory / "inputs.pt")["arg_0"], torch.full((3,), float(number)))
            assert meta["execution_status"] == ("inputs_saved" if number == die_at else "completed")
        spans = sok.read_trace(workdir / "trace.sgltrace")
        assert [s.attributes[K + "dump_dir"] for s in spans] == [str(p) for p in calls]
        assert [s.in_flight for s in spans] == [False] * (die_at - 1) + [True]
        assert not list((workdir / "dumps").glob("*/*.tmp*"))
    # The crash report leads from the call in flight to its dump.
    report = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "report", str(workdir / "trace.sgltrace")],
                            capture_output=True, text=True, timeout=120)
    assert report.returncode == 1, report.stderr
    assert f"inputs dumped to {calls[-1]}  (sglang-otel-kernels rerun DIR)" in report.stdout


def test_count_limit_stops_dumping_with_one_warning_and_the_reason_on_each_span(dumping, tmp_path, capsys):
    kernels, exporter = dumping(dump_max_count=2)
    for _ in range(4):
        kernels["scale"](torch.ones(2), 1.0)
    assert len(dump_dirs(tmp_path)) == 2
    spans = exporter.get_finished_spans()
    assert [K + "dump_dir" in s.attributes for s in spans] == [True, True, False, False]
    assert [s.attributes.get(K + "dump_skipped") for s in spans[2:]] == \
        ["SGLANG_KERNEL_API_DUMP_MAX_COUNT=2 reached"] * 2
    assert capsys.readouterr().err.count("level-10 dumps stopped") == 1


def test_size_limit_stops_dumping_before_the_call_that_would_pass_it(dumping, tmp_path):
    kernels, exporter = dumping(dump_max_bytes=1000)
    kernels["scale"](torch.ones(100), 1.0)  # 400 bytes
    kernels["scale"](torch.ones(100), 1.0)  # 800
    kernels["scale"](torch.ones(100), 1.0)  # would be 1200: not dumped, and none after it
    kernels["scale"](torch.ones(1), 1.0)
    assert len(dump_dirs(tmp_path)) == 2
    reasons = [s.attributes.get(K + "dump_skipped") for s in exporter.get_finished_spans()]
    assert reasons[:2] == [None, None]
    assert reasons[2].startswith("SGLANG_KERNEL_API_DUMP_MAX_BYTES=1000 reached (800 bytes dumped, this call needs 400")
    assert reasons[3] == reasons[2]


def test_include_and_exclude_patterns_choose_what_is_dumped(dumping, tmp_path):
    kernels, exporter = dumping(dump_include=["test.s*", "test.n*"], dump_exclude=["*nested"])
    kernels["scale"](torch.ones(2), 1.0)
    kernels["nested"]([torch.ones(2)], {"weight": 1.0, "dtype": torch.float32})
    kernels["gather"](torch.ones(2, 2), torch.tensor([0]))
    assert [metadata(d)["function_name"] for d in dump_dirs(tmp_path)] == ["test.scale"]
    # Filtered calls are not "skipped": they carry no dump attribute at all.
    assert [sorted(k for k in s.attributes if "dump" in k) for s in exporter.get_finished_spans()] == \
        [[K + "dump_dir"], [], []]


def test_an_unwritable_dump_directory_warns_once_and_calls_go_on(dumping, tmp_path, capsys):
    blocker = tmp_path / "dumps"
    blocker.write_text("a file where the directory should be")
    kernels, exporter = dumping()
    for _ in range(3):
        assert torch.equal(kernels["scale"](torch.ones(2), 3.0), torch.full((2,), 3.0))
    reasons = [s.attributes.get(K + "dump_skipped") for s in exporter.get_finished_spans()]
    assert all(r and r.startswith("dump failed (FileExistsError") for r in reasons)
    assert capsys.readouterr().err.count("dump failed") == 1


def test_a_meta_tensor_argument_is_described_and_the_rest_dumped(dumping, tmp_path):
    kernels, _ = dumping()
    kernels["nested"]([torch.ones(2), torch.empty(3, device="meta")], {"weight": 1.0, "dtype": torch.float32})
    [directory] = dump_dirs(tmp_path)
    meta = metadata(directory)
    assert meta["input_tensor_keys"] == ["arg_0_0"]
    assert meta["input_metadata"]["arg_0_1"] == {"type": "Tensor", "repr": "meta tensor shape=(3,) dtype=torch.float32"}
    assert meta["execution_status"] == "completed"


def test_no_dump_while_compiling(dumping, tmp_path):
    kernels, _ = dumping()
    scale = kernels["scale"]
    compiled = torch.compile(lambda x: scale(x, 2.0) + 1, fullgraph=True, backend="eager")
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 3.0))
    assert dump_dirs(tmp_path) == []


# -- rerun --------------------------------------------------------------------


def test_rerun_reports_a_match_for_a_good_call(dumping, tmp_path, capsys):
    kernels, _ = dumping()
    kernels["scale"](torch.randn(4, 8), 0.5, bias=torch.randn(8))
    [directory] = dump_dirs(tmp_path)
    assert cli(["rerun", str(directory), "--function", "dump_kernels:scale"]) == 0
    out = capsys.readouterr().out
    assert "re-run:    completed" in out and "result: [4, 8] torch.float32" in out
    assert "max_abs_diff=0 max_rel_diff=0 match" in out
    assert "verdict:   reproduced: the outputs match the saved ones" in out


def test_rerun_reports_how_far_outputs_moved(dumping, tmp_path, capsys):
    kernels, _ = dumping()
    kernels["scale"](torch.ones(3), 2.0)
    [directory] = dump_dirs(tmp_path)
    assert cli(["rerun", str(directory), "--function", "dump_kernels:scale_wrong", "--json"]) == 1
    report = json.loads(capsys.readouterr().out)
    [entry] = report["outputs"]
    assert entry["match"] is False and entry["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3)
    assert entry["max_rel_diff"] == pytest.approx(5e-4, rel=1e-3)
    assert report["verdict"].startswith("differs: result: values differ")
    # A looser tolerance accepts it.
    assert cli(["rerun", str(directory), "--function", "dump_kernels:scale_wrong", "--atol", "0.01"]) == 0


def test_rerun_reproduces_the_failure_of_a_failing_call(dumping, tmp_path, capsys):
    kernels, _ = dumping()
    with pytest.raises(IndexError):
        kernels["gather"](torch.ones(4, 2), torch.tensor([1, 9]))
    [directory] = dump_dirs(tmp_path)
    assert cli(["rerun", str(directory), "--function", "dump_kernels:gather"]) == 0
    out = capsys.readouterr().out
    assert "recorded:  exception IndexError: index 9 out of range for 4 rows" in out
    assert "re-run:    raised IndexError: index 9 out of range for 4 rows" in out
    assert "verdict:   reproduced: raised the recorded IndexError" in out
    # The same inputs through a fixed kernel: the difference is the verdict.
    assert cli(["rerun", str(directory), "--function", "dump_kernels:gather_clamped"]) == 1
    assert "verdict:   differs: completed, the dump recorded IndexError" in capsys.readouterr().out


def test_rerun_rebuilds_nested_arguments_dtypes_and_keywords(dumping, tmp_path, capsys):
    kernels, _ = dumping()
    kernels["nested"]([torch.ones(2), torch.full((3,), 2.0)], {"weight": 0.5, "dtype": torch.bfloat16},
                      scales=(3.0,))
    [directory] = dump_dirs(tmp_path)
    meta = metadata(directory)
    assert meta["input_metadata"]["arg_1__container"] == {"type": "dict", "keys": ["weight", "dtype"]}
    assert cli(["rerun", str(directory), "--function", meta["function"], "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [e["key"] for e in report["outputs"]] == ["result_total", "result_parts_0", "result_parts_1"]
    assert report["reproduced"] is True


def test_rerun_of_a_call_that_killed_its_process_runs_it_again(tmp_path):
    script = (
        "import torch, dump_kernels\n"
        "dump_kernels.decorate_all()['gather'](torch.ones(4, 2), torch.tensor([1, 9]))\n"
    )
    proc = run_python(script, tmp_path, {
        "PYTHONPATH": TESTS, "DUMP_KERNELS_DIE": "1", "SGLANG_KERNEL_API_LOGLEVEL": "10",
        "SGLANG_KERNEL_API_LOGDEST": "off", "SGLANG_KERNEL_API_TRACEFILE": "off", "SGLANG_KERNEL_API_DUMP_DIR": "dumps"})
    assert proc.returncode == 3, proc.stderr
    [directory] = (tmp_path / "dumps").iterdir()
    assert metadata(directory)["execution_status"] == "inputs_saved"
    env = {k: v for k, v in os.environ.items() if k != "DUMP_KERNELS_DIE"}
    rerun = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "rerun", str(directory),
                            "--function", "dump_kernels:gather"],
                           env={**env, "PYTHONPATH": TESTS}, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 0, rerun.stderr
    assert "recorded:  inputs_saved (the process ended during the call)" in rerun.stdout
    assert "re-run:    raised IndexError: index 9 out of range for 4 rows" in rerun.stdout
    assert "verdict:   reproduced a failure: raised IndexError" in rerun.stdout


@pytest.mark.parametrize("how, signal_name", [("abort", "SIGABRT"), ("segv", "SIGSEGV")])
def test_rerun_of_a_call_that_kills_the_rerun_survives_it_and_says_so(tmp_path, how, signal_name):
    script = (
        "import torch, dump_kernels\n"
        "dump_kernels.decorate_all()['gather'](torch.ones(4, 2), torch.tensor([1, 9]))\n"
    )
    env = {"PYTHONPATH": TESTS, "DUMP_KERNELS_DIE": how, "SGLANG_KERNEL_API_LOGLEVEL": "10",
           "SGLANG_KERNEL_API_LOGDEST": "off", "SGLANG_KERNEL_API_TRACEFILE": "off", "SGLANG_KERNEL_API_DUMP_DIR": "dumps"}
    assert run_python(script, tmp_path, env).returncode == -getattr(signal, signal_name)
    [directory] = (tmp_path / "dumps").iterdir()
    rerun = subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "rerun", str(directory),
                            "--function", "dump_kernels:gather"],
                           env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 1, rerun.stderr
    lines = rerun.stdout.splitlines()
    assert lines[0] == f"dump:      {directory}"  # the header, printed before the call ran
    assert "recorded:  inputs_saved (the process ended during the call)" in lines
    assert f"re-run:    the process died ({signal_name}); its stderr ended with:" in lines
    assert any("Fatal Python error" in line and line.startswith("  | ") for line in lines)  # the child's stderr tail
    assert lines[-1] == f"verdict:   reproduced: the call died with {signal_name}"


def test_rerun_of_a_script_function_suggests_a_name_that_works_and_skips_what_the_script_does(tmp_path):
    script = tmp_path / "my_script.py"
    script.write_text(
        "import torch\n"
        "import sglang_otel_kernels as sok\n"
        "SCALE = 2.0\n"
        "@sok.debug_kernel_api\n"
        "def gather(table, index):\n"
        "    return table[index] * SCALE\n"
        "print('top level ran')\n"
        "gather(torch.ones(4, 2), torch.tensor([1, 3]))\n"
        "if __name__ == '__main__':\n"
        "    print('main block ran')\n"
    )
    env = clean_env()
    env.update({"SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
                "SGLANG_KERNEL_API_TRACEFILE": "off", "SGLANG_KERNEL_API_DUMP_DIR": "dumps"})
    ran = subprocess.run([sys.executable, "my_script.py"], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120)
    assert ran.returncode == 0 and "main block ran" in ran.stdout, ran.stderr
    [directory] = (tmp_path / "dumps").iterdir()

    def rerun(*args):
        return subprocess.run([sys.executable, "-m", "sglang_otel_kernels", "rerun", str(directory), *args],
                              cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)

    refused = rerun()
    assert refused.returncode == 2
    suggested = re.search(r"--function (\S+)$", refused.stderr.strip()).group(1)
    assert suggested == "my_script.py:gather"
    done = rerun("--function", suggested)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "verdict:   reproduced: the outputs match the saved ones" in done.stdout
    assert "top level ran" not in done.stdout and "main block ran" not in done.stdout
    assert len(list((tmp_path / "dumps").iterdir())) == 1  # the script's own call did not run again


def test_rerun_finds_a_torch_builtin(record, tmp_path, capsys):
    record(level=10)
    sok.configure(dump_dir=str(tmp_path / "dumps"))
    sok.debug_kernel_api(op_name="mul")(torch.mul)(torch.arange(4.0), 2.0)
    [directory] = dump_dirs(tmp_path)
    assert metadata(directory)["function"] == "torch:mul"  # not torch:_VariableFunctionsClass.mul
    assert cli(["rerun", str(directory), "--function", "torch:mul"]) == 0
    assert "verdict:   reproduced: the outputs match" in capsys.readouterr().out


def test_rerun_gives_clear_errors(dumping, tmp_path, capsys):
    kernels, _ = dumping()
    kernels["scale"](torch.ones(2), 1.0)
    [directory] = dump_dirs(tmp_path)

    def error(*args) -> str:
        assert cli(["rerun", *args]) == 2
        return capsys.readouterr().err.strip()

    assert error(str(tmp_path / "nope")).endswith("no such dump directory")
    assert "cannot import no_such_module" in error(str(directory), "--function", "no_such_module:f")
    assert "dump_kernels has no missing" in error(str(directory), "--function", "dump_kernels:missing")
    assert "expected module:qualname" in error(str(directory), "--function", "scale")
    (directory / "inputs.pt").unlink()
    assert "incomplete dump, inputs.pt is missing" in error(str(directory))
    (directory / "metadata.json").unlink()
    assert "incomplete dump, no metadata.json" in error(str(directory))
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "metadata.json").write_text("{not json")
    assert "metadata.json cannot be read" in error(str(broken))


def test_rerun_of_a_method_call_needs_a_function(dumping, tmp_path, capsys):
    dumping()
    layer = dump_kernels.Layer()
    sok.wrap_method_with_debug_kernel_once(layer, "apply", op_name="test.layer.apply")
    layer.apply(torch.ones(2))
    [directory] = dump_dirs(tmp_path)
    assert metadata(directory)["self_skipped"] is True
    assert cli(["rerun", str(directory)]) == 2
    assert "called as a method and its object was not saved" in capsys.readouterr().err
    assert cli(["rerun", str(directory), "--function", "dump_kernels:double"]) == 0
    assert "verdict:   reproduced" in capsys.readouterr().out


def test_no_dump_while_a_cuda_graph_is_captured(dumping, tmp_path, monkeypatch):
    # No GPU here: the capture probe SGLang uses is made to say yes.
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kernels, exporter = dumping(log_dest=str(tmp_path / "log.txt"))
    kernels["scale"](torch.ones(2), 1.0)
    assert dump_dirs(tmp_path) == []
    [span] = exporter.get_finished_spans()
    assert span.attributes[K + "dump_skipped"] == "graph capture in progress"
    assert "Tensor dump skipped: CUDA graph capture in progress\n" in (tmp_path / "log.txt").read_text()
