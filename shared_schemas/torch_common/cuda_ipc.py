"""The `ipc` weight handoff's wire format: one CUDA buffer shared between two processes on the SAME GPU.

The learner packs a sync's tensors, cast to the engine's dtypes, into one flat byte buffer on its GPU
(`export_buffer`) and hands the buffer's CUDA IPC handle (`torch.multiprocessing.reductions.reduce_tensor`,
as vLLM's `distributed/weight_transfer/ipc_engine.py` does) plus each tensor's name, dtype, shape and byte
offset; the engine's worker opens the handle once (`import_buffer`) and takes views. One handle per sync,
not one per tensor: opening a handle costs a driver call and a mapping.

The message is plain data (str, int, bool, bytes, lists), so it crosses vLLM's msgpack RPC without pickle:
`reduce_tensor`'s classes and `torch.dtype` are replaced by names and rebuilt here.

Invariants: the exporter keeps the buffer alive and unwritten until the importer is done with the views (the
importer's last view dropped); both processes see the same physical GPU (the handle is keyed by its UUID).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

__all__ = ["ALIGN_BYTES", "IpcEntry", "export_buffer", "import_buffer"]

ALIGN_BYTES = 256
"""Byte alignment of each tensor in the buffer (any dtype's views stay aligned)."""

IpcEntry = tuple[str, str, list[int], int]
"""`(name, torch dtype name, shape, byte offset in the buffer)`."""


def export_buffer(buffer: torch.Tensor, entries: Sequence[IpcEntry]) -> dict[str, Any]:
    """The handoff message of `buffer` (a contiguous CUDA uint8 tensor) holding `entries`.

    Raises:
        ValueError: `buffer` is not a contiguous CUDA uint8 tensor.
    """
    from torch.multiprocessing.reductions import reduce_tensor

    if buffer.device.type != "cuda" or buffer.dtype != torch.uint8 or not buffer.is_contiguous():
        raise ValueError(
            f"a CUDA IPC handoff shares a contiguous cuda uint8 buffer, got {buffer.dtype} on {buffer.device}"
        )
    _, args = reduce_tensor(buffer)
    (_, size, stride, offset, storage_cls, _, device, handle, storage_bytes, storage_offset, _, ref_handle,
     ref_offset, event_handle, event_sync) = args  # fmt: skip
    return {
        "gpu_uuid": str(torch.cuda.get_device_properties(buffer.device).uuid),
        "storage": [
            list(size),
            list(stride),
            int(offset),
            storage_cls.__name__,
            int(device),
            handle,
            int(storage_bytes),
            int(storage_offset),
            ref_handle,
            int(ref_offset),
            event_handle,
            bool(event_sync),
        ],  # fmt: skip
        "entries": [[name, dtype, list(shape), int(at)] for name, dtype, shape, at in entries],
    }


def import_buffer(message: dict[str, Any], device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """`(name, view)` pairs of an exported buffer, opened on `device` (this process's index of that GPU).

    Raises:
        ValueError: `device` is another GPU than the exporter's (names both UUIDs).
    """
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    here = str(torch.cuda.get_device_properties(device).uuid)
    if here != message["gpu_uuid"]:
        raise ValueError(
            f"CUDA IPC handoff from GPU {message['gpu_uuid']} cannot be opened on GPU {here}: the engine must"
            " run on the learner's GPU (rollout.vllm.weight_handoff: bytes otherwise)"
        )
    (size, stride, offset, storage_name, _, handle, storage_bytes, storage_offset, ref_handle, ref_offset,
     event_handle, event_sync) = message["storage"]  # fmt: skip
    storage_cls = torch.UntypedStorage if storage_name == "UntypedStorage" else torch.storage.TypedStorage
    buffer = rebuild_cuda_tensor(
        torch.Tensor, torch.Size(size), tuple(stride), offset, storage_cls, torch.uint8,
        device.index if device.index is not None else torch.cuda.current_device(), handle, storage_bytes,
        storage_offset, False, ref_handle, ref_offset, event_handle, event_sync,
    )  # fmt: skip
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype_name, shape, at in message["entries"]:
        dtype = getattr(torch, dtype_name)
        count = 1
        for dim in shape:
            count *= dim
        raw = buffer[at : at + count * dtype.itemsize]
        out.append((name, raw.view(dtype).reshape(shape)))
    return out
