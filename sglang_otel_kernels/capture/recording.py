"""What recording kernel calls loads, on first use (it needs torch): the
decorator, and the hooks that register with it through its interface
(`wrap_hooked`, `watch_graphs`, `capturing`): torch.distributed's collectives
and CUDA graphs; and the exception hooks, installed when a trace file opens
(record/setup.py's `on_open`). Each follows the settings from then on.
Neither the decorator nor the record layer imports them: the layers read one
way, capture -> describe -> record."""

from . import collectives, decorator, graphs, uncaught

__all__ = ["collectives", "decorator", "graphs", "uncaught"]
