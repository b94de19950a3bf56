"""FlashAttention-4's varlen kernels (CuTe DSL; Hopper, Blackwell) as one PyTorch custom op, for packed rows.

Why: faster than PyTorch's varlen op (FlashAttention-2 kernels) on Hopper, in the vision tower most
(`bench/bench_packing.py --attn-replay`, `--ab-kernel`; figures: bench/RESULTS.md, "learner throughput").
FA4 ships as the `flash-attn-4` wheel (pure Python; its kernels compile at run time through
`nvidia-cutlass-dsl` on first use of each kernel configuration), so it is optional: registered as `fa4`
(`Fa4Varlen`), `auto` picks it where it imports, the GPU is SM 9.x or 10.x, and it passes the same one-time
check against per-segment SDPA as the PyTorch op (`varlen.base.kernel_works`); PyTorch's op serves
otherwise.

Wrapped as `torch.library` custom ops (forward and backward) so that a compiled block
(`model.compile_blocks`) treats the kernel as one opaque node instead of tracing into the CuTe launcher. Only
FA4's two entry points that PyTorch's own FA4 registration also calls (`_flash_attn_fwd`, `_flash_attn_bwd`)
are used. Checked with flash-attn-4 4.0.0b20 and nvidia-cutlass-dsl 4.6.0.dev0 on an H200.
"""

from __future__ import annotations

import functools
import importlib
from types import ModuleType

import torch
from torch import Tensor

from learner.kernels.varlen.base import VarlenKernel, register

__all__ = ["Fa4Varlen", "fa4_importable", "fa4_supported"]

_MODULE = "flash_attn.cute.interface"


@functools.cache
def _interface() -> ModuleType | None:
    """FA4's interface module, or None where it (or its CuTe DSL runtime) does not import."""
    try:
        module = importlib.import_module(_MODULE)
    except Exception:  # noqa: BLE001 - not installed, or its compiler runtime is missing: not usable
        return None
    return module if hasattr(module, "_flash_attn_fwd") and hasattr(module, "_flash_attn_bwd") else None


def fa4_importable() -> bool:
    """Whether flash-attn-4's interface (and its CuTe DSL runtime) imports here (on any device)."""
    return _interface() is not None


@functools.cache
def fa4_supported(device: torch.device) -> bool:
    """Whether FA4 can run on `device`: CUDA of compute capability 9.x or 10.x and the package importable.
    Says nothing about correctness there; `varlen.base.kernel_works` checks that once per configuration."""
    if device.type != "cuda" or not torch.cuda.is_available():
        return False
    return torch.cuda.get_device_capability(device)[0] in (9, 10) and _interface() is not None


@torch.library.custom_op("rollmatch::fa4_varlen_fwd", mutates_args=())
def _fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    fa4 = _interface()
    assert fa4 is not None, "Fa4Varlen called where fa4_supported() is False"
    res = fa4._flash_attn_fwd(
        q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
        softmax_scale=scale, causal=causal, return_lse=True,
    )  # fmt: skip
    return res[0], res[1].contiguous()  # later releases return (out, lse), earlier ones two more


@_fwd.register_fake
def _fwd_fake(q, k, v, cu, max_len, causal, scale):
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


@torch.library.custom_op("rollmatch::fa4_varlen_bwd", mutates_args=())
def _bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    causal: bool,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    fa4 = _interface()
    assert fa4 is not None, "Fa4Varlen called where fa4_supported() is False"
    dq, dk, dv = fa4._flash_attn_bwd(
        q, k, v, out, dout.contiguous(), lse, softmax_scale=scale, causal=causal,
        cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max_len, max_seqlen_k=max_len,
    )[:3]  # fmt: skip
    return dq, dk, dv


@_bwd.register_fake
def _bwd_fake(dout, q, k, v, out, lse, cu, max_len, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, cu, max_len, causal, scale = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu)
    ctx.max_len, ctx.causal, ctx.scale = max_len, causal, scale


def _backward(ctx, dout, dlse):
    q, k, v, out, lse, cu = ctx.saved_tensors
    dq, dk, dv = _bwd(dout, q, k, v, out, lse, cu, ctx.max_len, ctx.causal, ctx.scale)
    return dq, dk, dv, None, None, None, None


_fwd.register_autograd(_backward, setup_context=_setup_context)


@register("fa4")
class Fa4Varlen(VarlenKernel):
    """FlashAttention-4 (Hopper, Blackwell; the optional `flash-attn-4` wheel): grouped-query attention in the
    kernel; bf16 or fp16, CUDA."""

    def missing(self, device: torch.device) -> str:
        return "" if fa4_supported(device) else "flash-attn-4 not importable or the GPU is not SM 9.x/10.x"

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool, scale: float | None
    ) -> Tensor:
        scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
        q, k, v = (t.contiguous() for t in (q, k, v))
        return _fwd(q, k, v, cu, max_len, causal, scale)[0]
