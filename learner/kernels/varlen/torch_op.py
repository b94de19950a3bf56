"""`model.varlen_kernel: torch`: PyTorch's own varlen attention op (`torch.nn.attention.varlen.varlen_attn`,
FlashAttention-2 kernels; CUDA), adapted to the releases whose API it has."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor

from learner.kernels.varlen.base import VarlenKernel, register

__all__ = ["TorchVarlen"]


@functools.cache
def _varlen_op() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """`(torch.nn.attention.varlen.varlen_attn, its keyword parameters)`, or None where this torch lacks it.
    Its API moved between releases: causality as `is_causal` (first) or `window_size` (later), `scale` and
    `enable_gqa` only in later ones; `TorchVarlen` adapts to what is there. Cached: it runs in every
    attention layer of every forward."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


@register("torch")
class TorchVarlen(VarlenKernel):
    """PyTorch's varlen op; grouped kv heads natively where the op has `enable_gqa`, else repeated."""

    def missing(self, device: torch.device) -> str:
        return "" if _varlen_op() is not None else "this torch has no torch.nn.attention.varlen"

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool, scale: float | None
    ) -> Tensor:
        op = _varlen_op()
        assert op is not None
        fn, params = op
        q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
        kw: dict[str, Any] = {}
        if "window_size" in params:
            kw["window_size"] = (-1, 0) if causal else (-1, -1)
        else:
            kw["is_causal"] = causal
        if k.shape[1] != q.shape[1]:
            if "enable_gqa" in params:
                kw["enable_gqa"] = True
            else:  # SDPA's enable_gqa grouping: query head h reads kv head h // (H / H_kv)
                group = q.shape[1] // k.shape[1]
                k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        if "scale" in params:
            kw["scale"] = scale
        elif scale is not None and abs(scale * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
            q = q * (scale * q.shape[-1] ** 0.5)
        return fn(q, k, v, cu, cu, max_len, max_len, **kw)
