"""Which request of a batch a failed call's bad input came from, where the
op lets that be told cheaply: an index beyond the rows of the table it
indexes (an out-of-vocabulary token id given to an embedding), or a count
per request beyond what the op can give (more top logprobs than the
vocabulary has tokens).

Asked only once the call has raised, so a call that succeeds pays nothing
(beyond the try its caller sets). The bad rows are mapped to the requests of
the running batch (record/batches.py), and the finding rides on the
exception (`explained`) to the call's span, which ends with it:
`sglang.kernel.culprit_requests` and `sglang.kernel.culprit`. On a GPU an
out-of-range id is a device-side assert, raised later and with the context
lost: nothing is read there, and no culprit is named.
"""

from __future__ import annotations

from typing import Sequence

import torch

from ..record import batches
from ..schema import CULPRIT, CULPRIT_REQUESTS

EXPLAINED = "_sglang_otel_kernels_explained"  # the attribute of an exception holding its span's added attributes
MAX_CULPRITS = 16


def out_of_range(exc: BaseException, indices, table, what: str) -> None:
    """`indices` (integer, leading dimension one per token or per request)
    indexed the rows of tensor `table` (`what`, in words) and the call raised
    `exc`: the requests whose rows hold an id outside the table are noted on
    `exc`. Its caller guards it: an explanation never replaces the call's own
    exception."""
    if indices.device.type != "cpu" or indices.is_floating_point():
        return  # an accelerator's tensor after a device error cannot be read
    rows = table.shape[0]
    flat = indices.detach().reshape(indices.shape[0], -1)
    bad = ((flat < 0) | (flat >= rows)).any(dim=1)
    where = torch.nonzero(bad).flatten().tolist()
    if where:
        first = flat[where[0]]
        value = int(first[(first < 0) | (first >= rows)][0])
        _note(exc, where, indices.shape[0], f"id {value} (row {where[0]} of {indices.shape[0]}) is outside the "
                                            f"{rows} rows of {what}")


def more_than(exc: BaseException, counts: Sequence[int], limit: int, what: str, of: str) -> None:
    """`counts` (one per request: `what` each asked for) met an op that has
    `limit` of them (`of`, in words) and the call raised `exc`: the requests
    that asked for more are noted on `exc`. Guarded by its caller, as above."""
    where = [row for row, count in enumerate(counts) if count > limit]
    if where:
        _note(exc, where, len(counts), f"{what} {counts[where[0]]} (row {where[0]} of {len(counts)}) is more than "
                                       f"the {limit} {of}")


def _note(exc: BaseException, rows: list, leading: int, why: str) -> None:
    """`why` on `exc`, with the requests of the running batch owning `rows`
    of a tensor whose leading dimension is `leading`."""
    batch = batches.current()
    owners = None if batch is None else batch.owners(leading, rows)
    found = {CULPRIT: why}
    if owners:
        found[CULPRIT_REQUESTS] = tuple(owners[:MAX_CULPRITS])
    setattr(exc, EXPLAINED, found)


def explained(exc: BaseException) -> "dict | None":
    """The attributes `out_of_range` or `more_than` noted on `exc`, if any."""
    found = getattr(exc, EXPLAINED, None)
    return found if isinstance(found, dict) else None
