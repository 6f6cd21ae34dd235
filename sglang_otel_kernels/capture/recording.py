"""What recording kernel calls loads, on first use (it needs torch): the
decorator, and the hooks that register with it through its interface
(`wrap_hooked`, `watch_graphs`, `capturing`): torch.distributed's collectives
and CUDA graphs. Each follows the settings from then on. Neither the decorator
nor the record layer imports the hooks: the layers read one way, capture ->
describe -> record -> recover."""

from . import collectives, decorator, graphs

__all__ = ["collectives", "decorator", "graphs"]
