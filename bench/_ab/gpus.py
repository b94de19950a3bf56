"""The GPUs one run holds, the factor of its GPU-seconds: the learner's GPU and the rollout server's when the
harness started it, each physical GPU counted once (a server on the learner's GPU adds none)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path


def visible_gpus() -> list[str]:
    """The GPUs a child process of the harness sees, as ``CUDA_VISIBLE_DEVICES`` names them (indices or
    UUIDs); empty without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return []
    listed = os.environ.get("CUDA_VISIBLE_DEVICES", "").strip()
    if listed:
        return [d.strip() for d in listed.split(",") if d.strip()]
    return [str(i) for i in range(torch.cuda.device_count())]


def server_gpus(server_yaml: Path, visible: Sequence[str]) -> list[str]:
    """The GPUs the harness's rollout server runs on: its config's ``server.gpus`` (the launcher sets
    ``CUDA_VISIBLE_DEVICES`` to them), else the first ``tensor_parallel_size x data_parallel_size`` of
    ``visible`` (it inherits the harness's)."""
    from shared_schemas.server_config import load_server_config

    cfg = load_server_config(server_yaml)
    if cfg.gpus is not None:
        return [str(g) for g in cfg.gpus]
    return list(visible[: cfg.vllm.tensor_parallel_size * cfg.vllm.data_parallel_size])


def held_gpus(visible: Sequence[str], server: Sequence[str] | None) -> int:
    """GPUs one run holds: 0 without CUDA (``visible`` empty); else the learner's (one process: the first
    visible GPU) together with ``server``'s (the harness's own server; None: no server of this harness — in
    process rollouts, or ``--server-url``'s, another host's, not counted), each GPU once."""
    if not visible:
        return 0
    return len({visible[0], *(server or ())})
