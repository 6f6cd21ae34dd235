"""Where the black box's time goes at level 3, measured side by side in one run.

    python bench/describe_cost.py [--calls 2000] [--repeats 7] [--rounds 5]

The kernel call of bench/overhead.py (a 4x4096 and a 4096 float32 CPU tensor,
eps as a keyword) in the black box, with the compiled core where it is built:
at level 1 (names and times), at level 3 with two ints where the tensors go
(the call's record and its arguments' keys, no tensor), and at level 3 with
the tensors. Beside them, torch's own accessors for what the core reads of
each tensor (layout, shape, dtype, is_cpu, requires_grad, stride()), called
from C (`operator.attrgetter`, `operator.methodcaller`) as the core calls
them: no describer of a tensor through torch's Python API costs less. The
last line says how far below the black box's target (0.5x the floor row of
bench/overhead.py) that lower bound is, or how far above.
"""

from __future__ import annotations

import operator
import os
import shutil
import tempfile

import torch
from overhead import floor_wrapper, kernel, per_call_us, rounds_table, stop_recording, timing_options

import sglang_otel_kernels as sok
from sglang_otel_kernels.record import core

TARGET = 0.5  # the black box at level 3, times the floor row


def main(argv: list[str] | None = None) -> int:
    options = timing_options(__doc__, argv)
    torch.set_num_threads(1)
    tensors, ints, kwargs = (torch.randn(4, 4096), torch.randn(4096)), (1, 2), {"eps": 1e-5}
    directory = tempfile.mkdtemp(prefix="sok-describe-")
    trace_path = os.path.join(directory, "trace_%i.sgltrace")
    fields = operator.attrgetter("layout", "shape", "dtype", "is_cpu", "requires_grad")
    stride = operator.methodcaller("stride")

    def accessors(x, weight, eps=1e-6):  # a Python call, as `kernel` is: the bare call's row is taken off
        return fields(x), stride(x), fields(weight), stride(weight)

    def blackbox(level: int, args: tuple) -> float:
        sok.configure(level=level, log_dest="off", spans=True, trace_file=trace_path, blackbox=True,
                      export_sidecar=False)
        return per_call_us(sok.debug_kernel_api(kernel), args, kwargs, options.calls, options.repeats)

    def one_round() -> list[tuple[str, float]]:
        run = lambda fn, args: per_call_us(fn, args, kwargs, options.calls, options.repeats)  # noqa: E731
        rows = [("bare call", run(kernel, tensors)), ("floor: 2 records", run(floor_wrapper(kernel, directory), tensors)),
                ("black box, level 1", blackbox(1, tensors)), ("black box, level 3, two ints", blackbox(3, ints)),
                ("black box, level 3, two tensors", blackbox(3, tensors)),
                ("torch's accessors of two tensors", run(accessors, tensors))]
        stop_recording(directory)
        return rows

    try:
        us = rounds_table(one_round, options)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    bare, floor = us["bare call"], us["floor: 2 records"]
    level_3, no_tensor = us["black box, level 3, two tensors"], us["black box, level 3, two ints"]
    torch_us = us["torch's accessors of two tensors"] - bare
    ours = level_3 - no_tensor - torch_us
    least = no_tensor + torch_us
    print(f"recording core: {core.describe()}")
    print(f"the black box at level 3: {level_3 / floor:.2f}x the floor (target at most {TARGET}x); describing two "
          f"tensors {level_3 - no_tensor:.2f} us: torch's accessors {torch_us:.2f} us, ours {ours:.2f} us")
    print(f"with ours at zero, torch's accessors alone leave it at {least / floor:.2f}x the floor "
          f"({'under' if least / floor <= TARGET else 'over'} the target)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
