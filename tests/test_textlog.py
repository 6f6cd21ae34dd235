"""The text log is SGLang's, line for line (timestamps aside)."""

from pathlib import Path

import pytest
import torch
from conftest import run_python, strip_timestamps

import golden_scenario
import sglang_otel_kernels as sok

GOLDEN = Path(__file__).parent / "golden"


@pytest.mark.parametrize("level", [1, 3, 5])
def test_file_destination_matches_golden(tmp_path, level):
    log = tmp_path / "kernels.log"
    sok.configure(level=level, log_dest=str(log), spans=False)
    golden_scenario.run(sok.debug_kernel_api)
    assert strip_timestamps(log.read_text()) == (GOLDEN / f"level{level}.log").read_text()


@pytest.mark.parametrize("level", [1, 5])
def test_stdout_destination_matches_golden(capsys, level):
    sok.configure(level=level, log_dest="stdout", spans=False)
    golden_scenario.run(sok.debug_kernel_api)
    out = capsys.readouterr().out
    assert strip_timestamps(out) == (GOLDEN / f"level{level}.log").read_text()


def test_stderr_destination(capsys):
    sok.configure(level=1, log_dest="stderr", spans=False)
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    captured = capsys.readouterr()
    assert captured.out == ""
    assert strip_timestamps(captured.err) == "=" * 80 + "\n[TS] SGLang Kernel API Call: k\n"


def test_off_destination_writes_nothing(capsys, tmp_path, record):
    exporter = record(level=3, log_dest="off")
    sok.debug_kernel_api(op_name="k")(lambda x: x)(torch.ones(2))
    captured = capsys.readouterr()
    assert captured.out == captured.err == ""
    assert [s.name for s in exporter.get_finished_spans()] == ["k"]


def test_timestamp_is_local_time_now(tmp_path):
    import time

    log = tmp_path / "k.log"
    sok.configure(level=1, log_dest=str(log), spans=False)
    # The log reads the clock the spans read (time.time); time.strftime alone
    # reads time(2), a coarse clock a few ms off it, so at the turn of a
    # second the two can name different seconds (seen in CI).
    before = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time()))
    sok.debug_kernel_api(op_name="k")(lambda: None)()
    after = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time()))
    stamp = log.read_text().splitlines()[1][1:20]
    assert before <= stamp <= after


def test_pid_in_path_and_lines_written_before_the_kernel_runs(tmp_path):
    """The call line is in the file while the kernel runs: a kernel that kills
    the process (os._exit) leaves it behind."""
    script = (
        "import os, sglang_otel_kernels as sok\n"
        "@sok.debug_kernel_api(op_name='dies')\n"
        "def dies(x):\n"
        "    os._exit(3)\n"
        "dies(5)\n"
    )
    env = {
        "SGLANG_KERNEL_API_LOGLEVEL": "3",
        "SGLANG_KERNEL_API_LOGDEST": str(tmp_path / "log_%i.txt"),
        "SGLANG_KERNEL_API_TRACEFILE": "off",
    }
    proc = run_python(script, tmp_path, env)
    assert proc.returncode == 3
    files = list(tmp_path.iterdir())
    assert [f.name for f in files] == [f"log_{proc_pid(files[0])}.txt"]
    text = strip_timestamps(files[0].read_text())
    assert text == (
        "=" * 80 + "\n[TS] SGLang Kernel API Call: dies\nPositional input arguments:\n  arg[0]=5\n"
    )


def proc_pid(path: Path) -> str:
    digits = path.stem.split("_")[1]
    assert digits.isdigit()
    return digits


def test_unwritable_destination_warns_once_and_calls_go_on(tmp_path, capsys, record):
    exporter = record(level=3, log_dest=str(tmp_path / "missing-dir" / "log.txt"))
    kernel = sok.debug_kernel_api(op_name="k")(lambda x: x + 1)
    assert [kernel(i) for i in range(3)] == [1, 2, 3]
    err = capsys.readouterr().err
    assert err.count("text log to") == 1
    assert "missing-dir" in err
    assert len(exporter.get_finished_spans()) == 3


def test_exception_line_only_for_exception_subclasses(tmp_path):
    log = tmp_path / "k.log"
    sok.configure(level=1, log_dest=str(log), spans=False)

    @sok.debug_kernel_api(op_name="interrupted")
    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        interrupted()
    assert "Exception" not in log.read_text()


def test_tensor_lines_are_the_same_from_the_cache_and_for_unhashable_shapes():
    from sglang_otel_kernels.descriptions import TensorInfo
    from sglang_otel_kernels.record.textlog import node_text

    class Unhashable(tuple):
        __hash__ = None

    def info(shape):
        made = TensorInfo(None, shape, "torch.float32", "cpu", (1,), True, False)
        made.stats = (0.0, 1.0, 0.5, 0, 0)
        return made

    first = node_text(info((2, 3)), True, "  ")
    assert node_text(info((2, 3)), True, "  ") == first  # from the cache
    assert node_text(info(Unhashable((2, 3))), True, "  ") == first
    assert first.splitlines() == ["Tensor(", "    shape=(2, 3)", "    dtype=torch.float32", "    device=cpu",
                                  "    requires_grad=False", "    is_contiguous=True", "    min=0.000000",
                                  "    max=1.000000", "    mean=0.500000", "    nan_count=0", "    inf_count=0", "  )"]
