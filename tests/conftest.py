import os
import re
import subprocess
import sys

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import sglang_otel_kernels as sok

_TIMESTAMP = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\]", re.MULTILINE)


def strip_timestamps(text: str) -> str:
    return _TIMESTAMP.sub("[TS]", text)


# The files that run longest (pytest --durations), started first: with `--dist loadfile` a file runs whole
# on one worker, and a long one started last (these sort late) runs on alone while the others sit idle.
LONGEST_FIRST = ("test_sglang_server.py", "test_sglang_real.py", "test_cores.py", "test_gateway.py", "test_ranks.py",
                 "test_alerts.py", "test_docs.py", "test_collectives.py", "test_sglang_fidelity.py")


def pytest_collection_modifyitems(items):
    order = {name: number for number, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: order.get(item.path.name, len(order)))  # stable: the rest as collected


@pytest.fixture(autouse=True)
def restore_config():
    """Each test starts with the trace file off (tests of it turn it on) and
    leaves the settings as it found them."""
    saved = sok.get_config()
    sok.configure(trace_file="off")
    yield
    sok.configure(**{field: getattr(saved, field) for field in saved.__dataclass_fields__})


@pytest.fixture
def provider():
    """A real SDK provider whose ended spans land in an in-memory exporter."""
    exporter = InMemorySpanExporter()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer_provider.exporter = exporter
    yield tracer_provider
    tracer_provider.shutdown()


@pytest.fixture
def record(provider):
    """`record(level)` configures spans into memory (no text log) and returns the exporter."""

    def setup(level: int = 3, log_dest: str = "off") -> InMemorySpanExporter:
        sok.configure(level=level, log_dest=log_dest, spans=True, tracer_provider=provider)
        return provider.exporter

    return setup


# The recording core the whole run tests (SGLANG_KERNEL_API_NATIVE): its
# children record with the same one.
CORE_VARIABLE = "SGLANG_KERNEL_API_NATIVE"


def clean_env(*prefixes: str, **settings: str) -> dict:
    """This process's environment less our variables, the OTEL_* ones and
    those of `prefixes` (but for the core under test), plus `settings`."""
    env = {k: v for k, v in os.environ.items()
           if k == CORE_VARIABLE or not k.startswith(("SGLANG_KERNEL_API", "OTEL_", *prefixes))}
    env.update(settings)
    return env


def run_python(script: str, cwd, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    """Runs `script` in a fresh interpreter in `cwd`, with none of our or the
    OTEL_* variables of this process, plus `env`."""
    clean = clean_env(**(env or {}))
    return subprocess.run(
        [sys.executable, "-c", script], cwd=cwd, env=clean, capture_output=True, text=True, timeout=timeout
    )
