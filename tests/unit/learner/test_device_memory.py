"""`peak_memory_metrics`: the CUDA allocator's peaks per logging interval (the GPU part runs on a CUDA
machine)."""

from __future__ import annotations

import pytest
import torch

from learner.device_memory import peak_memory_metrics


def test_nothing_on_cpu() -> None:
    assert peak_memory_metrics("cpu") == {}
    if not torch.cuda.is_available():
        assert peak_memory_metrics() == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_peaks_are_per_interval_on_cuda() -> None:
    device = torch.device("cuda", 0)
    peak_memory_metrics(device)  # start an interval
    block = torch.empty(256 << 20, dtype=torch.uint8, device=device)  # 0.25 GiB
    del block
    first = peak_memory_metrics(device)
    assert first["memory/peak_allocated_gib"] >= 0.25
    assert first["memory/peak_reserved_gib"] >= first["memory/peak_allocated_gib"]
    torch.cuda.empty_cache()
    second = peak_memory_metrics(device)  # the block is gone: the new interval's peak is below it
    assert second["memory/peak_allocated_gib"] < first["memory/peak_allocated_gib"] - 0.2
