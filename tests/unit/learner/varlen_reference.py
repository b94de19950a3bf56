"""A CPU stand-in for `torch.nn.attention.varlen.varlen_attn` (whose flash kernel runs on CUDA only): dense
attention under a block-diagonal (optionally causal) mask built from the cumulative lengths, so the varlen
path of `learner.trainers.packed_attention` can be checked on CPU against its per-segment fallback."""

from __future__ import annotations

import torch

__all__ = ["APIS", "API_FULL", "ReferenceVarlen"]


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
