"""What recording costs one decode step of SGLang's tiny Llama, in-process:
the calls and arguments a level-3 trace file of the real server shows for a
step (24 kernel calls, 64 tensors, 18 objects: linear layers, attention
layers, ForwardBatch, the sampler's inputs; 6 tuples of two tensors that
norms and the rotary embedding return), made with plain stand-ins, so
that the recording path is measured without a server's noise.

    python bench/decode_step.py [--rounds 5] [--steps 400] [--cooled]

Each setting runs in a process of its own (the level is fixed when a kernel
is decorated), the settings alternating round by round; prints the median
microseconds a step. "objects None" passes None where the step passes an
object: what describing the objects costs is the difference. `--cooled`:
between steps (untimed) an 8 MB tensor is written and 3000 small dicts are
read, as a model's step leaves the caches; on the real server the black
box's calls cost several times their warm figure.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile

SETTINGS = {  # name -> (level, black box, objects passed)
    "level 0": (0, False, True),
    "black box": (1, True, True),
    "level 1": (1, False, True),
    "level 3": (3, False, True),
    "black box 3": (3, True, True),
    "level 3, objects None": (3, False, False),
}

STEP = r"""
import dataclasses, enum, os, statistics, sys, time, torch
import sglang_otel_kernels as sok

level, blackbox, with_objects, steps, directory = int(sys.argv[1]), sys.argv[2] == "1", sys.argv[3] == "1", \
    int(sys.argv[4]), sys.argv[5]
cooled = sys.argv[6] == "1"
torch.set_num_threads(1)
sok.configure(level=level, log_dest="off", trace_file=os.path.join(directory, "t_%i.sgltrace"), blackbox=blackbox)

class ForwardMode(enum.IntEnum):
    DECODE = 1

@dataclasses.dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    seq_lens: torch.Tensor

class Linear(torch.nn.Module):
    def __init__(self, input_size, output_size, prefix):
        super().__init__()
        self.input_size, self.output_size, self.prefix = input_size, output_size, prefix
        self.weight = torch.nn.Parameter(torch.ones(output_size, input_size))

class RadixAttention(torch.nn.Module):
    def __init__(self, layer_id):
        super().__init__()
        self.layer_id, self.head_dim = layer_id, 16

class SamplingBatchInfo:
    def __init__(self):
        self.device, self.temperatures = "cpu", torch.ones(1, 1)

class LogitsProcessorOutput:
    def __init__(self):
        self.next_token_logits = torch.ones(1, 320)

batch = ForwardBatch(ForwardMode.DECODE, 1, torch.ones(1))
linears = [Linear(64, 192, f"model.layers.{n}.self_attn.qkv_proj") for n in range(2)] + \
    [Linear(64, 64, f"model.layers.{n}.self_attn.o_proj") for n in range(2)] + \
    [Linear(64, 256, f"model.layers.{n}.mlp.gate_up_proj") for n in range(2)] + \
    [Linear(128, 64, f"model.layers.{n}.mlp.down_proj") for n in range(2)]
attention = [RadixAttention(n) for n in range(2)]
embedding_layer, head = Linear(320, 64, "model.embed_tokens"), Linear(64, 320, "lm_head")
sampling, logits_output = SamplingBatchInfo(), LogitsProcessorOutput()
x, ids = torch.ones(1, 64), torch.ones(1, dtype=torch.long)

linear = sok.debug_kernel_api(op_name="sglang.quant_method.UnquantizedLinearMethod.apply")(lambda layer, x, bias=None: x)
fused = sok.debug_kernel_api(op_name="kernels.fused_op.BaseFusedOp.forward")(lambda a, b, c=None: a)
# A norm with its residual, a rotary embedding: the six tuples of two tensors a step returns.
paired = sok.debug_kernel_api(op_name="kernels.fused_op.BaseFusedOp.forward")(lambda a, b, c=None: (a, b))
attend = sok.debug_kernel_api(op_name="srt.layers.attention.base_attn_backend.AttentionBackend.forward")(
    lambda q, k, v, layer, batch, save: q)
embed = sok.debug_kernel_api(op_name="sglang.quant_method.UnquantizedEmbeddingMethod.embedding")(lambda layer, ids: x)
logits = sok.debug_kernel_api(op_name="srt.layers.logits_processor.LogitsProcessor.forward")(
    lambda ids, hidden, head, batch, aux=None: x)
sample = sok.debug_kernel_api(op_name="srt.layers.sampler.Sampler.forward")(lambda output, info, a, b, c: ids)
given = (lambda value: value) if with_objects else (lambda value: None)

def step():
    embed(given(embedding_layer), ids)
    for n in range(2):
        (paired if n else fused)(x, x, x)
        linear(given(linears[n]), x, bias=None)
        paired(x, x)
        attend(x, x, x, given(attention[n]), given(batch), True)
        linear(given(linears[2 + n]), x, bias=None)
        paired(x, x, x)
        linear(given(linears[4 + n]), x, bias=None)
        fused(x, x)
        linear(given(linears[6 + n]), x, bias=None)
    paired(x, x, x)
    logits(ids, x, given(head), given(batch), None)
    sample(given(logits_output), given(sampling), False, None, None)

big, small = torch.ones(1 << 21), [{"a": i, "b": str(i)} for i in range(21000)]

def cool():
    big.add_(1.0)
    for item in small[::7]:
        item.get("a")

def timed():
    total, clock = 0, time.perf_counter_ns
    for _ in range(steps):
        if cooled:
            cool()
        began = clock()
        step()
        total += clock() - began
    return total / steps / 1e3

step()
step()  # each kernel's first call, and each type's, goes through Python
print(statistics.median(timed() for _ in range(7)))
sok.configure(level=0, trace_file="off")
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="runs of every setting, alternating")
    parser.add_argument("--steps", type=int, default=400, help="decode steps a timing")
    parser.add_argument("--cooled", action="store_true", help="the caches cooled between steps, untimed")
    options = parser.parse_args()
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    times: dict[str, list[float]] = {name: [] for name in SETTINGS}
    for _ in range(options.rounds):
        for name, (level, blackbox, objects) in SETTINGS.items():
            with tempfile.TemporaryDirectory() as directory:
                proc = subprocess.run([sys.executable, "-c", STEP, str(level), str(int(blackbox)), str(int(objects)),
                                       str(options.steps), directory, str(int(options.cooled))], env=env, capture_output=True, text=True,
                                      check=True)
            times[name].append(float(proc.stdout.split()[-1]))
    print(f"{'setting':24s} {'us a step':>10s}")
    for name, values in times.items():
        print(f"{name:24s} {statistics.median(values):10.1f}")


if __name__ == "__main__":
    main()
