"""Recording kernels without editing their code: custom ops, torch.ops
namespaces, import paths (in code, from the environment, through the `run`
launcher), and the OpenTelemetry instrumentor."""

import importlib
import itertools
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import Tensor

import sglang_otel_kernels as sok
from conftest import clean_env, run_python
from sglang_otel_kernels.integrations.opentelemetry import KernelInstrumentor

K = "sglang.kernel."
_namespaces = itertools.count()


def fresh_namespace() -> str:
    """torch.library registrations live as long as the process: one namespace per test."""
    return f"sok_cov{os.getpid()}_{next(_namespaces)}"


def names(exporter) -> list:
    return [span.name for span in exporter.get_finished_spans()]


def rms(x: Tensor, eps: float) -> Tensor:
    return x / (x.pow(2).mean(-1, keepdim=True) + eps).sqrt()


# -- custom ops ---------------------------------------------------------------


def test_a_custom_op_call_is_a_span_named_and_described_like_the_decorator(record):
    exporter = record(level=3)
    namespace = fresh_namespace()
    op = sok.register_kernel_op(rms, namespace=namespace, out_shape=0)
    assert op is getattr(torch.ops, namespace).rms
    x = torch.ones(2, 4)
    assert torch.allclose(getattr(torch.ops, namespace).rms(x, 1e-6), torch.ones(2, 4))
    [span] = exporter.get_finished_spans()
    assert span.name == "test_coverage.rms"  # as SGLang names the function
    assert span.attributes[K + "input.arg0.shape"] == (2, 4)
    assert span.attributes[K + "input.arg1"] == 1e-6
    assert span.attributes[K + "output.shape"] == (2, 4)


def test_compiled_graphs_keep_the_op_opaque_and_record_every_real_call(record):
    exporter = record(level=3)
    namespace = fresh_namespace()
    fake_calls = []

    def fake(x, eps):
        fake_calls.append(type(x).__name__)
        return torch.empty_like(x)

    sok.register_kernel_op(rms, namespace=namespace, fake_impl=fake)
    op = getattr(torch.ops, namespace).rms
    graphs = []

    def backend(graph_module, example_inputs):
        graphs.append(graph_module)
        return graph_module.forward

    compiled = torch.compile(lambda x: op(x, 1e-6) * 2, fullgraph=True, backend=backend)
    for _ in range(3):
        assert torch.allclose(compiled(torch.ones(3, 4)), torch.full((3, 4), 2.0))
    # One graph, the op one opaque node in it; its fake ran on fake tensors only.
    [graph] = graphs
    assert op in [node.target for node in graph.graph.nodes]
    assert fake_calls and set(fake_calls) == {"FakeTensor"}
    spans = exporter.get_finished_spans()
    assert names(exporter) == ["test_coverage.rms"] * 3  # the real calls, never the fake one
    assert all(s.attributes[K + "input.arg0.device"] == "cpu" for s in spans)
    # A call on meta tensors runs the fake implementation: not a kernel call.
    assert op(torch.empty(2, 4, device="meta"), 1e-6).device.type == "meta"
    assert len(exporter.get_finished_spans()) == 3


def test_an_extern_function_without_annotations_takes_a_schema(record):
    exporter = record(level=3)
    namespace = fresh_namespace()

    def scaled_cast(x, scale):  # as a third-party kernel: no annotations
        return (x * scale).to(torch.bfloat16)

    op = sok.register_kernel_op_from_extern(
        scaled_cast, schema="(Tensor x, float scale) -> Tensor", namespace=namespace, out_shape="x",
        out_dtype=torch.bfloat16)
    compiled = torch.compile(lambda x: op(x, 2.0), fullgraph=True, backend="eager")
    result = compiled(torch.ones(2))
    assert result.dtype == torch.bfloat16 and torch.equal(result.float(), torch.full((2,), 2.0))
    assert names(exporter) == ["test_coverage.test_an_extern_function_without_annotations_takes_a_schema.scaled_cast"]
    # Registering the same name again (another import of the same module) gives the same op.
    assert sok.register_kernel_op_from_extern(scaled_cast, schema="(Tensor x, float scale) -> Tensor",
                                              namespace=namespace) is op


def test_custom_op_options_are_checked(record):
    record(level=1)
    with pytest.raises(ValueError, match="out_shape or fake_impl"):
        sok.register_kernel_op(rms, namespace=fresh_namespace(), out_shape=0, fake_impl=lambda x, eps: x)


def test_at_level_0_a_custom_op_runs_unrecorded(record):
    exporter = record(level=0)
    namespace = fresh_namespace()
    sok.register_kernel_op(rms, namespace=namespace, out_shape=0)
    getattr(torch.ops, namespace).rms(torch.ones(2), 1e-6)
    assert names(exporter) == []


# -- torch.ops namespaces -------------------------------------------------------


def define_ops(namespace: str) -> "torch.library.Library":
    """Ops implemented elsewhere: plain torch.library registrations."""
    library = torch.library.Library(namespace, "DEF")
    library.define("add(Tensor a, Tensor b) -> Tensor")
    library.define("mul(Tensor a, Tensor b) -> Tensor")
    library.define("neg(Tensor a) -> Tensor")
    library.impl("add", lambda a, b: a + b, "CompositeExplicitAutograd")
    library.impl("mul", lambda a, b: a * b, "CompositeExplicitAutograd")
    library.impl("neg", lambda a: -a, "CompositeExplicitAutograd")
    return library


def test_instrument_namespace_records_every_op_and_undo_puts_them_back(record):
    exporter = record(level=3)
    namespace = fresh_namespace()
    library = define_ops(namespace)  # noqa: F841  (kept alive for the test)
    ops = getattr(torch.ops, namespace)
    original = ops.add
    handle = sok.instrument_namespace(namespace, exclude=["neg"])
    assert sorted(handle.targets) == [f"torch.ops.{namespace}.add", f"torch.ops.{namespace}.mul"]
    a, b = torch.ones(2), torch.full((2,), 3.0)
    assert torch.equal(getattr(torch.ops, namespace).add(a, b), torch.full((2,), 4.0))
    getattr(torch.ops, namespace).mul(a, b)
    getattr(torch.ops, namespace).neg(a)
    assert names(exporter) == [f"torch.ops.{namespace}.add", f"torch.ops.{namespace}.mul"]
    assert exporter.get_finished_spans()[0].attributes[K + "input.arg1.shape"] == (2,)
    handle.undo()
    assert getattr(torch.ops, namespace).add is original
    getattr(torch.ops, namespace).add(a, b)
    assert len(exporter.get_finished_spans()) == 2


def test_instrument_namespace_twice_records_once_and_works_as_a_context_manager(record):
    exporter = record(level=1)
    namespace = fresh_namespace()
    library = define_ops(namespace)  # noqa: F841
    sok.instrument_namespace(namespace)
    with sok.instrument_namespace(namespace, include=["a*"]):
        getattr(torch.ops, namespace).add(torch.ones(1), torch.ones(1))
        getattr(torch.ops, namespace).mul(torch.ones(1), torch.ones(1))
    getattr(torch.ops, namespace).add(torch.ones(1), torch.ones(1))
    assert names(exporter) == [f"torch.ops.{namespace}.add"]


def test_instrument_namespace_leaves_ops_recorded_already(record):
    exporter = record(level=1)
    namespace = fresh_namespace()
    sok.register_kernel_op(rms, namespace=namespace, out_shape=0)
    handle = sok.instrument_namespace(namespace)
    assert handle.targets == []
    getattr(torch.ops, namespace).rms(torch.ones(2), 1e-6)
    assert names(exporter) == ["test_coverage.rms"]  # one span, not two nested


def test_instrument_namespace_rejects_a_bad_name():
    with pytest.raises(ValueError, match="namespace"):
        sok.instrument_namespace("not a namespace")


# -- import paths -----------------------------------------------------------------

MODULE_SOURCE = """
import torch

def kernel(x):
    return x + 1

class Layer:
    def forward(self, x):
        return x * 2

    @staticmethod
    def pure(x):
        return x - 1

    @classmethod
    def build(cls, x):
        return x * 3

class Child(Layer):
    pass
"""


@pytest.fixture
def module_dir(tmp_path, monkeypatch):
    """A fresh importable module per test, named uniquely."""
    name = f"kmod_{tmp_path.name.replace('-', '_')}"
    (tmp_path / f"{name}.py").write_text(MODULE_SOURCE)
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path, name
    sys.modules.pop(name, None)


def test_instrument_an_imported_module_then_undo(record, module_dir):
    exporter = record(level=3)
    _, name = module_dir
    module = importlib.import_module(name)
    originals = (module.kernel, module.Layer.__dict__["forward"], module.Layer.__dict__["pure"],
                 module.Layer.__dict__["build"])
    handle = sok.instrument(f"{name}:kernel", f"{name}:Layer.forward", f"{name}:Layer.pure", f"{name}:Layer.build")
    x = torch.ones(2)
    assert torch.equal(module.kernel(x), x + 1)
    assert torch.equal(module.Layer().forward(x), x * 2)
    assert torch.equal(module.Layer.pure(x), x - 1)
    assert torch.equal(module.Layer.build(x), x * 3)
    assert names(exporter) == [f"{name}.kernel", f"{name}.Layer.forward", f"{name}.Layer.pure", f"{name}.Layer.build"]
    # self is left out, as SGLang does: the tensor is arg0.
    assert exporter.get_finished_spans()[1].attributes[K + "input.arg0.shape"] == (2,)
    handle.undo()
    assert (module.kernel, module.Layer.__dict__["forward"], module.Layer.__dict__["pure"],
            module.Layer.__dict__["build"]) == originals
    module.kernel(x)
    assert len(exporter.get_finished_spans()) == 4


def test_an_inherited_method_is_recorded_on_the_subclass_and_undo_inherits_it_again(record, module_dir):
    exporter = record(level=1)
    _, name = module_dir
    module = importlib.import_module(name)
    handle = sok.instrument(f"{name}:Child.forward", op_name="child.forward")
    module.Child().forward(torch.ones(1))
    module.Layer().forward(torch.ones(1))
    assert names(exporter) == ["child.forward"]
    handle.undo()
    assert "forward" not in vars(module.Child)


def test_instrument_before_import_applies_when_the_module_is_imported(record, module_dir):
    exporter = record(level=1)
    _, name = module_dir
    assert name not in sys.modules
    handle = sok.instrument(f"{name}:kernel")
    # Code importing the name gets the recorded version.
    namespace: dict = {}
    exec(f"from {name} import kernel", namespace)
    namespace["kernel"](torch.ones(1))
    assert names(exporter) == [f"{name}.kernel"]
    handle.undo()
    assert sys.modules[name].kernel.__name__ == "kernel" and not hasattr(sys.modules[name].kernel, "__wrapped__")


def test_bad_import_paths_are_clear_errors(record, module_dir, capsys):
    record(level=1)
    _, name = module_dir
    for bad in ("no_colon", "mod:", ":f", "mod:not-an-identifier", 42):
        with pytest.raises(ValueError, match="import path"):
            sok.instrument(bad)
    importlib.import_module(name)
    with pytest.raises(ValueError, match="is not a function or method"):
        sok.instrument(f"{name}:Layer")
    with pytest.raises(ValueError, match="no attribute 'missing'"):
        sok.instrument(f"{name}:kernel", f"{name}:missing")
    assert not hasattr(sys.modules[name].kernel, "__wrapped__")  # the good one was undone too
    # Not imported yet: the problem shows when it is, as a warning, and the import goes on.
    sys.modules.pop(name)
    sok.instrument(f"{name}:missing")
    importlib.import_module(name)
    assert f"cannot instrument {name}:missing: no attribute 'missing'" in capsys.readouterr().err


def test_environment_variable_applies_when_the_package_is_imported(tmp_path):
    (tmp_path / "envmod.py").write_text(MODULE_SOURCE)
    script = (
        "import torch, sglang_otel_kernels as sok, envmod\n"
        "envmod.kernel(torch.ones(1)); envmod.Layer().forward(torch.ones(1))\n"
        "print([s.name for s in sok.read_trace(sok.trace_file_path())])\n"
    )
    proc = run_python(script, tmp_path, {"PYTHONPATH": str(tmp_path), "SGLANG_KERNEL_API_LOGLEVEL": "1",
                                         "SGLANG_KERNEL_API_LOGDEST": "off",
                                         "SGLANG_KERNEL_API_INSTRUMENT": "envmod:kernel, envmod:Layer.forward,bad"})
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "['envmod.kernel', 'envmod.Layer.forward']"
    assert "SGLANG_KERNEL_API_INSTRUMENT: 'bad' is not an import path" in proc.stderr


def test_run_launcher_instruments_a_program_that_never_imports_this_package(tmp_path):
    (tmp_path / "envmod.py").write_text(MODULE_SOURCE)
    (tmp_path / "sitecustomize.py").write_text("import os\nos.environ['CHAINED'] = 'yes'\n")
    script = "import torch, os, envmod\nenvmod.kernel(torch.ones(1))\nprint(os.environ.get('CHAINED'))\n"
    env = clean_env()
    env.update(PYTHONPATH=str(tmp_path), SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_otel_kernels", "run", "--level", "1", "--instrument", "envmod:kernel", "--",
         sys.executable, "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "yes"  # the application's own sitecustomize still ran
    [trace_file] = tmp_path.glob("t_*.sgltrace")
    assert [s.name for s in sok.read_trace(trace_file)] == ["envmod.kernel"]


def test_run_launcher_reaches_processes_the_program_spawns(tmp_path):
    (tmp_path / "envmod.py").write_text(MODULE_SOURCE)
    (tmp_path / "app.py").write_text(textwrap.dedent("""
        import multiprocessing as mp

        def worker():
            import torch, envmod
            envmod.kernel(torch.ones(1))

        if __name__ == "__main__":
            child = mp.get_context("spawn").Process(target=worker)  # as SGLang starts its schedulers
            child.start()
            child.join()
            print(child.pid, child.exitcode)
    """))
    env = clean_env()
    env.update(PYTHONPATH=str(tmp_path), SGLANG_KERNEL_API_LOGDEST="off",
               SGLANG_KERNEL_API_TRACEFILE=str(tmp_path / "t_%i.sgltrace"))
    proc = subprocess.run(
        [sys.executable, "-m", "sglang_otel_kernels", "run", "--level", "1", "--instrument", "envmod:kernel", "--",
         sys.executable, "app.py"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    pid, exitcode = proc.stdout.split()
    assert exitcode == "0"
    assert [s.name for s in sok.read_trace(tmp_path / f"t_{pid}.sgltrace")] == ["envmod.kernel"]


def test_run_launcher_errors(tmp_path, capsys):
    from sglang_otel_kernels.__main__ import main

    assert main(["run", "--"]) == 2
    assert "no command given" in capsys.readouterr().err
    assert main(["run", "--", "no-such-command-here"]) == 2
    assert "command not found: no-such-command-here" in capsys.readouterr().err


# -- the OpenTelemetry instrumentor -------------------------------------------------


def test_instrumentor_in_code_instruments_and_uninstruments(record, module_dir):
    exporter = record(level=0)
    _, name = module_dir
    module = importlib.import_module(name)
    original = module.kernel
    instrumentor = KernelInstrumentor()
    instrumentor.instrument(level=3, paths=[f"{name}:kernel"])
    try:
        assert sok.get_config().level == 3
        module.kernel(torch.ones(1))
        assert names(exporter) == [f"{name}.kernel"]
    finally:
        instrumentor.uninstrument()
    assert module.kernel is original


def test_opentelemetry_instrument_turns_recording_on(tmp_path):
    (tmp_path / "envmod.py").write_text(MODULE_SOURCE)
    script = tmp_path / "app.py"
    script.write_text(textwrap.dedent("""
        import torch, envmod
        import sglang_otel_kernels as sok
        envmod.kernel(torch.ones(1))
        print(sok.get_config().level, [s.name for s in sok.read_trace(sok.trace_file_path())])
    """))
    env = clean_env()
    env.update(PYTHONPATH=str(tmp_path), SGLANG_KERNEL_API_LOGDEST="off", SGLANG_KERNEL_API_INSTRUMENT="envmod:kernel",
               OTEL_TRACES_EXPORTER="none", OTEL_METRICS_EXPORTER="none", OTEL_LOGS_EXPORTER="none")
    instrument = os.path.join(os.path.dirname(sys.executable), "opentelemetry-instrument")
    proc = subprocess.run([instrument, sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip().splitlines()[-1] == "1 ['envmod.kernel']"  # level 1, set by the instrumentor
