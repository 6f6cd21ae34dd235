"""One rank of a tensor-parallel job built by SGLang's own code (the
published wheel), for tests/test_sglang_real.py:

    python sglang_ranks.py RANK WORLD PORT

Its ranks are published as SGLang's scheduler process does (in its
ParallelContext; no RANK variable), its process groups built by SGLang's
`init_distributed_environment` on the gloo backend, and each step runs a
kernel under SGLang's own `debug_kernel_api` and the world group's
GroupCoordinator collectives: all_reduce, all_gather, barrier, broadcast and
a send from rank 0 to rank 1. At step 3, rank 1 never returns from the
kernel `stuck`, and rank 0 waits for it in the all-reduce.
"""

import sys
import time

import torch

from sglang.kernels.kernel_api_logging import debug_kernel_api
from sglang.srt.distributed import parallel_state
from sglang.srt.runtime_context import get_parallel


@debug_kernel_api
def layer(x):
    return x + 1


@debug_kernel_api
def stuck(x):
    while True:
        time.sleep(0.05)


def main() -> int:
    rank, world, port = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    get_parallel().override_permanently(tp_rank=rank, pp_rank=0, attn_tp_rank=rank, attn_dp_rank=0)
    parallel_state.init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo",
                                                distributed_init_method=f"tcp://127.0.0.1:{port}")
    group = parallel_state.get_world_group()
    for step in range(1, 6):
        x = layer(torch.ones(4))
        if step == 3 and rank == 1:
            stuck(x)
        group.all_reduce(x)
        group.all_gather(x, dim=0)
        group.barrier()
        group.broadcast(x, src=0)
        if rank == 0:
            group.send(x, dst=1)
        elif rank == 1:
            group.recv(x.shape, x.dtype, src=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
