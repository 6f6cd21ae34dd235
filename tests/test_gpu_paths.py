"""The CUDA paths, on the CPU (issue 17): the accelerator branches forced or
the device calls patched, each as a real process where a crash is involved."""

import os
import signal

import pytest

import sglang_otel_kernels as sok
from conftest import run_python

K = "sglang.kernel."
LEVEL_5 = {"SGLANG_KERNEL_API_LOGLEVEL": "5", "SGLANG_KERNEL_API_LOGDEST": "off",
           "SGLANG_KERNEL_API_TRACEFILE": "t.sgltrace"}


def test_a_hang_in_the_level_5_synchronisation_leaves_the_call_in_flight(tmp_path):
    """The statistics synchronise with the GPU before the kernel runs; when
    earlier GPU work hangs there and the process is killed, the start record
    must already be on disk."""
    proc = run_python("import os, signal, torch\n"
                      "from sglang_otel_kernels.capture import decorator\n"
                      "decorator.fill_statistics = lambda infos: os.kill(os.getpid(), signal.SIGKILL)  # hangs, killed\n"
                      "decorator.debug_kernel_api(op_name='k')(lambda x: x)(torch.ones(2, 3))\n", tmp_path, LEVEL_5)
    assert proc.returncode == -signal.SIGKILL
    [span] = sok.read_trace(tmp_path / "t.sgltrace")
    assert span.in_flight and span.name == "k"
    assert span.attributes[K + "input.arg0.shape"] == (2, 3)


def test_the_call_in_flight_at_level_5_carries_its_input_statistics(tmp_path):
    proc = run_python("import os, torch, sglang_otel_kernels as sok\n"
                      "sok.debug_kernel_api(op_name='k')(lambda x: os._exit(7))(torch.tensor([1.0, float('nan')]))\n",
                      tmp_path, LEVEL_5)
    assert proc.returncode == 7
    [span] = sok.read_trace(tmp_path / "t.sgltrace")
    assert span.in_flight
    a = span.attributes
    assert (a[K + "input.arg0.nan_count"], a[K + "has_nan"], a[K + "nonfinite"]) == (1, True, ("input.arg0",))
    assert list(a)[:6] == [K + "name", K + "level", K + "seq", K + "has_nan", K + "has_inf", K + "nonfinite"]


def test_past_the_dump_limit_no_input_is_copied_to_the_host(tmp_path):
    """On a GPU, `.cpu()` of an input is a blocking device-to-host copy (a
    KV-cache pool: gigabytes): past the limits, none may happen."""
    proc = run_python("import torch, sglang_otel_kernels as sok\n"
                      "copies = []\n"
                      "original = torch.Tensor.cpu\n"
                      "torch.Tensor.cpu = lambda self, *a, **k: copies.append(self.numel()) or original(self, *a, **k)\n"
                      "k = sok.debug_kernel_api(op_name='k')(lambda pool, x: x + 1)\n"
                      "pool = torch.zeros(1000)\n"
                      "for _ in range(3):\n"
                      "    k(pool, torch.ones(2))\n"
                      "    print(len(copies))\n",
                      tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
                                 "SGLANG_KERNEL_API_DUMP_DIR": "dumps", "SGLANG_KERNEL_API_DUMP_MAX_COUNT": "1"})
    assert proc.returncode == 0, proc.stderr
    after = [int(line) for line in proc.stdout.split()]
    assert after[0] == 3  # the dumped call: its two inputs and its output
    assert after[1] == after[2] == after[0]  # past the limit: not one copy


def test_rerun_of_a_device_side_assert_says_it_reproduced_a_failure(tmp_path, monkeypatch):
    """The error of an asynchronous kernel surfaces at the next synchronisation,
    which rerun makes: it is the call's failure, not rerun's."""
    import torch

    from sglang_otel_kernels.recover.rerun import rerun_here

    (tmp_path / "mykernels.py").write_text("import os\n"
                                           "def gather(table, index):\n"
                                           "    os._exit(9)  # the process dies on the device-side assert\n")
    proc = run_python("import torch, sglang_otel_kernels as sok\n"
                      "from mykernels import gather\n"
                      "sok.debug_kernel_api(gather)(torch.ones(4), torch.tensor([9]))\n",
                      tmp_path, {"SGLANG_KERNEL_API_LOGLEVEL": "10", "SGLANG_KERNEL_API_LOGDEST": "off",
                                 "SGLANG_KERNEL_API_DUMP_DIR": "dumps", "PYTHONPATH": str(tmp_path)})
    assert proc.returncode == 9
    [dump] = [os.path.join(root, d) for root, dirs, _ in os.walk(tmp_path / "dumps") for d in dirs]
    (tmp_path / "mykernels.py").write_text("def gather(table, index):\n    return table[index.clamp(max=3)]\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def device_side_assert():
        raise RuntimeError("CUDA error: device-side assert triggered")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "synchronize", device_side_assert)
    report = rerun_here(dump, function="mykernels:gather")  # in this process: the patched synchronisation
    assert report["reproduced"] is True
    assert report["verdict"].startswith("reproduced a failure: raised RuntimeError")


def test_during_graph_capture_no_argument_object_is_formatted(record, monkeypatch, tmp_path):
    """An object holding CUDA tensors formats them in its repr, which
    synchronises: a span never formats it (its type says what it is), and
    SGLang's text log only outside a capture."""
    import torch

    formatted = []

    class KVCachePool:
        def __repr__(self):
            formatted.append(True)
            return "KVCachePool(...)"

    log = tmp_path / "kernels.log"
    exporter = record(level=3, log_dest=str(log))
    kernel = sok.debug_kernel_api(op_name="k")(lambda pool, x: x)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    kernel(KVCachePool(), torch.ones(1))
    assert formatted == []
    assert "repr=<KVCachePool, repr skipped: graph capture in progress>" in log.read_text()
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    kernel(KVCachePool(), torch.ones(1))
    assert formatted == [True]  # the text log's repr, once
    assert [span.attributes[K + "input.arg0"] for span in exporter.get_finished_spans()] == ["KVCachePool"] * 2


def test_a_device_error_at_the_recorders_synchronisation_fails_that_call_and_no_later_one(record, monkeypatch):
    """An illegal memory access surfaces at the next synchronisation: the
    recorder's copy of the output statistics. That call's span says so; the
    next call, which raises the same sticky error, is not blamed for it."""
    import torch

    from sglang_otel_kernels.capture import decorator
    from sglang_otel_kernels.describe import statistics

    monkeypatch.setattr(decorator, "_device_fault", None)
    monkeypatch.setattr(statistics, "on_host", lambda tensor: False)  # the accelerator branch
    illegal = "CUDA error: an illegal memory access was encountered"
    exporter = record(level=5)
    launched = []

    def tolist(tensor, original=torch.Tensor.tolist):
        if launched:  # after the faulty kernel, every copy to the host raises its error
            raise torch.AcceleratorError(illegal)
        return original(tensor)

    monkeypatch.setattr(torch.Tensor, "tolist", tolist)
    faulty = sok.debug_kernel_api(op_name="faulty")(lambda x: launched.append(1) or x * 2)
    innocent = sok.debug_kernel_api(op_name="innocent")(lambda x: (_ for _ in ()).throw(torch.AcceleratorError(illegal)))
    faulty(torch.ones(2))
    try:
        innocent(torch.ones(2))
    except torch.AcceleratorError:
        pass
    first, second = exporter.get_finished_spans()
    assert first.name == "faulty" and first.status.status_code.name == "ERROR"
    assert first.status.description.startswith(f"AcceleratorError: {illegal} (an asynchronous device error")
    assert "seen by the recorder after this call" in first.status.description
    assert first.attributes[K + "output.stats"] == "unavailable: AcceleratorError"
    assert second.name == "innocent" and second.status.status_code.name == "ERROR"
    assert "a sticky device error, first seen after faulty ran: not necessarily this call's" in \
        second.status.description


def test_gpu_check_dry_run_on_the_cpu_runs_every_section_and_writes_its_summary(tmp_path):
    import json
    import subprocess
    import sys

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu_check.py")
    proc = subprocess.run([sys.executable, script, "--out", str(tmp_path / "summary.json")], capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert list(sections)[:3] == ["culprits", "coredump", "nan_check"]  # the newest first, for the first GPU lent
    assert set(sections) == {"culprits", "coredump", "nan_check", "syncs", "stats", "capture", "assert", "in_flight", "level10",
                             "decode", "graphs", "provenance"}
    assert all(s["status"] == "skipped" and s["reason"] == "no CUDA device"
               for name, s in sections.items() if name != "stats")
    assert sections["stats"]["status"] == "ran"
    # What the figures depend on besides the code, in every run's summary.
    environment = summary["environment"]
    assert environment["time_ns_cost_ns"] > 0 and environment["trace_dir_filesystem"]
    assert set(environment) == {"clocksource", "time_ns_cost_ns", "trace_dir", "trace_dir_filesystem",
                                "dev_shm_filesystem"}
    assert sections["stats"]["sweep float8_e4m3fn"][3:] == [1, 0]  # NaN counted on float8
    assert sections["stats"]["sweep float8_e5m2"][3:] == [0, 1]  # and Inf, which float8 has no isinf for


def _gpu_check():
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu_check.py")
    spec = importlib.util.spec_from_file_location("gpu_check", path)
    gpu_check = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_check)
    return gpu_check


def test_the_decode_sections_figures_are_medians_and_ranges_against_level_0_of_the_same_rounds():
    """bench/gpu_check.py's decode figures, from rows as its children print
    them (the logic a GPU run relies on, run here)."""
    gpu_check = _gpu_check()
    row = lambda host, gpu, wall, faults=0, recorded=0: {  # noqa: E731
        "host_ms": host, "gpu_ms": gpu, "wall_ms": wall, "faults": faults, "recorded_by_the_compiled_core": recorded}
    figures = gpu_check.decode_figures({
        "level 0": [row(1.0, 2.0, 2.0), row(1.2, 2.0, 2.1), row(0.8, 2.0, 2.2)],
        "black box": [row(1.32, 2.0, 2.1, 3, 32 * 17), row(1.4, 2.0, 2.2, 1, 32 * 17), row(1.2, 2.0, 2.3, 2, 32 * 17)],
        "level 1": [row(3.0, 2.0, 3.0), row(3.2, 2.1, 3.3), row(2.8, 1.9, 3.15)],
        "level 5": []})  # every child of a mode failed: no figure
    assert figures["level 0"]["host_ms"] == {"median": 1.0, "range": [0.8, 1.2]} and "added_host_us_a_call" not in \
        figures["level 0"]
    box = figures["black box"]
    assert box["added_host_us_a_call"] == round(0.32 * 1e3 / 32, 2) and box["added_wall_of_a_step"] == "4.8 %"
    assert box["bound_by"] == "gpu" and box["faults"]["median"] == 2 and box["recorded_by_the_compiled_core"] == 544
    assert figures["level 1"]["bound_by"] == "host" and figures["level 1"]["added_wall_of_a_step"] == "50.0 %"
    assert "level 5" not in figures


def test_each_syncs_row_is_a_whole_configuration_of_its_own_counted_in_both_orders(tmp_path):
    """bench/gpu_check.py's syncs rows: each sets every setting a row
    before it could have left on (the black box, the provider, the trace
    file), the production rows with no processor but the trace file's; each
    is accepted by configure and records its calls here (the compiled core
    where it is built); and the table counts each row forward and reversed."""
    import torch

    import sglang_otel_kernels as sok
    from sglang_otel_kernels.record import core

    gpu_check = _gpu_check()
    rows = gpu_check.sync_rows(str(tmp_path))
    assert len({row["trace_file"] for row in rows.values()}) == len(rows)
    assert all(set(row) >= {"blackbox", "tracer_provider", "trace_file", "spans", "log_dest"} for row in rows.values())
    assert [label for label, row in rows.items() if row["blackbox"]] == ["black box, level 1", "black box, level 3",
                                                                         "black box, NaN flags"]
    assert [label for label, row in rows.items() if row["nan_flags"]] == ["level 1, NaN flags, file only",
                                                                          "black box, NaN flags",
                                                                          "level 1, NaN flags and inputs"]
    assert [label for label, row in rows.items() if row["nan_flag_inputs"]] == ["level 1, NaN flags and inputs"]
    production = rows["level 1, file only"]["tracer_provider"]
    assert not production._active_span_processor._span_processors  # the trace file's is added when configured
    for label in ("level 1, file only", "black box, level 3", "level 1, NaN flags, file only", "black box, NaN flags",
                  "level 1, NaN flags and inputs"):
        sok.configure(**rows[label])
        kernel = sok.debug_kernel_api(op_name=f"sync.{label}")(lambda t: t * 2)
        kernel(torch.ones(2))
        kernel(torch.ones(2))  # a site's first calls go through Python
        before = core.native.recorded() if core.native is not None else 0
        kernel(torch.ones(2))
        if core.native is not None:
            assert core.native.recorded() - before == 1, label  # the production path (the flags' too): the core's
    sok.configure(level=0, trace_file="off")
    seen = []
    table = gpu_check.sync_table(["a", "b", "c"], lambda label: seen.append(label) or len(seen))
    assert seen == ["a", "b", "c", "c", "b", "a"]
    assert table == {"a": {"forward": 1, "reversed": 6}, "b": {"forward": 2, "reversed": 5},
                     "c": {"forward": 3, "reversed": 4}}


def test_gpu_check_dry_run_runs_decode_syncs_and_provenance_on_stand_ins_with_every_field(tmp_path):
    """`--dry-run` without CUDA: the sections a GPU run relies on most run
    end to end on the CPU, their children included, and print every field
    the issue asks of them (their figures say nothing of a GPU)."""
    import json
    import subprocess
    import sys

    from sglang_otel_kernels.record import core

    script = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench", "gpu_check.py")
    # No budget: on a loaded machine the decode children alone ran past the lent machine's 360 s.
    proc = subprocess.run([sys.executable, script, "--dry-run", "--budget", "inf", "--only", "decode", "syncs",
                           "provenance", "coredump", "--out", str(tmp_path / "summary.json")], capture_output=True,
                          text=True, timeout=2400)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads((tmp_path / "summary.json").read_text())
    sections = summary["sections"]
    assert summary["dry_run"] is True
    assert sections["coredump"] == {"status": "skipped", "reason": "no CUDA device, and no stand-in for this section"}
    decode = sections["decode"]
    assert decode["status"] == "ran", decode
    gpu_check = _gpu_check()
    assert set(gpu_check.DECODE_MODES) <= set(decode) and "black box, /dev/shm" in decode
    assert decode["level 0, graph"] == decode["NaN flags, level 1, graph"] == "not stood in: needs CUDA graphs"
    for label in [label for label, mode in gpu_check.DECODE_MODES.items() if mode[4] == "0"]:
        figure = decode[label]
        assert set(figure) >= {"host_ms", "gpu_ms", "wall_ms", "faults", "bound_by", "recorded_by_the_compiled_core"}
        assert figure["host_ms"]["range"][0] <= figure["host_ms"]["median"] <= figure["host_ms"]["range"][1]
        if label != "level 0":
            assert {"added_host_us_a_call", "added_wall_of_a_step"} <= set(figure)
    assert decode["level 0"]["recorded_by_the_compiled_core"] == 0
    if core.native is not None:  # the production modes' calls recorded in C (0 would mean Python ran them)
        for label in ("level 1", "black box", "black box, /dev/shm", "NaN flags, level 1", "NaN flags, black box"):
            assert decode[label]["recorded_by_the_compiled_core"] >= 32 * 80, label
    syncs = sections["syncs"]
    assert syncs["status"] == "ran" and syncs["bare kernel"] == 0
    for label in ("level 1, file only", "level 3, file only", "black box, level 1", "black box, level 3"):
        for order in ("forward", "reversed"):
            row = syncs[label][order]
            assert row["call"] == 0 and row["next call"] == 0, (label, order, row)
            assert row["of 2 recorded by the compiled core"] == (2 if core.native is not None else 0)
    for label in ("level 1, NaN flags, file only", "black box, NaN flags", "level 1, NaN flags and inputs"):
        # No host read, the step's end neither.
        for order in ("forward", "reversed"):
            row = syncs[label][order]
            assert row["call"] == row["next call"] == row["step's end"] == 0, (label, order, row)
            assert row["of 2 recorded by the compiled core"] == (2 if core.native is not None else 0)
    level5 = syncs["level 5, file only"]["forward"]["call"]
    assert level5["count"] > 0 and all("describe/statistics.py" in where for where in level5["where"])
    assert syncs["during capture"] == "not stood in: needs CUDA graphs"
    provenance = sections["provenance"]
    assert provenance["named"] == [["r5"], ["r1", "r7"]] and provenance["copies"] == 3
    assert provenance["syncs clean, bare kernel"] == 0 and provenance["syncs clean"]["count"] > 0


def test_host_reads_lists_each_read_of_a_tensor_value_and_can_refuse_them():
    import torch

    host_reads = _gpu_check()._sibling("host_reads")
    t = torch.ones(3)
    with host_reads.host_reads() as reads:
        t.sum().item()
        bool(t.any())
        t * 2  # no value read
        t.tolist()
    assert [read.split(": ")[1] for read in reads] == ["Tensor.item", "Tensor.__bool__", "Tensor.tolist"]
    assert all(read.startswith("tests/test_gpu_paths.py:") for read in reads)
    with host_reads.host_reads(refuse=True) as reads:
        with pytest.raises(host_reads.HostRead, match="Tensor.item"):
            t.sum().item()
    assert len(reads) == 1
    assert t.sum().item() == 3.0 and "item" not in torch.Tensor.__dict__  # put back as it was
