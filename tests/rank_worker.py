"""One rank of a job on the gloo backend, for the multi-rank tests.

    python rank_worker.py RANK WORLD PORT SCENARIO STEPS [FAULT_STEP]

Like an SGLang scheduler process, it is given its rank as an argument (no
RANK variable) and initialises torch.distributed itself. Each step runs two
kernels (`layer.attn`, `layer.mlp`) and an all-reduce, inside a batch span
of two requests keyed by the step (so every rank's kernels of a step share
one trace); `pipeline` scenarios instead receive from the previous rank and
send to the next. STEPS 0 runs until killed. At step FAULT_STEP (5 unless
given) the fault rank misbehaves as SCENARIO says:

    healthy    nothing
    stuck      rank 2 never returns from the kernel layer.stuck
    abort      rank 2 aborts (SIGABRT) inside the kernel layer.boom
    mismatch   rank 3 all-reduces a tensor of another shape
    pipeline   rank 2 stops receiving (it believes there are fewer micro-batches) and idles
    blocked    rank 2 blocks outside any decorated call, on a lock never released
    frozen     rank 2 holds the GIL in C code (a foreign call that does not release it): no Python runs
"""

import ctypes
import datetime
import os
import sys
import threading
import time

import torch
import torch.distributed as dist

import sglang_otel_kernels as sok

CARRIERS = [("00-" + "a1" * 16 + "-" + "b1" * 8 + "-01", "req-1"), ("00-" + "a2" * 16 + "-" + "b2" * 8 + "-01", "req-2")]


@sok.debug_kernel_api(op_name="layer.attn")
def attn(x):
    return x * 1.0


@sok.debug_kernel_api(op_name="layer.mlp")
def mlp(x):
    return x + 1.0


@sok.debug_kernel_api(op_name="layer.stuck")
def stuck(x):
    while True:  # as a kernel spinning on a flag that never comes
        time.sleep(0.05)


@sok.debug_kernel_api(op_name="layer.boom")
def boom(x):
    os.abort()  # as an illegal memory access takes the process down


def wait_for_nothing():
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()  # as on a lock another thread never releases


def hold_the_gil():
    ctypes.PyDLL(None).sleep(600)  # PyDLL keeps the GIL through the call


def step(rank: int, world: int, number: int, scenario: str, fault_step: int) -> None:
    faulty = number == fault_step
    if scenario == "pipeline":
        buffer = torch.zeros(4)
        if rank > 0:
            if faulty and rank == 2:
                while True:  # idle: no call in flight
                    time.sleep(0.05)
            dist.recv(buffer, rank - 1)
        x = mlp(attn(buffer))
        if rank < world - 1:
            dist.send(x, rank + 1)
        return
    with sok.forward_batch(CARRIERS, name="decode_batch", batch_key=number):
        x = attn(torch.ones(4))
        if faulty and rank == 2 and scenario == "stuck":
            stuck(x)
        if faulty and rank == 2 and scenario == "abort":
            boom(x)
        x = mlp(x)
        if faulty and rank == 2 and scenario == "blocked":
            wait_for_nothing()
        if faulty and rank == 2 and scenario == "frozen":
            hold_the_gil()
        if faulty and rank == 3 and scenario == "mismatch":
            x = torch.ones(8)
        dist.all_reduce(x)


def main() -> int:
    rank, world, port, scenario, steps = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
    fault_step = int(sys.argv[6]) if len(sys.argv) > 6 else 5
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=600))
    print(f"rank {rank} {sok.trace_file_path()}", flush=True)
    number = 0
    while steps == 0 or number < steps:
        number += 1
        step(rank, world, number, scenario, fault_step)
        time.sleep(0.01)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
