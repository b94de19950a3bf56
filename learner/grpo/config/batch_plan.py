"""The ``batch_plan`` shorthand (docs/ALGORITHM.md#batch-plan).

``batch_plan: {effective_batch_size, per_device_batch_size, server_gpus, train_gpus, server_tp, server_dp}``
(all optional) fills the fields it stands for: ``training.per_device_train_batch_size``,
``training.gradient_accumulation_steps`` (``gas = effective / (per_device × len(train_gpus))``, an integer),
``grpo.generation_batch_size := effective``, ``grpo.steps_per_generation := 1``, ``server.gpus``,
``train_gpus``, ``server.vllm.tensor_parallel_size`` and ``server.vllm.data_parallel_size``.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from pydantic import Field

from learner.training_config import TRAINING_DEFAULTS
from shared_schemas.config import ConfigError, ConfigSection, GpuList, parse_gpu_list

__all__ = ["BatchPlan", "apply_batch_plan", "parse_gpu_list", "set_dotted"]

logger = logging.getLogger(__name__)


class BatchPlan(ConfigSection):
    """``batch_plan:`` — one place for the batch sizes and the GPU topology."""

    effective_batch_size: int | None = Field(default=None, ge=1)
    """Completions per optimizer step (= generation batch size)."""
    per_device_batch_size: int | None = Field(default=None, ge=1)
    """Completions per learner rank per micro-step."""
    server_gpus: GpuList = None
    """Overrides ``server.gpus``."""
    train_gpus: GpuList = None
    """Overrides ``train_gpus``."""
    server_tp: int | None = Field(default=None, ge=1)
    """Overrides ``server.vllm.tensor_parallel_size``."""
    server_dp: int | None = Field(default=None, ge=1)
    """Overrides ``server.vllm.data_parallel_size``."""


def set_dotted(raw: dict[str, Any], dotted: str, value: Any) -> None:
    """Sets ``dotted`` in ``raw`` in place (creating mappings); warns when it replaces a different value."""
    *parents, leaf = dotted.split(".")
    node = raw
    for key in parents:
        child = node.get(key)
        if not isinstance(child, dict):
            child = {}
            node[key] = child
        node = child
    if leaf in node and node[leaf] != value:
        logger.warning("%s set to %r (the config had %r)", dotted, value, node[leaf])
    node[leaf] = value


def apply_batch_plan(raw: dict[str, Any], plan: BatchPlan) -> dict[str, Any]:
    """Returns a copy of ``raw`` with the fields of ``plan`` filled in (``raw`` is not modified).

    Raises:
        ConfigError: ``effective_batch_size`` is not a multiple of
            ``per_device_batch_size × len(train_gpus)``.
    """
    out = copy.deepcopy(raw)
    if plan.server_gpus is not None:
        set_dotted(out, "server.gpus", list(plan.server_gpus))
    if plan.train_gpus is not None:
        set_dotted(out, "train_gpus", list(plan.train_gpus))
    if plan.server_tp is not None:
        set_dotted(out, "server.vllm.tensor_parallel_size", plan.server_tp)
    if plan.server_dp is not None:
        set_dotted(out, "server.vllm.data_parallel_size", plan.server_dp)
    training = out.get("training") if isinstance(out.get("training"), dict) else {}
    per_device = plan.per_device_batch_size
    if per_device is not None:
        set_dotted(out, "training.per_device_train_batch_size", per_device)
    if plan.effective_batch_size is None:
        return out
    if per_device is None:
        per_device = int(
            training.get("per_device_train_batch_size", TRAINING_DEFAULTS.per_device_train_batch_size)
        )
    train_gpus = parse_gpu_list(out.get("train_gpus", ()))
    world = len(train_gpus) if isinstance(train_gpus, tuple | list) else 0
    denominator = per_device * world
    if denominator == 0 or plan.effective_batch_size % denominator:
        raise ConfigError(
            f"batch_plan.effective_batch_size: {plan.effective_batch_size} is not a whole multiple of "
            f"per_device_batch_size {per_device} × {world} train GPUs (GRPO §2.4,"
            " docs/ALGORITHM.md#batch-plan: gas must be an integer); change the batch sizes or train_gpus"
        )
    set_dotted(out, "training.gradient_accumulation_steps", plan.effective_batch_size // denominator)
    set_dotted(out, "grpo.generation_batch_size", plan.effective_batch_size)
    set_dotted(out, "grpo.steps_per_generation", 1)
    return out
