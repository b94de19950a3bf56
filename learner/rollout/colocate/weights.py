"""In-process weight handoff to a colocated vLLM engine: tensors → the engine's staged-update buckets.

vLLM's worker processes receive full updates as safetensors bytes through `collective_rpc` (plain tensors
would arrive as lists), so even in-process the tensors are cast to the engine's served dtype, checked against
its parameter table and encoded as in-memory safetensors buckets — no HTTP, no files.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from learner.weights.codec import DTYPE_CODES, raw_tensor
from learner.weights.types import SyncError
from shared_schemas.buckets import encode_bucket

__all__ = ["DEFAULT_BUCKET_BYTES", "encode_full_update", "encode_tensors"]

DEFAULT_BUCKET_BYTES = 512 * 2**20
_TORCH_DTYPES = {code: dtype for dtype, code in DTYPE_CODES.items()}


def encode_full_update(
    items: Iterable[tuple[str, torch.Tensor]],
    specs: dict[str, tuple[str, tuple[int, ...]]],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> tuple[list[bytes], int]:
    """Casts tensors to the engine's dtypes, checks them against its table, encodes safetensors buckets.

    Args:
        items: `(base-model name, tensor)` pairs of a full sync.
        specs: the engine's parameter table (name → (safetensors dtype code, shape)).
        bucket_bytes: a bucket is closed once it holds at least this many bytes.

    Returns:
        The encoded buckets and the raw tensor bytes they hold.

    Raises:
        SyncError: a name the engine does not serve, or a shape that differs (names the tensor and the fix).
    """
    buckets: list[bytes] = []
    current: dict[str, torch.Tensor] = {}
    size = total = 0
    for name, tensor in items:
        spec = specs.get(name)
        if spec is None:
            raise SyncError(
                f"tensor {name!r} is not a parameter of the colocated engine's model; the training model and"
                " model.path must be the same architecture"
            )
        code, shape = spec
        if tuple(tensor.shape) != tuple(shape):
            raise SyncError(
                f"tensor {name!r} has shape {list(tensor.shape)}, the engine serves {list(shape)}"
            )
        dtype = _TORCH_DTYPES.get(code, tensor.dtype) if tensor.is_floating_point() else tensor.dtype
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
