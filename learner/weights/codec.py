"""Torch tensors ↔ the wire's weight-bucket codec (`shared_schemas.buckets`), which never imports torch.

A tensor travels as `(name, safetensors dtype code, shape, raw little-endian bytes)`; this module names the
dtype code of a torch dtype and takes the raw bytes without a copy for CPU tensors (bf16 included, through
a `uint8` view).
"""

from __future__ import annotations

import torch

from shared_schemas.buckets import DTYPE_NAMES, RawTensor, dtype_code
from shared_schemas.sync import TensorSpec

__all__ = ["DTYPE_CODES", "dtype_code", "raw_tensor", "tensor_spec"]

DTYPE_CODES: dict[torch.dtype, str] = {getattr(torch, name): code for code, name in DTYPE_NAMES.items()}
"""safetensors header code of every torch dtype the wire accepts (`shared_schemas.buckets.DTYPE_NAMES`, the
one table, keyed by torch dtype)."""


def tensor_spec(name: str, tensor: torch.Tensor) -> TensorSpec:
    """Name, dtype code and shape of one tensor (no data is read)."""
    return TensorSpec(name=name, dtype=dtype_code(tensor.dtype), shape=tuple(tensor.shape))


def raw_tensor(name: str, tensor: torch.Tensor) -> RawTensor:
    """The tensor's raw little-endian bytes, moved to CPU and made contiguous only when needed.

    Args:
        name: wire name.
        tensor: any dense tensor (a Parameter is detached).

    Returns:
        A `RawTensor` whose `data` is a view of a CPU copy or of the tensor itself.
    """
    data = tensor.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous().reshape(-1)
    # numpy has no bfloat16/float8; a uint8 view carries any dtype's bytes unchanged.
    raw = data.view(torch.uint8).numpy()
    return RawTensor(name, dtype_code(tensor.dtype), tuple(tensor.shape), memoryview(raw))
