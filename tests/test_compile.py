"""Under torch.compile tracing the wrapper calls straight through, as SGLang's."""

import torch

import sglang_otel_kernels as sok


def test_compiled_caller_traces_through_the_wrapper(record):
    exporter = record(level=5)
    seen_compiling = []

    @sok.debug_kernel_api(op_name="scale")
    def scale(x, factor):
        seen_compiling.append(torch.compiler.is_compiling())
        return x * factor

    def model(x):
        return scale(x, 2.0) + 1

    compiled = torch.compile(model, backend="eager", fullgraph=True)
    x = torch.arange(4, dtype=torch.float32)
    assert torch.equal(compiled(x), x * 2 + 1)
    assert torch.equal(compiled(x), x * 2 + 1)
    # The kernel body ran only while tracing, and no span or tensor access
    # happened then: fullgraph=True would have failed on a graph break.
    assert seen_compiling and all(seen_compiling)
    assert exporter.get_finished_spans() == ()
    # Eager calls are recorded as usual.
    scale(x, 3.0)
    assert [s.name for s in exporter.get_finished_spans()] == ["scale"]
