"""SGLang's variables, read once at import; OTEL_SDK_DISABLED turns spans off."""

import pytest

from conftest import run_python, strip_timestamps

SPAN_COUNTER = (
    "from opentelemetry import trace\n"
    "from opentelemetry.sdk.trace import TracerProvider\n"
    "from opentelemetry.sdk.trace.export import SimpleSpanProcessor\n"
    "from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter\n"
    "exporter = InMemorySpanExporter()\n"
    "provider = TracerProvider(); provider.add_span_processor(SimpleSpanProcessor(exporter))\n"
    "trace.set_tracer_provider(provider)\n"
    "import sglang_otel_kernels as s\n"
    "k = s.debug_kernel_api(op_name='k')(lambda x: x)\n"
    "k(1)\n"
    "print('spans', len(exporter.get_finished_spans()), 'level', s.get_config().level)\n"
)


@pytest.fixture
def run(tmp_path):
    return lambda env, script=SPAN_COUNTER: run_python(script, tmp_path, env)


def test_level_and_stdout_from_environment(run):
    out = run({"SGLANG_KERNEL_API_LOGLEVEL": "3"})
    assert out.returncode == 0, out.stderr
    lines = strip_timestamps(out.stdout).splitlines()
    assert lines == [
        "=" * 80,
        "[TS] SGLang Kernel API Call: k",
        "Positional input arguments:",
        "  arg[0]=1",
        "Output:",
        "  return=1",
        "spans 1 level 3",
    ]


def test_unparsable_level_warns_and_uses_zero(run):
    out = run({"SGLANG_KERNEL_API_LOGLEVEL": "verbose"})
    assert out.returncode == 0, out.stderr
    assert "SGLANG_KERNEL_API_LOGLEVEL='verbose'" in out.stderr
    assert out.stdout == "spans 0 level 0\n"


def test_logdest_off_keeps_spans_without_text(run):
    out = run({"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": "off"})
    assert out.returncode == 0, out.stderr
    assert out.stdout == "spans 1 level 1\n"


@pytest.mark.parametrize("value", ["true", "TRUE"])
def test_otel_sdk_disabled_skips_spans_keeps_text(run, value):
    out = run({"SGLANG_KERNEL_API_LOGLEVEL": "1", "OTEL_SDK_DISABLED": value})
    assert out.returncode == 0, out.stderr
    assert strip_timestamps(out.stdout).splitlines() == [
        "=" * 80,
        "[TS] SGLang Kernel API Call: k",
        "spans 0 level 1",
    ]


def test_level_10_adds_dumps_to_level_5_in_sglangs_default_directory(run, tmp_path):
    script = (
        "import torch, sglang_otel_kernels as s\n"
        "s.debug_kernel_api(op_name='k')(lambda x: x)(torch.ones(2))\n"
    )
    out = run({"SGLANG_KERNEL_API_LOGLEVEL": "10"}, script)
    assert out.returncode == 0, out.stderr
    assert "      min=1.000000" in out.stdout
    [call] = (tmp_path / "sglang_kernel_api_dumps").iterdir()
    assert f"Dumped inputs to: {call}\n" in out.stdout and f"Dumped outputs to: {call}\n" in out.stdout


def test_dump_settings_from_environment(run):
    script = (
        "import sglang_otel_kernels as s\n"
        "c = s.get_config()\n"
        "print(c.dump_dir, c.dump_include, c.dump_exclude, c.dump_max_bytes, c.dump_max_count)\n"
    )
    out = run({"SGLANG_KERNEL_API_DUMP_DIR": "/tmp/d_%i", "SGLANG_KERNEL_API_DUMP_INCLUDE": "sglang.*, ,*norm*",
               "SGLANG_KERNEL_API_DUMP_EXCLUDE": "*moe*", "SGLANG_KERNEL_API_DUMP_MAX_BYTES": "2G",
               "SGLANG_KERNEL_API_DUMP_MAX_COUNT": "50"}, script)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "/tmp/d_%i ('sglang.*', '*norm*') ('*moe*',) 2147483648 50"
    out = run({"SGLANG_KERNEL_API_DUMP_MAX_BYTES": "lots", "SGLANG_KERNEL_API_DUMP_MAX_COUNT": "-3"}, script)
    assert out.stdout.split("\n")[0] == f"sglang_kernel_api_dumps () () {20 * 1024**3} 1000"
    assert "cannot parse SGLANG_KERNEL_API_DUMP_MAX_BYTES='lots'" in out.stderr
    assert "cannot parse SGLANG_KERNEL_API_DUMP_MAX_COUNT='-3'" in out.stderr


def test_configure_rejects_bad_values():
    import sglang_otel_kernels as sok

    for bad in (-1, "3", 2.0, True):
        with pytest.raises(ValueError):
            sok.configure(level=bad)
    for bad in ("", "   ", 5):
        with pytest.raises(ValueError):
            sok.configure(log_dest=bad)
    for bad in ({"dump_dir": ""}, {"dump_include": "k*"}, {"dump_exclude": [1]}, {"dump_max_bytes": -1},
                {"dump_max_count": 1.5}, {"dump_max_count": True}):
        with pytest.raises(ValueError):
            sok.configure(**bad)
