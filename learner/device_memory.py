"""Accelerator memory per logging interval: what an OOM post-mortem needs, in every training log record.

`peak_memory_metrics` returns the CUDA allocator's peaks since its previous call (it resets them), in GiB, for
the trainers' `log` to add beside the step's losses:

- `memory/peak_allocated_gib`: the most memory tensors held at once (weights, optimizer state, activations,
  logits) — the figure to compare with the card when a step OOMs;
- `memory/peak_reserved_gib`: the most the caching allocator held from the driver (allocated + cached blocks;
  a large gap to the allocated peak is fragmentation: `PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True`).

Rank-local (each rank measures its own device; rank 0's records are the ones written). On CPU, or before CUDA
is initialised, it returns nothing: host memory is the OS's to report.
"""

from __future__ import annotations

import torch

__all__ = ["peak_memory_metrics"]

GIB = float(1 << 30)


def peak_memory_metrics(device: torch.device | str | None = None) -> dict[str, float]:
    """Peaks since the last call on `device` (the current CUDA device when None), in GiB; {} without CUDA."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return {}
    device = torch.device(device) if device is not None else torch.device("cuda", torch.cuda.current_device())
    if device.type != "cuda":
        return {}
    metrics = {
        "memory/peak_allocated_gib": round(torch.cuda.max_memory_allocated(device) / GIB, 3),
        "memory/peak_reserved_gib": round(torch.cuda.max_memory_reserved(device) / GIB, 3),
    }
    torch.cuda.reset_peak_memory_stats(device)
    return metrics
