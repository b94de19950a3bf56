"""Which GPUs a learner process may see: one process drives exactly one GPU.

HF `TrainingArguments` (through accelerate) runs data-parallel over processes only when `LOCAL_RANK` is set
(torchrun); a process without it that sees n > 1 CUDA devices gets `n_gpu = n` and `Trainer` wraps the model
in `torch.nn.DataParallel`, whose micro-batch is `per_device_train_batch_size × n` — it spans several
rollout-buffer windows and the trainer refuses it at the first step. `python -m learner` therefore narrows
`CUDA_VISIBLE_DEVICES` to the first visible device before torch initialises CUDA (`restrict_to_one_gpu`).

Nothing in one process legitimately uses several GPUs: a colocated vLLM engine with
`rollout.vllm.tensor_parallel_size > 1` forms its TP group from torchrun ranks, one GPU per rank
(`learner.rollout.colocate.tp`), so under torchrun nothing is changed here, and a single process with TP > 1
is refused at load by `learner.config.check_runtime_guards` (the TP size must divide the world size 1).
A tensor-parallel-1 engine is placed on this process's device, mapped through the narrowed variable.
"""

from __future__ import annotations

import logging
import os
from collections.abc import MutableMapping

import torch

from learner.yaml_loader import ConfigError

__all__ = ["pin_one_gpu_without_torchrun", "restrict_to_one_gpu"]

logger = logging.getLogger(__name__)

VISIBLE = "CUDA_VISIBLE_DEVICES"


def restrict_to_one_gpu(environ: MutableMapping[str, str], device_count: int) -> str | None:
    """Narrows `environ[CUDA_VISIBLE_DEVICES]` to its first device when no launcher made this a rank.

    Invariant afterwards: a process without `LOCAL_RANK` (the variable accelerate reads to pick DDP over
    DataParallel; torchrun sets it) sees at most one device, so HF's `n_gpu` is at most 1. Under torchrun, or
    with at most one device visible, `environ` is left as it is. The first device is the first entry of an
    existing `CUDA_VISIBLE_DEVICES` ("2,3" → "2"; UUIDs and MIG ids are kept verbatim), else "0" — the
    device HF would have called `cuda:0`. Logs one warning naming torchrun and the variable when it narrows.

    Args:
        environ: the process environment (`os.environ`; a dict in tests); changed in place.
        device_count: CUDA devices this process sees now (`torch.cuda.device_count()`).

    Returns:
        The new `CUDA_VISIBLE_DEVICES` value, or None when `environ` was left as it is.
    """
    if int(environ.get("LOCAL_RANK", "-1")) != -1 or device_count <= 1:
        return None
    listed = [part.strip() for part in environ.get(VISIBLE, "").split(",") if part.strip()]
    first = listed[0] if listed else "0"
    environ[VISIBLE] = first
    logger.warning(
        "%d GPUs visible and no torchrun: training on cuda:0 only (%s=%s); launch with torchrun"
        " --nproc-per-node %d for data parallelism, or set %s to choose the GPU",
        device_count,
        VISIBLE,
        first,
        device_count,
        VISIBLE,
    )
    return first


def pin_one_gpu_without_torchrun() -> None:
    """`restrict_to_one_gpu` on this process; call it before anything initialises CUDA (importing torch does
    not).

    torch counts devices through NVML without initialising CUDA, and re-reads the variable until it does.
    Where CUDA was already initialised (or NVML failed and the count initialised it), the driver keeps the
    devices it saw; that is refused here, at start-up, rather than at the first step under DataParallel.

    Raises:
        ConfigError: the narrowing could not take effect (names torchrun and `CUDA_VISIBLE_DEVICES`).
    """
    pinned = restrict_to_one_gpu(os.environ, torch.cuda.device_count())
    if pinned is not None and torch.cuda.device_count() > 1:
        raise ConfigError(
            f"{torch.cuda.device_count()} GPUs stay visible to one learner process after setting"
            f" {VISIBLE}={pinned} (CUDA was initialised first); set {VISIBLE} to one GPU before starting"
            " python -m learner, or launch with torchrun --nproc-per-node N"
        )
