"""What recording a collective costs, against a level-1 kernel span, in one run.

    python bench/collective_cost.py [--calls 2000] [--repeats 7] [--rounds 5]

A one-rank gloo process group (real: torch.distributed initialised, the
group resolved as in any call). Rows, each the median of its repeats, the
table measured `--rounds` times and each row reported as its median over
them (this machine slows down now and then):

  - a no-op kernel, bare and recorded at level 1 (the trace file, no text,
    no export): the kernel span's cost;
  - a no-op with all_reduce's signature, bare and recorded as
    `torch.distributed.all_reduce` (group, ranks, per-group number, shapes,
    dtypes, async_op, reduce op: every attribute a collective carries at
    level 1): the collective's recording cost alone;
  - the same for a point-to-point send (its peer and per-peer number).

(torch.distributed.all_reduce itself on a one-rank gloo group takes 40 to 75
us here from one timing to the next: too noisy to see a few microseconds in,
so the recording is timed around no-ops with the same signatures.)

The ratio printed last is a collective's recording cost over a kernel span's.
"""

from __future__ import annotations

import shutil
import socket

import torch
import torch.distributed as dist
from overhead import per_call_us, recording_at_level_1, rounds_table, timing_options

import sglang_otel_kernels as sok


def noop(*args, **kwargs):
    return None


def all_reduce_shaped(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
    return None


def send_shaped(tensor, dst=None, group=None, tag=0, group_dst=None):
    return None


def main(argv: list[str] | None = None) -> int:
    options = timing_options(__doc__, argv)

    directory = recording_at_level_1("sok-collective-")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        rendezvous = probe.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{rendezvous}", rank=0, world_size=1)

    from sglang_otel_kernels.capture.collectives import SPECS, TorchCollective
    from sglang_otel_kernels.capture.decorator import wrap_hooked

    kernel = sok.debug_kernel_api(op_name="bench.kernel")(noop)
    collective = wrap_hooked(all_reduce_shaped, "torch.distributed.all_reduce",
                                 TorchCollective(SPECS["all_reduce"], all_reduce_shaped))
    point_to_point = wrap_hooked(send_shaped, "torch.distributed.send", TorchCollective(SPECS["send"], send_shaped))
    x = torch.ones(4, 4096)
    run = lambda fn, *args: per_call_us(fn, args, {}, options.calls, options.repeats)  # noqa: E731

    def one_round() -> list[tuple[str, float]]:
        return [("no-op, bare", run(noop, x)), ("no-op, level-1 kernel span", run(kernel, x)),
                ("all_reduce-shaped no-op, bare", run(all_reduce_shaped, x)),
                ("all_reduce-shaped no-op, recorded", run(collective, x)),
                ("send-shaped no-op, bare", run(send_shaped, x, 0)),
                ("send-shaped no-op, recorded", run(point_to_point, x, 0))]

    us = rounds_table(one_round, options)
    dist.destroy_process_group()
    sok.configure(level=0, trace_file="off")
    shutil.rmtree(directory, ignore_errors=True)
    span = us["no-op, level-1 kernel span"] - us["no-op, bare"]
    collective_cost = us["all_reduce-shaped no-op, recorded"] - us["all_reduce-shaped no-op, bare"]
    p2p = us["send-shaped no-op, recorded"] - us["send-shaped no-op, bare"]
    print(f"level-1 kernel span: {span:.2f} us; a collective: {collective_cost:.2f} us "
          f"({collective_cost / span:.2f}x the kernel span); a send: {p2p:.2f} us ({p2p / span:.2f}x)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
