"""The `ipc` weight handoff to a colocated vLLM engine on the learner's GPU (`rollout.vllm.weight_handoff`).

The sync's tensors are cast to the engine's served dtypes ON THE GPU into one flat buffer (one allocation,
sized from the engine's parameter table, so at most one model's worth of served-dtype bytes for the sync's
duration), and the buffer's CUDA IPC handle goes to the engine's worker
(`shared_schemas.torch_common.cuda_ipc`), which stages views of it; the commit copies them into the served
parameters in place. No host copy, no bytes.

Invariant (the caller's): the buffer is kept alive and unwritten until the engine's `apply_update` returned —
the colocated learner is blocked inside the sync meanwhile, and the worker's commit waits for its copies
before it returns (`rollout_server.engines.vllm.worker.load_in_place`).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch

from learner.rollout.colocate.weights import TORCH_DTYPES, engine_dtype
from shared_schemas.torch_common.cuda_ipc import ALIGN_BYTES, IpcEntry, export_buffer

__all__ = ["PackedUpdate", "pack_full_update"]


@dataclass(frozen=True)
class PackedUpdate:
    """A sync's tensors in one CUDA buffer.

    Attributes:
        buffer: the uint8 buffer (keep it alive until the engine applied the update).
        handoff: its `cuda_ipc.export_buffer` message.
        nbytes: tensor bytes it holds (alignment padding excluded).
    """

    buffer: torch.Tensor
    handoff: dict[str, Any]
    nbytes: int


def _aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


def pack_full_update(
    items: Iterable[tuple[str, torch.Tensor]],
    specs: dict[str, tuple[str, tuple[int, ...]]],
    device: torch.device,
) -> PackedUpdate:
    """Casts each tensor into its slot of one buffer on `device`, then waits for the casts (the engine's
    process reads the buffer on its own stream, which nothing orders after this process's).

    Args:
        items: `(base-model name, tensor)` pairs of a full sync.
        specs: the engine's parameter table (name → (safetensors dtype code, shape)); bounds the buffer.
        device: the learner's CUDA device (the engine's).

    Raises:
        SyncError: see `weights.engine_dtype`.
    """
    capacity = sum(_aligned(math.prod(shape) * TORCH_DTYPES[code].itemsize) for code, shape in specs.values())
    buffer = torch.empty(max(capacity, ALIGN_BYTES), dtype=torch.uint8, device=device)
    entries: list[IpcEntry] = []
    at = nbytes = 0
    for name, tensor in items:
        dtype = engine_dtype(name, tensor, specs)
        size = tensor.numel() * dtype.itemsize
        slot = buffer[at : at + size].view(dtype).view(tensor.shape)
        slot.copy_(tensor.detach())
        entries.append((name, str(dtype).removeprefix("torch."), list(tensor.shape), at))
        at += _aligned(size)
        nbytes += size
    torch.cuda.synchronize(device)
    return PackedUpdate(buffer, export_buffer(buffer, entries), nbytes)
