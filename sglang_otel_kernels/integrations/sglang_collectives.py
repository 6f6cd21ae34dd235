"""SGLang's GroupCoordinator collectives as kernel spans, like
torch.distributed's (capture/collectives.py): its all-reduce (whatever path
it takes: custom all-reduce, pynccl, torch.distributed), all-gather,
reduce-scatter, all-to-all, broadcast, barrier and its send/recv of tensors,
tensor dicts and objects (pipeline parallelism). Loaded by the SGLang
integration when SGLang's parallel_state is imported (torch is there by then).
"""

from __future__ import annotations

from ..capture.collectives import Collective, Spec, learn_identity
from ..capture.decorator import wrap_hooked
from ..capture.naming import infer_api_name
from ..capture.patches import Instrumentation, Patch

# GroupCoordinator's methods and the collective each one is; ranks, peers
# and roots it takes are ranks in its group.
_COORDINATOR = (
    ("all_reduce", Spec("all_reduce", ("input_",))),
    ("_all_reduce_in_place", Spec("all_reduce", ("input_",))),  # the compiled graph's path
    ("_all_reduce_out_place", Spec("all_reduce", ("input_",))),
    ("all_gather", Spec("all_gather", ("input_",), ("output_tensor_list",))),
    ("all_gather_into_tensor", Spec("all_gather_into_tensor", ("input",), ("output",))),
    ("all_gatherv", Spec("all_gatherv", ("input_",), ("output",))),
    ("reduce_scatter", Spec("reduce_scatter", ("input_list",), ("output",))),
    ("reduce_scatter_tensor", Spec("reduce_scatter_tensor", ("input",), ("output",))),
    ("reduce_scatterv", Spec("reduce_scatterv", ("input_",), ("output",))),
    ("all_to_all_single", Spec("all_to_all_single", ("input",), ("output",))),
    ("broadcast", Spec("broadcast", ("input_",), root=(None, "src"))),
    ("barrier", Spec("barrier")),
    ("send", Spec("send", ("tensor",), peer=(None, "dst"), direction="send")),
    ("recv", Spec("recv", peer=(None, "src"), direction="recv")),
    ("send_tensor_dict", Spec("send", ("tensor_dict",), peer=(None, "dst"), direction="send")),
    ("recv_tensor_dict", Spec("recv", peer=(None, "src"), direction="recv")),
    ("send_object", Spec("send", peer=(None, "dst"), direction="send")),
    ("recv_object", Spec("recv", peer=(None, "src"), direction="recv")),
)


class CoordinatorCollective(Collective):
    """A GroupCoordinator method: its group is the coordinator itself (its
    `unique_name` and `ranks`); with one rank it communicates nothing and is
    not recorded. A send or recv without a peer goes to the next rank or
    comes from the previous one, as SGLang's do."""

    def group(self, args: tuple, kwargs: dict) -> "tuple | None":
        coordinator = args[0] if args else None
        if coordinator is None or getattr(coordinator, "world_size", 1) <= 1:
            return None
        learn_identity()
        return id(coordinator), str(coordinator.unique_name), tuple(int(rank) for rank in coordinator.ranks)

    def peer(self, args: tuple, kwargs: dict, ranks: tuple):
        peer = super().peer(args, kwargs, ranks)
        if peer is None and ranks:
            step = 1 if self.spec.direction == "send" else -1
            peer = ranks[(args[0].rank_in_group + step) % len(ranks)]
        return peer

    def inputs(self, args: tuple, kwargs: dict) -> tuple[list, list]:
        shapes, dtypes = super().inputs(args, kwargs)
        size = self.parameters.get(args, kwargs, "size")  # recv(size, dtype): the tensor it makes
        if size is not None:
            shapes.append(str(tuple(size)))
            dtypes.append(str(self.parameters.get(args, kwargs, "dtype")))
        return shapes, dtypes


def record_coordinator(coordinator: type, handle: Instrumentation) -> None:
    """Records the methods of `coordinator` (SGLang's GroupCoordinator class), named as SGLang names them."""
    for method, spec in _COORDINATOR:
        original = vars(coordinator).get(method)
        if original is not None:
            recorded = wrap_hooked(original, infer_api_name(original), CoordinatorCollective(spec, original))
            handle.add(Patch(coordinator, method, recorded))
