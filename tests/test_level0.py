"""Level 0 costs nothing: the very objects come back."""

import torch
from conftest import run_python

import sglang_otel_kernels as sok


def kernel(x):
    return x


def test_bare_decorator_returns_the_function():
    sok.configure(level=0)
    assert sok.debug_kernel_api(kernel) is kernel


def test_decorator_factory_returns_the_function():
    sok.configure(level=0)
    assert sok.debug_kernel_api(op_name="x")(kernel) is kernel


def test_debug_torch_op_returns_the_raw_op():
    sok.configure(level=0)
    assert sok.debug_torch_op(kernel, "relu", namespace="aten") is torch.ops.aten.relu


def test_wrap_method_leaves_the_object_alone():
    class Method:
        def apply(self, x):
            return x

    sok.configure(level=0)
    obj = Method()
    assert sok.wrap_method_with_debug_kernel_once(obj, "apply", op_name="m") is obj
    assert "apply" not in vars(obj)
    assert not hasattr(obj, "_debug_kernel_apply_wrapped")


def test_default_level_is_zero_in_a_fresh_process(tmp_path):
    script = (
        "import sglang_otel_kernels as s\n"
        "def f(): pass\n"
        "assert s.get_config().level == 0\n"
        "assert s.debug_kernel_api(f) is f\n"
        "print('ok')\n"
    )
    out = run_python(script, tmp_path)
    assert out.returncode == 0, out.stderr
    assert out.stdout == "ok\n"
    assert list(tmp_path.iterdir()) == []  # no file created at level 0
