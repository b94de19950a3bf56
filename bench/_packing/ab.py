"""CUDA A/Bs on the same packed rows, interleaved rounds each: the varlen kernels (PyTorch's FA2 vs FA4) and
the batch's host -> GPU copy (pageable vs pinned + ``non_blocking``)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from learner.kernels import varlen_kernel

from .common import interleaved


def ab_kernel(rounds: int, rows: list, step: Callable, model, device: torch.device) -> dict:
    """The packed rows through PyTorch's varlen op (FlashAttention-2) vs FlashAttention-4
    (``model.varlen_kernel`` torch / fa4), ``rounds`` interleaved rounds after one untimed pass each (FA4's
    kernels compile on first use; compiled blocks recompile once per kernel). The ratio is fa4 / torch; the
    loss of row 0 both ways. Raises where FA4 does not run here (the record says why)."""
    dtype = next(model.parameters()).dtype
    if varlen_kernel(torch.empty(1, 1, 1, 128, device=device, dtype=dtype), choice="fa4") != "fa4":
        raise RuntimeError("FA4 does not run here (flash-attn-4 not importable, not SM 9.x/10.x, or failed)")
    kernels = ("torch", "fa4")
    rows = [r.to(device) for r in rows]
    tokens = sum(r.num_tokens for r in rows)

    def run(kernel: str, read_loss: bool = False) -> tuple[float | None, float]:
        """All rows once through ``kernel``: (loss of row 0 where ``read_loss``, a host sync; seconds)."""
        torch.cuda.synchronize()
        start = time.perf_counter()
        loss = None
        for i, row in enumerate(rows):
            out = step(row, varlen=kernel)
            if read_loss and i == 0:
                loss = float(out.detach())
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return loss, time.perf_counter() - start

    first = {kernel: run(kernel, read_loss=True) for kernel in kernels}
    record = interleaved(rounds, kernels, lambda side: tokens / run(kernels[side])[1])
    for kernel, (loss, seconds) in first.items():
        record |= {f"loss_{kernel}": round(loss, 5), f"first_pass_s_{kernel}": round(seconds, 1)}
    return record | dict(rows=len(rows))


def ab_copy(rounds: int, rows: list, step: Callable, model, device: torch.device) -> dict:
    """The rows back to back with their host -> GPU copy inside the timing, as the trainer's micro-steps run
    (no sync between them): copied from pageable memory (blocking: the host waits for the previous step's
    backward, then the GPU for the copy) vs from page-locked memory with ``non_blocking`` (what the
    planner's ``pin_memory`` builds). ``rounds`` interleaved rounds; the ratio is pinned / pageable."""
    sides = ((rows, False), ([r.pin_memory() for r in rows], True))  # pinned: as the planner builds them
    tokens = sum(r.num_tokens for r in rows)
    losses = []
    for src, nb in sides:
        losses.append(float(step(src[0].to(device, non_blocking=nb)).detach()))
        model.zero_grad(set_to_none=True)

    def timed(side: int) -> float:
        src, nb = sides[side]
        torch.cuda.synchronize()
        start = time.perf_counter()
        for row in src:
            step(row.to(device, non_blocking=nb))
            model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        return tokens / (time.perf_counter() - start)

    return interleaved(rounds, ("pageable", "pinned"), timed) | dict(
        rows=len(rows), loss_pageable=round(losses[0], 5), loss_pinned=round(losses[1], 5)
    )
