"""`learner.trainers.strategy`: optimizer-state bytes through the real wrappers
(accelerate's, a ZeRO-like one)."""

from __future__ import annotations

import torch
from accelerate.optimizer import AcceleratedOptimizer

from learner.trainers.strategy import _optimizer_bytes


def _stepped_adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    opt = torch.optim.AdamW(params)
    for p in params:
        p.grad = torch.ones_like(p)
    opt.step()
    return opt


def test_optimizer_state_is_counted_once_through_wrappers() -> None:
    """accelerate's wrapper exposes its inner optimizer's `state`: the bytes are the two AdamW moments (and
    the step counters) once, not once per wrapper level."""
    from accelerate import Accelerator

    Accelerator(cpu=True)  # accelerate's optimizer wrapper needs its process state
    params = [torch.nn.Parameter(torch.zeros(1000)), torch.nn.Parameter(torch.zeros(10, 10))]
    inner = _stepped_adamw(params)
    alone = _optimizer_bytes(inner)
    assert alone >= 2 * 1100 * 4  # exp_avg + exp_avg_sq in fp32
    assert _optimizer_bytes(AcceleratedOptimizer(inner, device_placement=False)) == alone


def test_fp32_master_partitions_count_as_optimizer_state() -> None:
    class ZeroLike:  # DeepSpeed's ZeRO optimizer keeps its fp32 master partition beside the torch optimizer
        def __init__(self, inner: torch.optim.Optimizer) -> None:
            self.optimizer = inner
            self.single_partition_of_fp32_groups = [torch.zeros(550)]

        @property
        def state(self):
            return self.optimizer.state

    inner = _stepped_adamw([torch.nn.Parameter(torch.zeros(550))])
    assert _optimizer_bytes(ZeroLike(inner)) == _optimizer_bytes(inner) + 550 * 4
