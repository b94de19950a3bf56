"""A CPU stand-in for `torch.nn.attention.varlen.varlen_attn` (whose flash kernel runs on CUDA only): dense
attention under a block-diagonal (optionally causal) mask built from the cumulative lengths, so the varlen
path of `learner.kernels.attention` can be checked on CPU against its per-segment fallback."""

from __future__ import annotations

import torch

__all__ = ["APIS", "API_FULL", "ReferenceFA4", "ReferenceVarlen"]


API_FIRST = frozenset({"is_causal"})
API_WINDOW = frozenset({"window_size"})
API_FULL = frozenset({"window_size", "scale", "enable_gqa"})
APIS = {"first": API_FIRST, "window": API_WINDOW, "full": API_FULL}
"""Keyword parameters of the releases of `varlen_attn` that `packed_attention` adapts to."""


class ReferenceVarlen:
    """Callable with one API of `varlen_attn` (its keyword parameters `params`: causality as `is_causal` or
    `window_size`, optionally `scale` and `enable_gqa`; without the latter, equal head counts); counts its
    calls."""

    def __init__(self, params: frozenset[str] = API_FULL) -> None:
        self.params = params
        self.calls = 0
        self.causal_calls = 0

    def __call__(self, q, k, v, cu_q, cu_k, max_q, max_k, **kw):  # noqa: ANN001, ANN204 - mirrors torch
        assert set(kw) <= self.params, (sorted(kw), sorted(self.params))
        if "window_size" in self.params:
            causal = tuple(kw.get("window_size", (-1, -1))) == (-1, 0)
        else:
            causal = bool(kw.get("is_causal", False))
        scale = kw.get("scale")
        if k.shape[1] != q.shape[1]:
            assert kw.get("enable_gqa"), "GQA shapes without enable_gqa"
        assert q.dim() == 3 and cu_q.dtype == torch.int32 and torch.equal(cu_q, cu_k)
        lengths = cu_q[1:] - cu_q[:-1]
        assert int(lengths.max()) == max_q == max_k
        self.calls += 1
        self.causal_calls += int(causal)
        t, h, d = q.shape
        seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())
        allowed = seg[:, None] == seg[None, :]
        if causal:
            allowed &= torch.ones(t, t, dtype=torch.bool).tril()
        k = k.repeat_interleave(h // k.shape[1], dim=1)
        v = v.repeat_interleave(h // v.shape[1], dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) * (scale if scale is not None else d**-0.5)
        scores = scores.masked_fill(~allowed, float("-inf"))
        return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


class ReferenceFA4:
    """A CPU stand-in for FlashAttention-4's interface module (`flash_attn.cute.interface`): its two entry
    points `_flash_attn_fwd` / `_flash_attn_bwd` with the keyword arguments `learner.kernels.varlen.fa4`
    passes, computed densely (`ReferenceVarlen`); the backward recomputes the forward under autograd. Checks
    what the kernel would require: `(T, H, D)` tensors with a unit last stride, int32 bounds, lse of shape
    `(H, T)` in float32. Counts its calls."""

    def __init__(self) -> None:
        self.fwd_calls = 0
        self.bwd_calls = 0
        self._dense = ReferenceVarlen(API_FULL)

    def _attend(self, q, k, v, cu, max_len, scale, causal):  # noqa: ANN001, ANN202
        assert q.dim() == 3 and all(t.stride(-1) == 1 for t in (q, k, v)) and cu.dtype == torch.int32
        return self._dense(
            q, k, v, cu, cu, max_len, max_len, window_size=(-1, 0) if causal else (-1, -1), scale=scale,
            enable_gqa=k.shape[1] != q.shape[1],
        )  # fmt: skip

    def _flash_attn_fwd(self, q, k, v, *, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,  # noqa: ANN001, ANN202, PLR0913
                        softmax_scale, causal, return_lse):  # fmt: skip
        assert return_lse and cu_seqlens_q is cu_seqlens_k and max_seqlen_q == max_seqlen_k
        self.fwd_calls += 1
        out = self._attend(q, k, v, cu_seqlens_q, max_seqlen_q, softmax_scale, causal)
        lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32)
        return out, lse, None, None  # the early releases' four results

    def _flash_attn_bwd(self, q, k, v, out, dout, lse, *, softmax_scale, causal, cu_seqlens_q,  # noqa: ANN001, ANN202, PLR0913
                        cu_seqlens_k, max_seqlen_q, max_seqlen_k):  # fmt: skip
        """Attention's backward in closed form (a custom op's body runs below autograd: no recording)."""
        assert lse.shape == (q.shape[1], q.shape[0]) and lse.dtype == torch.float32
        self.bwd_calls += 1
        t, h, d = q.shape
        group = h // k.shape[1]
        kx, vx = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
        lengths = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
        seg = torch.repeat_interleave(torch.arange(len(lengths)), lengths.long())
        allowed = seg[:, None] == seg[None, :]
        if causal:
            allowed &= torch.ones(t, t, dtype=torch.bool).tril()
        scale = softmax_scale if softmax_scale is not None else d**-0.5
        p = (torch.einsum("qhd,khd->hqk", q, kx) * scale).masked_fill(~allowed, float("-inf")).softmax(-1)
        dv = torch.einsum("hqk,qhd->khd", p, dout)
        dp = torch.einsum("qhd,khd->hqk", dout, vx)
        ds = p * (dp - (dp * p).sum(-1, keepdim=True))
        dq = torch.einsum("hqk,khd->qhd", ds, kx) * scale
        dk = torch.einsum("hqk,qhd->khd", ds, q) * scale
        fold = lambda g: g.reshape(t, k.shape[1], group, d).sum(2)  # noqa: E731 - GQA: sum each kv head's group
        return dq, fold(dk), fold(dv)
