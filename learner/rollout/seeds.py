"""Per-request rollout seeds (docs/ALGORITHM.md#seeds).

``seed = (training.seed + global_step * 1_000_003 + micro_idx * 10_007 + request_index) & 0x7FFFFFFF`` with
``request_index = dp_rank * per_device_batch_size + i``. The config keeps the seeds of one optimizer step
collision-free (``learner.training_config``: ``world_size * per_device_batch_size <= 10_007`` and
``gradient_accumulation_steps <= 99``).
"""

from __future__ import annotations

from collections.abc import Callable

from learner.training_config import MAX_REQUESTS_PER_MICRO_STEP
from shared_schemas.infer import SEED_MASK

__all__ = ["MICRO_STRIDE", "SEED_MASK", "STEP_STRIDE", "request_index", "request_seed", "stage2_seed_plan"]

STEP_STRIDE = 1_000_003
"""Seed distance between two optimizer steps (stage-2 and GRPO alike): room for
`learner.training_config.MAX_GAS` micro-steps."""
MICRO_STRIDE = MAX_REQUESTS_PER_MICRO_STEP
"""Seed distance between two micro-steps of one accumulation window: room for every request of one."""


def request_index(dp_rank: int, per_device_batch_size: int, i: int) -> int:
    """Global index of the ``i``-th request of rank ``dp_rank``'s micro-batch."""
    if not 0 <= i < per_device_batch_size:
        raise ValueError(f"request position {i} is outside the micro-batch of size {per_device_batch_size}")
    return dp_rank * per_device_batch_size + i


def request_seed(base_seed: int, global_step: int, micro_idx: int, request_index: int) -> int:
    """Seed of one rollout request (31-bit, non-negative).

    Args:
        base_seed: ``training.seed``.
        global_step: optimizer step counter.
        micro_idx: index of the micro-batch within the accumulation window (0..gas−1; 0 in evaluation).
        request_index: global request index (``request_index(...)``; the sample's index in evaluation).
    """
    return (base_seed + global_step * STEP_STRIDE + micro_idx * MICRO_STRIDE + request_index) & SEED_MASK


def stage2_seed_plan(seed: int) -> Callable[[int], str]:
    """Stage-2 trainer's seed plan line for `WeightSyncPolicy(seed_plan=...)` (`request_seed`)."""

    def plan(global_step: int) -> str:
        base = request_seed(seed, global_step, 0, 0)
        return (
            f"seed plan: training.seed {seed} + step {global_step} x {STEP_STRIDE}"
            f" + micro x {MICRO_STRIDE} + request index (step base {base})"
        )

    return plan
