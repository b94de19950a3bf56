"""Which physical GPUs a process computes on, by CUDA device UUID (stable across processes and
`CUDA_VISIBLE_DEVICES` remappings): the server reports its engine's in `/health` (`Health.gpu_uuids`), the
learner compares them with its own before a `nccl` weight sync (NCCL cannot put two ranks on one GPU).

`ROLLMATCH_GPU_UUIDS` (comma-separated; empty = no GPU) replaces the answer, read in `gpu_uuids` only, so
tests on CPU hosts can place a fake server on a fake learner GPU.
"""

from __future__ import annotations

import os
from collections.abc import Iterable

__all__ = ["FAKE_GPU_UUIDS_ENV", "gpu_uuids"]

FAKE_GPU_UUIDS_ENV = "ROLLMATCH_GPU_UUIDS"


def gpu_uuids(devices: Iterable[int] | None = None) -> list[str]:
    """UUIDs of this process's CUDA devices `devices` (indices as this process sees them; None: every visible
    device); `[]` without CUDA. Reads device properties only (no memory is allocated on any GPU).

    With `ROLLMATCH_GPU_UUIDS` set, its entries (the first `len(devices)` of them when `devices` is given).
    """
    fake = os.environ.get(FAKE_GPU_UUIDS_ENV)
    if fake is not None:
        listed = [part.strip() for part in fake.split(",") if part.strip()]
        return listed if devices is None else [listed[i] for i in devices if i < len(listed)]
    import torch

    if not torch.cuda.is_available():
        return []
    indices = range(torch.cuda.device_count()) if devices is None else devices
    return [str(torch.cuda.get_device_properties(i).uuid) for i in indices]
