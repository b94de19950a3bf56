"""Offload context for a colocated rollout engine (docs/ALGORITHM.md#offload).

While a colocated engine is created, receives weights and generates, the training model's parameters
and the optimizer states can be parked on the CPU to free accelerator memory. Entering moves every
parameter's ``.data`` (``offload_model``) and every optimizer-state tensor (``offload_optimizer``) to the
CPU and empties the CUDA cache; leaving moves each tensor back to the device it came from — always,
also when the body raises. Whether offloading applies at all (backend ``vllm`` + ``mode: colocate``, no
ZeRO/FSDP sharding) is decided by the caller through ``enabled``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

__all__ = ["OffloadReport", "offload_context"]

logger = logging.getLogger(__name__)

OFFLOAD_DEVICE = torch.device("cpu")


@dataclass
class OffloadReport:
    """What the context did; ``seconds`` (enter + exit moves) feeds ``time/offload_s``."""

    seconds: float = 0.0
    params_moved: int = 0
    optimizer_tensors_moved: int = 0
    devices: set[str] = field(default_factory=set)


def _move(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Copy ``tensor`` to ``device`` (a seam for tests on CPU-only machines)."""
    return tensor.to(device)


def _empty_cuda_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@contextmanager
def offload_context(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    *,
    offload_model: bool,
    offload_optimizer: bool,
    enabled: bool,
) -> Iterator[OffloadReport]:
    """Park parameters and optimizer states on the CPU for the body (§16).

    Parameters are moved by replacing ``p.data`` (the Parameter objects, and so the optimizer's
    references to them, stay the same). Gradients are expected to be None (planning runs right after
    ``zero_grad(set_to_none=True)``); any present gradient is moved along with its parameter.

    Args:
        model: the training model (unwrapped, unsharded).
        optimizer: its optimizer, or None.
        offload_model: ``stage2.offload.model``.
        offload_optimizer: ``stage2.offload.optimizer``.
        enabled: ``stage2.offload.enabled`` and a colocated engine; False makes the context a no-op.

    Yields:
        An :class:`OffloadReport`, complete after exit.
    """
    report = OffloadReport()
    if not enabled or not (offload_model or offload_optimizer):
        yield report
        return
    params: list[tuple[torch.nn.Parameter, torch.device]] = []
    states: list[tuple[dict, str, torch.device]] = []
    start = time.perf_counter()
    try:
        if offload_model:
            for p in model.parameters():
                params.append((p, p.data.device))
                report.devices.add(str(p.data.device))
                p.data = _move(p.data, OFFLOAD_DEVICE)
                if p.grad is not None:
                    p.grad = _move(p.grad, OFFLOAD_DEVICE)
        if offload_optimizer and optimizer is not None:
            for state in optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        states.append((state, key, value.device))
                        report.devices.add(str(value.device))
                        state[key] = _move(value, OFFLOAD_DEVICE)
        report.params_moved = len(params)
        report.optimizer_tensors_moved = len(states)
        _empty_cuda_cache()
        report.seconds += time.perf_counter() - start
        yield report
    finally:
        start = time.perf_counter()
        for p, device in params:
            p.data = _move(p.data, device)
            if p.grad is not None:
                p.grad = _move(p.grad, device)
        for state, key, device in states:
            state[key] = _move(state[key], device)
        _empty_cuda_cache()
        report.seconds += time.perf_counter() - start
        logger.debug(
            "offload: %d params, %d optimizer tensors, %.3f s", len(params), len(states), report.seconds
        )
