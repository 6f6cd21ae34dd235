"""Which op and which layer, without SGLang: a recorded method given
attributes of its own (`rewrap`), the SGLang integration's naming of a
model's layers (`label_modules`: a layer's own forward, its quant method's
`apply`, never a module shared by several layers) and of fused ops' classes,
in a real process through both recording cores, read back from the trace
file; the text log stays SGLang's, line for line."""

import pytest

from conftest import run_python

PROGRAM = r"""
import os, sys, torch
import sglang_otel_kernels as sok
from sglang_otel_kernels.capture.decorator import debug_kernel_api, wrap_method_with_debug_kernel_once
from sglang_otel_kernels.capture.patches import Instrumentation
from sglang_otel_kernels.integrations import sglang as integration

class BaseFusedOp(torch.nn.Module):  # as SGLang's: one recorded forward for every op
    @debug_kernel_api
    def forward(self, x):
        return x + 1

class Module:  # stands for sglang.kernels.fused_op, whose subclasses come after it
    pass
Module.BaseFusedOp = BaseFusedOp
handle = Instrumentation("test")
integration._patch_fused_ops(handle, Module)

class RMSNorm(BaseFusedOp):
    pass

class SiluAndMul(BaseFusedOp):
    pass

class Quant:
    def apply(self, layer, x):
        return x * layer.scale

class Linear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = 2.0
        self.quant_method = Quant()
        wrap_method_with_debug_kernel_once(self.quant_method, "apply", op_name="sglang.quant_method.Quant.apply")
    def forward(self, x):
        return self.quant_method.apply(self, x)

class Layer(torch.nn.Module):
    def __init__(self, rotary):
        super().__init__()
        self.norm, self.act, self.proj, self.rotary = RMSNorm(), SiluAndMul(), Linear(), rotary
    def forward(self, x):
        return self.rotary(self.proj(self.act(self.norm(x))))

rotary = RMSNorm()  # one module shared by every layer: which layer a call serves is not known
model = torch.nn.Module()
model.layers = torch.nn.ModuleList([Layer(rotary), Layer(rotary)])
named = integration.label_modules(handle, [("model", model), ("sampler", None)])
print("named", named)
x = torch.ones(2)
for layer in model.layers:
    x = layer(x)
"""


@pytest.mark.parametrize("core", ["compiled", "python"])
def test_layers_and_fused_ops_are_named_in_the_trace_file(tmp_path, core):
    env = {"SGLANG_KERNEL_API_LOGLEVEL": "1", "SGLANG_KERNEL_API_LOGDEST": str(tmp_path / "log.txt"),
           "SGLANG_KERNEL_API_TRACEFILE": str(tmp_path / "t.sgltrace"),
           "SGLANG_KERNEL_API_NATIVE": "1" if core == "compiled" else "0"}
    proc = run_python(PROGRAM, tmp_path, env)
    assert proc.returncode == 0, proc.stderr
    assert "named 6" in proc.stdout  # per layer: norm, act, proj's quant method; not the shared rotary
    from sglang_otel_kernels.record.reader import read_trace

    calls = [(s.name.rsplit(".", 2)[-2] + "." + s.name.rsplit(".", 1)[-1], s.attributes.get("sglang.kernel.op_class"),
              s.attributes.get("sglang.kernel.module")) for s in read_trace(tmp_path / "t.sgltrace")]
    assert calls == [
        ("BaseFusedOp.forward", "RMSNorm", "model.layers.0.norm"),
        ("BaseFusedOp.forward", "SiluAndMul", "model.layers.0.act"),
        ("Quant.apply", None, "model.layers.0.proj"),
        ("BaseFusedOp.forward", "RMSNorm", None),
        ("BaseFusedOp.forward", "RMSNorm", "model.layers.1.norm"),
        ("BaseFusedOp.forward", "SiluAndMul", "model.layers.1.act"),
        ("Quant.apply", None, "model.layers.1.proj"),
        ("BaseFusedOp.forward", "RMSNorm", None),
    ], calls
    # The text log names the calls as SGLang does (a `-c` program's module is `<string>`):
    # the base's method, the quant method's op name, nothing more.
    log = [line.split("] ", 1)[1] for line in (tmp_path / "log.txt").read_text().splitlines() if "] " in line]
    fused = "SGLang Kernel API Call: <string>.BaseFusedOp.forward"
    quant = "SGLang Kernel API Call: sglang.quant_method.Quant.apply"
    assert log == [fused, fused, quant, fused, fused, fused, quant, fused], log
