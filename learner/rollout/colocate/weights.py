"""In-process weight handoff to a colocated vLLM engine: tensors → the engine's staged update.

Two handoffs (`rollout.vllm.weight_handoff`, resolved once at start by `resolve_weight_handoff`), one module
each: `bytes` here — tensors cast to the engine's served dtype on the host and encoded as in-memory
safetensors buckets (vLLM's worker processes receive them through `collective_rpc`; plain tensors would arrive
as lists) — and `ipc` (`learner.rollout.colocate.ipc`) — cast on the GPU into one buffer whose CUDA IPC
handle the engine's worker opens on the same GPU: no host copy, no bytes. Both check every tensor against the
engine's parameter table first (`engine_dtype`). No HTTP, no files.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Literal

import torch

from learner.weights.codec import DTYPE_CODES, raw_tensor
from learner.weights.types import SyncError
from learner.yaml_loader import ConfigError
from shared_schemas.buckets import encode_bucket

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Handoff",
    "encode_full_update",
    "encode_tensors",
    "engine_dtype",
    "resolve_weight_handoff",
]

DEFAULT_BUCKET_BYTES = 512 * 2**20
TORCH_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}
"""safetensors dtype code → torch dtype."""

Handoff = Literal["ipc", "bytes"]


def resolve_weight_handoff(
    setting: Literal["auto", "ipc", "bytes"], *, cuda_device: int | None, tensor_parallel_size: int
) -> Handoff:
    """The handoff a colocated vLLM engine gets (`rollout.vllm.weight_handoff`); called once, at start.

    `auto` is `ipc` when it can run — the learner on a CUDA device and an engine of tensor-parallel size 1,
    whose one worker is placed on that same device (`engine_device_env`) — else `bytes`.

    Args:
        setting: the configured value.
        cuda_device: the learner's CUDA device index (None on CPU).
        tensor_parallel_size: `rollout.vllm.tensor_parallel_size`.

    Raises:
        ConfigError: `ipc` where it cannot run (names the key, the reason and the fix).
    """
    if setting == "bytes":
        return "bytes"
    reason = None
    if cuda_device is None:
        reason = "this learner has no CUDA device (CUDA IPC shares GPU memory)"
    elif tensor_parallel_size != 1:
        reason = (
            f"rollout.vllm.tensor_parallel_size {tensor_parallel_size} puts the engine's workers on other"
            " GPUs than the learner's (CUDA IPC opens memory on the same GPU only)"
        )
    if reason is None:
        return "ipc"
    if setting == "auto":
        return "bytes"
    raise ConfigError(
        f"rollout.vllm.weight_handoff: ipc cannot run: {reason}; set rollout.vllm.weight_handoff to bytes"
        " (or auto, which picks ipc only where it runs)"
    )


def engine_dtype(
    name: str, tensor: torch.Tensor, specs: dict[str, tuple[str, tuple[int, ...]]]
) -> torch.dtype:
    """The dtype the engine serves `name` in, after checking the name and shape against its table.

    Raises:
        SyncError: a name the engine does not serve, or a shape that differs (names the tensor and the fix).
    """
    spec = specs.get(name)
    if spec is None:
        raise SyncError(
            f"tensor {name!r} is not a parameter of the colocated engine's model; the training model and"
            " model.path must be the same architecture"
        )
    code, shape = spec
    if tuple(tensor.shape) != tuple(shape):
        raise SyncError(f"tensor {name!r} has shape {list(tensor.shape)}, the engine serves {list(shape)}")
    return TORCH_DTYPES.get(code, tensor.dtype) if tensor.is_floating_point() else tensor.dtype


def encode_full_update(
    items: Iterable[tuple[str, torch.Tensor]],
    specs: dict[str, tuple[str, tuple[int, ...]]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[list[bytes], int]:
    """The `bytes` handoff: casts tensors to the engine's dtypes on the host, encodes safetensors buckets.

    Args:
        items: `(base-model name, tensor)` pairs of a full sync.
        specs: the engine's parameter table (name → (safetensors dtype code, shape)).
        bucket_bytes: a bucket is closed once it holds at least this many bytes.

    Returns:
        The encoded buckets and the raw tensor bytes they hold.

    Raises:
        SyncError: see `engine_dtype`.
    """
    buckets: list[bytes] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in items:
        dtype = engine_dtype(name, tensor, specs)
        data = tensor.detach().to(device="cpu", dtype=dtype).contiguous()
        current[name] = data
        nbytes = data.numel() * data.element_size()
        size += nbytes
        total += nbytes
        if size >= bucket_bytes:
            buckets.append(encode_tensors(current))
            current, size = {}, 0
    if current:
        buckets.append(encode_tensors(current))
    return buckets, total


def encode_tensors(tensors: dict[str, torch.Tensor]) -> bytes:
    """One safetensors blob; tied tensors (shared storage) are written as separate entries, as a sync must."""
    return encode_bucket([raw_tensor(name, t) for name, t in tensors.items()])
