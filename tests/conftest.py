import re

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

import sglang_otel_kernels as sok

_TIMESTAMP = re.compile(r"^\[\d{4}-\d{2}-\d{2} \d{2}:\d{2}:\d{2}\]", re.MULTILINE)


def strip_timestamps(text: str) -> str:
    return _TIMESTAMP.sub("[TS]", text)


@pytest.fixture(autouse=True)
def restore_config():
    saved = sok.get_config()
    yield
    sok.configure(
        level=saved.level, log_dest=saved.log_dest, spans=saved.spans, tracer_provider=saved.tracer_provider
    )


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
