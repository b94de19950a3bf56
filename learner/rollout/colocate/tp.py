"""Tensor-parallel groups of a colocated vLLM engine (docs/ALGORITHM.md#offload).

With `rollout.vllm.tensor_parallel_size = tp > 1`, the learner's ranks form consecutive groups of `tp` ranks;
each group shares ONE engine whose TP workers run on the group's GPUs. vLLM's SPMD `external_launcher` mode
(every torchrun rank holding one TP shard) needs vLLM's synchronous in-process engine core, while `VllmEngine`
wraps `AsyncLLM`, whose engine core always runs in its own process — so the group's first rank (the leader)
hosts the engine, with its TP workers placed on the group's devices. Per rollout the requests of the group are
all-gathered, the leader generates the full list, every rank of the group receives the full list and keeps its
own slice. Only leaders apply weight updates.

`tp_layout` is pure (unit-tested); `TpGroup` wraps the `torch.distributed` collectives.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from learner.yaml_loader import ConfigError

__all__ = ["TpGroup", "TpLayout", "current_cuda_device", "engine_device_env", "tp_layout"]


@dataclass(frozen=True)
class TpLayout:
    """Where one rank sits among the TP groups.

    Attributes:
        world_size: learner processes.
        tp: ranks per group.
        rank: this process's global rank.
        group_index: which group (0-based).
        members: global ranks of this rank's group, leader first.
    """

    world_size: int
    tp: int
    rank: int
    group_index: int
    members: tuple[int, ...]

    @property
    def leader(self) -> int:
        """Global rank hosting the group's engine."""
        return self.members[0]

    @property
    def is_leader(self) -> bool:
        """Whether this rank hosts the engine."""
        return self.rank == self.leader

    @property
    def group_rank(self) -> int:
        """Position of this rank inside its group."""
        return self.rank - self.leader

    @property
    def groups(self) -> list[tuple[int, ...]]:
        """Every group's members, in group order (all ranks create the groups in this order)."""
        return [tuple(range(g * self.tp, (g + 1) * self.tp)) for g in range(self.world_size // self.tp)]


def tp_layout(world_size: int, tp: int, rank: int) -> TpLayout:
    """The TP group of `rank`: consecutive blocks of `tp` ranks.

    Raises:
        ConfigError: `tp` does not divide `world_size` (names `rollout.vllm.tensor_parallel_size`).
    """
    if tp < 1 or world_size < 1 or world_size % tp:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size {tp} must divide the learner world size {world_size}; pick a"
            " divisor of the number of training processes"
        )
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside the world of size {world_size}")
    group = rank // tp
    return TpLayout(world_size, tp, rank, group, tuple(range(group * tp, (group + 1) * tp)))


class TpGroup:
    """The `torch.distributed` collectives of one TP group (every rank constructs it, in the same order).

    Args:
        layout: this rank's layout (`tp > 1`); the default process group must be initialized.
    """

    def __init__(self, layout: TpLayout) -> None:
        import torch.distributed as dist

        if not dist.is_initialized():
            raise ConfigError(
                f"rollout.vllm.tensor_parallel_size {layout.tp} > 1 needs a distributed learner (torchrun);"
                " use tensor_parallel_size 1 in a single process"
            )
        self.layout = layout
        handle = None
        for members in layout.groups:  # new_group is collective: every rank creates every group
            group = dist.new_group(list(members))
            if layout.rank in members:
                handle = group
        self._group = handle

    def gather(self, obj: Any) -> list[Any]:
        """Every member's `obj`, in member order (picklable objects; use JSON-able dumps)."""
        import torch.distributed as dist

        out: list[Any] = [None] * self.layout.tp
        dist.all_gather_object(out, obj, group=self._group)
        return out

    def broadcast(self, obj: Any) -> Any:
        """The leader's `obj` on every member."""
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=self.layout.leader, group=self._group)
        return box[0]

    def device_env(self) -> dict[str, str]:
        """`CUDA_VISIBLE_DEVICES` for the leader's engine: the devices of the group's ranks (collective)."""
        return engine_device_env(self.gather(current_cuda_device()))


def current_cuda_device() -> int | None:
    """This rank's CUDA device index, or None on CPU."""
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def engine_device_env(devices: list[int | None], visible: str | None = None) -> dict[str, str]:
    """`CUDA_VISIBLE_DEVICES` placing an engine's workers on `devices` (this process's device indices).

    Indices are mapped through this process's `CUDA_VISIBLE_DEVICES` (engine processes inherit the variable
    at spawn, so it must name physical ids). Empty on CPU (any None).

    Args:
        devices: device index per engine worker (the TP group's ranks' current devices).
        visible: the variable's current value (default: read from the environment).
    """
    if not devices or any(d is None for d in devices):
        return {}
    if visible is None:
        # Read here, not in a launcher: the mapping is only known once each rank has picked its device.
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    physical = [part.strip() for part in visible.split(",")] if visible else None
    ids = [physical[d] if physical is not None else str(d) for d in devices if d is not None]
    return {"CUDA_VISIBLE_DEVICES": ",".join(ids)}
