"""Which data-parallel strategy a run really engaged, and what each rank holds of the model's training state.

A DeepSpeed or FSDP config can be accepted and still not take effect (a key the Trainer ignores, a world size
of one); users need the product to say what ran. `StrategyReport` is measured, not read from the config:
the engine class, the ZeRO stage the optimizer reports, and the bytes of parameters, gradients and optimizer
state resident on this rank after the first optimizer step (ZeRO-3 partitions included, fp32 master copies
counted as optimizer state, as DeepSpeed's memory estimator does).
"""

from __future__ import annotations

import logging
from dataclasses import asdict, dataclass
from typing import Any

import torch
from transformers import TrainerCallback

__all__ = ["StrategyCallback", "StrategyReport", "measure_strategy"]

logger = logging.getLogger(__name__)

_FP32_MASTER_ATTRS = ("single_partition_of_fp32_groups", "fp32_partitioned_groups_flat")
"""DeepSpeed ZeRO optimizers' fp32 master partitions (stage 1/2, stage 3)."""


@dataclass(frozen=True)
class StrategyReport:
    """One rank's view (bytes are this rank's resident tensors).

    Attributes:
        strategy: `single`, `ddp`, `zero1`, `zero2`, `zero3` or `fsdp`.
        world_size: processes in the data-parallel group.
        rank: this process's rank.
        param_bytes: model parameters resident here (ZeRO-3: this rank's partitions).
        grad_bytes: gradient storage this rank holds during a step (full size under DDP; ZeRO-2/3: this
            rank's fp32 partition).
        optimizer_state_bytes: optimizer state tensors plus fp32 master partitions.
    """

    strategy: str
    world_size: int
    rank: int
    param_bytes: int
    grad_bytes: int
    optimizer_state_bytes: int

    def line(self) -> str:
        gib = 1024**3
        return (
            f"rank {self.rank}/{self.world_size}: {self.strategy}, parameters {self.param_bytes / gib:.3f}"
            f" GiB, gradients {self.grad_bytes / gib:.3f} GiB, optimizer state"
            f" {self.optimizer_state_bytes / gib:.3f} GiB"
        )


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors(v)]
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _tensor_bytes(value: Any) -> int:
    return sum(t.numel() * t.element_size() for t in _tensors(value))


def _optimizer_bytes(optimizer: Any) -> int:
    """Distinct tensors of the optimizer state through accelerate's and DeepSpeed's wrappers (each wrapper's
    `state` is its inner optimizer's: counted once, by storage) plus DeepSpeed's fp32 master partitions."""
    found: dict[tuple[int, int], int] = {}
    seen: set[int] = set()
    while optimizer is not None and id(optimizer) not in seen:
        seen.add(id(optimizer))
        candidates = [getattr(optimizer, attr, None) for attr in _FP32_MASTER_ATTRS]
        state = getattr(optimizer, "state", None)
        if isinstance(state, dict):
            candidates.extend(state.values())
        for tensor in _tensors(candidates):
            if tensor.numel():
                found[(tensor.data_ptr(), tensor.numel())] = tensor.numel() * tensor.element_size()
        optimizer = getattr(optimizer, "optimizer", None)
    return sum(found.values())


def _zero_stage(engine: Any) -> int | None:
    getter = getattr(engine, "zero_optimization_stage", None)
    return int(getter()) if callable(getter) else None


def measure_strategy(trainer: Any) -> StrategyReport:
    """The strategy and this rank's training-state bytes of a Trainer that has taken at least one step."""
    import torch.distributed as dist

    world = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    rank = dist.get_rank() if world > 1 else 0
    wrapped = getattr(trainer, "model_wrapped", trainer.model)
    stage = _zero_stage(wrapped)
    if stage is not None:
        strategy = f"zero{stage}" if stage > 0 else "ddp"
    elif type(wrapped).__name__ == "FullyShardedDataParallel" or getattr(trainer, "is_fsdp_enabled", False):
        strategy = "fsdp"
    else:
        strategy = "ddp" if world > 1 else "single"
    params = list(trainer.model.parameters())
    # ZeRO-3 replaces each parameter's data by an empty placeholder and keeps this rank's slice in ds_tensor.
    param_bytes = sum(_tensor_bytes(p.ds_tensor if hasattr(p, "ds_tensor") else p) for p in params)
    trainable = sum(p.ds_numel if hasattr(p, "ds_numel") else p.numel() for p in params if p.requires_grad)
    if stage is not None and stage >= 2:
        grad_bytes = trainable * 4 // world  # fp32 gradient partitions (DeepSpeed keeps them per rank)
    else:  # one full-size gradient per trainable parameter during backward (freed again by zero_grad)
        grad_bytes = sum(p.numel() * p.element_size() for p in params if p.requires_grad)
    return StrategyReport(strategy, world, rank, param_bytes, grad_bytes, _optimizer_bytes(trainer.optimizer))


class StrategyCallback(TrainerCallback):
    """After the first optimizer step: every rank measures itself, rank 0 logs one line per rank and the run's
    first log record carries `dist/*` values (strategy code, world size, rank 0's and the largest rank's
    bytes)."""

    STRATEGY_CODES = {"single": 0, "ddp": 1, "zero1": 2, "zero2": 3, "zero3": 4, "fsdp": 5}

    def __init__(self, trainer: Any = None) -> None:
        self.trainer = trainer  # set once the Trainer exists (it takes its callbacks at construction)
        self.reports: list[StrategyReport] = []
        self._pending: dict[str, float] = {}

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.reports or self.trainer is None:
            return
        import torch.distributed as dist

        mine = measure_strategy(self.trainer)
        if mine.world_size > 1:
            gathered: list[Any] = [None] * mine.world_size
            dist.all_gather_object(gathered, asdict(mine))
            self.reports = [StrategyReport(**g) for g in gathered]
        else:
            self.reports = [mine]
        if state.is_world_process_zero:
            logger.info("training strategy (measured after step 1): %s", mine.strategy)
            for report in self.reports:
                logger.info("  %s", report.line())
            first = self.reports[0]
            self._pending = {
                "dist/strategy_code": float(self.STRATEGY_CODES[first.strategy]),
                "dist/world_size": float(first.world_size),
                "dist/param_bytes_rank0": float(first.param_bytes),
                "dist/grad_bytes_rank0": float(first.grad_bytes),
                "dist/optimizer_state_bytes_rank0": float(first.optimizer_state_bytes),
                "dist/optimizer_state_bytes_max": float(max(r.optimizer_state_bytes for r in self.reports)),
            }

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if self._pending and logs is not None and "loss" in logs:
            logs.update(self._pending)
            self._pending = {}
