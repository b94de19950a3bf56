"""Per-request rollout seeds (docs/ALGORITHM.md#seeds).

``seed = (training.seed + global_step * 1_000_003 + micro_idx * 10_007 + request_index) & 0x7FFFFFFF`` with
``request_index = dp_rank * per_device_batch_size + i``. ``check_seed_layout`` is the config guard that keeps
the seeds of one optimizer step collision-free: ``dp_world_size * per_device_batch_size <= 10_007`` and
``gas <= 99``.
"""

from __future__ import annotations

from collections.abc import Callable

from shared_schemas.infer import SEED_MASK

__all__ = [
    "MAX_GAS",
    "MAX_REQUESTS_PER_MICRO_STEP",
    "MICRO_STRIDE",
    "SEED_MASK",
    "STEP_STRIDE",
    "check_seed_layout",
    "request_index",
    "request_seed",
    "stage2_seed_plan",
]

STEP_STRIDE = 1_000_003
"""Seed distance between two optimizer steps (stage-2 and GRPO alike)."""
MICRO_STRIDE = 10_007
"""Seed distance between two micro-steps of one accumulation window."""
MAX_REQUESTS_PER_MICRO_STEP = MICRO_STRIDE
"""Requests of one micro-step over all ranks before their seeds run into the next micro-step's."""
MAX_GAS = 99
"""Micro-steps per optimizer step before their seeds run into the next step's (99 × 10_007 < 1_000_003)."""


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


def check_seed_layout(dp_world_size: int, per_device_batch_size: int, gas: int) -> None:
    """Reject layouts whose seeds could collide within one optimizer step.

    Raises:
        ValueError: naming the offending values and the limit.
    """
    if dp_world_size < 1 or per_device_batch_size < 1 or gas < 1:
        raise ValueError(
            f"dp_world_size {dp_world_size}, per_device_batch_size {per_device_batch_size} and gas {gas} "
            "must all be >= 1"
        )
    if dp_world_size * per_device_batch_size > MAX_REQUESTS_PER_MICRO_STEP:
        raise ValueError(
            f"dp_world_size {dp_world_size} * per_device_batch_size {per_device_batch_size} = "
            f"{dp_world_size * per_device_batch_size} > {MAX_REQUESTS_PER_MICRO_STEP}: per-request rollout "
            "seeds would collide; lower the per-device batch size"
        )
    if gas > MAX_GAS:
        raise ValueError(
            f"gradient_accumulation_steps {gas} > {MAX_GAS}: per-request rollout seeds would collide across "
            "optimizer steps; lower training.gradient_accumulation_steps"
        )


def stage2_seed_plan(seed: int) -> Callable[[int], str]:
    """Stage-2 trainer's seed plan line for `WeightSyncPolicy(seed_plan=...)` (`request_seed`)."""

    def plan(global_step: int) -> str:
        base = request_seed(seed, global_step, 0, 0)
        return (
            f"seed plan: training.seed {seed} + step {global_step} x {STEP_STRIDE}"
            f" + micro x {MICRO_STRIDE} + request index (step base {base})"
        )

    return plan
