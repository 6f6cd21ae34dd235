"""Who this process is among the ranks of a job, as far as it is known now.

SGLang starts its scheduler processes with `mp.Process(..., tp_rank=...)` and
sets no `RANK`, so the environment alone says nothing on a multi-GPU server.
The ranks come, in order of trust, from torch.distributed once it is
initialised (`rank`, `world_size`, and `job`: its rendezvous, which tells two
jobs' files apart), from SGLang's scheduler through the integration
(`tp_rank`, `pp_rank`, `dp_rank`, `ep_rank`, `attn_tp_rank`, `attn_dp_rank`),
else from `RANK`, `LOCAL_RANK`, `WORLD_SIZE`, `LOCAL_WORLD_SIZE`. Whoever
learns one calls `update`; listeners (the trace file, the resource of the
provider this package made) follow. Torch-free.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Mapping

ENV_RANKS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")
# What goes onto the resource, as `sglang.<key>`.
RESOURCE_KEYS = ("rank", "local_rank", "world_size", "local_world_size", "tp_rank", "pp_rank", "dp_rank",
                 "ep_rank", "attn_tp_rank", "attn_dp_rank", "job")


def from_env(environ: Mapping[str, str] = os.environ) -> dict[str, Any]:
    """The ranks torchrun and similar launchers export; a value that is not
    a number is kept as text."""
    values: dict[str, Any] = {}
    for key in ENV_RANKS:
        raw = environ.get(key, "").strip()
        if raw:
            values[key.lower()] = int(raw) if raw.isdigit() else raw
    return values


_values: dict[str, Any] = from_env()
_listeners: list[Callable[[dict], None]] = []


def known() -> dict[str, Any]:
    """The ranks known now (a copy)."""
    return dict(_values)


def value(key: str) -> Any:
    """One rank (or `job`) known now, or None."""
    return _values.get(key)


def update(**values: Any) -> None:
    """Adds or changes ranks (None values are ignored); listeners hear of a change."""
    changed = {key: value for key, value in values.items() if value is not None and _values.get(key) != value}
    if not changed:
        return
    _values.update(changed)
    for listener in list(_listeners):
        listener(dict(_values))


def on_change(listener: Callable[[dict], None]) -> None:
    _listeners.append(listener)


def resource_attributes(values: Mapping[str, Any]) -> dict[str, Any]:
    """`sglang.<key>` attributes of the ranks a resource carries."""
    return {f"sglang.{key}": values[key] for key in RESOURCE_KEYS if key in values}


def _after_fork_in_child() -> None:
    # A forked child is no rank of its parent's job (its process groups do
    # not work there): it keeps what its environment says, nothing learnt.
    global _values
    _values = from_env()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
