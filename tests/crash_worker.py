"""Kills real processes in the middle of kernel calls, for the crash tests.

    python crash_worker.py MODE TRIALS DIR SEED

Imports torch once, then for each trial forks a child that records kernel calls
into DIR/trace_<pid>.sgltrace (level 3, a request span around every 4 calls)
and dies in the way MODE names: inside the kernel of a random call (`in-*`
modes), or from outside at a random moment once its first call is recorded
(`ext-*` modes). Prints one JSON line per trial: the child's pid, how it ended,
and the call it died in.
"""

import ctypes
import json
import os
import random
import resource
import signal
import sys
import time

import torch  # noqa: F401  (imported before forking, as a server would have)

import sglang_otel_kernels as sok

IN_KERNEL = {
    "in-sigkill": lambda: os.kill(os.getpid(), signal.SIGKILL),
    "in-sigterm": lambda: os.kill(os.getpid(), signal.SIGTERM),
    "in-sigint": lambda: os.kill(os.getpid(), signal.SIGINT),
    "in-sigsegv": lambda: ctypes.string_at(0),  # a real invalid read
    "in-sigbus": lambda: os.kill(os.getpid(), signal.SIGBUS),
    "in-abort": os.abort,
    "in-exit": lambda: os._exit(7),
}
EXTERNAL = {
    "ext-sigkill": signal.SIGKILL,
    "ext-sigterm": signal.SIGTERM,
    "ext-sigsegv": signal.SIGSEGV,
    "ext-sigabrt": signal.SIGABRT,
    "ext-sigint": signal.SIGINT,
}


def child(mode: str, directory: str, die_at: int, rng: random.Random, ready: int) -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # no core files from the signals
    sok.configure(
        level=3, log_dest="off", trace_file=os.path.join(directory, "trace_%i.sgltrace"), trace_file_size=1 << 20
    )
    from opentelemetry import trace

    tracer = trace.get_tracer("crash.server")

    @sok.debug_kernel_api(op_name="sglang.custom_op.kernel")
    def kernel(x, call):
        if call == die_at and mode in IN_KERNEL:
            IN_KERNEL[mode]()
        if mode.startswith("ext-"):
            time.sleep(rng.uniform(0, 0.002))
        return x + 1

    call = 0
    while True:
        with tracer.start_as_current_span(f"Req {call // 4}"):
            for _ in range(4):
                call += 1
                kernel(torch.full((2, 3), float(call)), call=call)
                if call == 1:
                    os.write(ready, b"r")


def main() -> int:
    mode, trials, directory, seed = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    # A shell's background job starts with SIGINT ignored, and Python keeps it
    # so: the SIGINT modes then would never end. Python's own handler, always.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    rng = random.Random(seed)
    for _ in range(trials):
        die_at = rng.randint(1, 40)
        delay = rng.uniform(0.1, 0.5)
        # The clock of an outside kill starts at the child's first recorded
        # call, not at the fork: on a loaded machine, setting up can take
        # longer than the shortest delay.
        ready_r, ready_w = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(ready_r)
            code = 0
            try:
                child(mode, directory, die_at, rng, ready_w)
            except BaseException:
                code = 1
            os._exit(code)
        os.close(ready_w)
        if mode in EXTERNAL:
            os.read(ready_r, 1)  # b"" if the child ended first: the test then says how
            time.sleep(delay)
            os.kill(pid, EXTERNAL[mode])
        _, status = os.waitpid(pid, 0)
        os.close(ready_r)  # only now: the child's write must not meet a closed pipe
        ended = {"signal": os.WTERMSIG(status)} if os.WIFSIGNALED(status) else {"exit": os.WEXITSTATUS(status)}
        print(json.dumps({"pid": pid, "die_at": die_at if mode.startswith("in-") else None, **ended}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
