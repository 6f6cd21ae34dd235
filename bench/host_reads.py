"""Host reads of tensor values, counted where they are made: on a GPU
each is a synchronisation (the host waits for the value), so on a CPU,
where torch's sync debug mode says nothing, counting them is the stand-in
for counting synchronisations. A lower bound: what torch reads inside its
own C++ (an index given as a Python list, `nonzero`'s size) is not seen,
nor a copy to the host by `.to("cpu")` or `copy_`.

    with host_reads() as reads:       # or host_reads(refuse=True): each read raises HostRead
        kernel(x)
    reads  # ["describe/statistics.py:115: Tensor.item", ...]
"""

from __future__ import annotations

import contextlib
import os
import sys

import torch

# The Tensor methods that hand a value to the host: the conversions to Python numbers and
# containers, the copies to the CPU, and the text of a tensor (which prints its values).
READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__", "__complex__",
         "__array__", "__repr__", "__format__")


class HostRead(RuntimeError):
    """A value read to the host where none is allowed."""


def _where(frame) -> str:
    path = frame.f_code.co_filename
    parts = path.replace(os.sep, "/").split("/")
    return f"{'/'.join(parts[-2:])}:{frame.f_lineno}"


@contextlib.contextmanager
def host_reads(refuse: bool = False):
    """The reads made inside the block, as "file:line: Tensor.method" (the
    Python line that asked); with `refuse`, each read raises HostRead
    instead (and is still listed)."""
    seen: list[str] = []
    originals = {name: torch.Tensor.__dict__.get(name) for name in READS}

    def counted(name: str, original):
        def read(self, *args, **kwargs):
            seen.append(f"{_where(sys._getframe(1))}: Tensor.{name}")
            if refuse:
                raise HostRead(f"Tensor.{name} read a value to the host: {seen[-1]}")
            return original(self, *args, **kwargs)
        return read

    for name in READS:
        setattr(torch.Tensor, name, counted(name, getattr(torch.Tensor, name)))
    try:
        yield seen
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)
