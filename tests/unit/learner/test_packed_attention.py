"""`learner.trainers.packed_attention`: the varlen path (one kernel call per packed row) equals the
per-segment SDPA fallback — values and gradients, causal with GQA (language model) and full (vision tower),
both APIs of `torch.nn.attention.varlen.varlen_attn`. Its flash kernel runs on CUDA only, so on CPU a dense
stand-in (`varlen_reference.ReferenceVarlen`) takes its place: what is checked here is the layout, the
arguments and the dispatch; `bench/bench_packing.py --gpu --vlm` checks the real kernel on CUDA."""

from __future__ import annotations

import pytest
import torch

from learner.trainers import packed_attention as pa
from tests.unit.learner.varlen_reference import API_FULL, APIS, ReferenceVarlen

CU = torch.tensor([0, 3, 17, 18, 40], dtype=torch.int32)


def _qkv(heads_kv: int, seed: int) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    t = int(CU[-1])
    shapes = ((1, 4, t, 16), (1, heads_kv, t, 16), (1, heads_kv, t, 16))
    return [torch.randn(s, generator=gen, dtype=torch.float64).requires_grad_(True) for s in shapes]


@pytest.mark.parametrize("api", sorted(APIS))
@pytest.mark.parametrize(
    ("causal", "heads_kv"), [(True, 2), (True, 4), (False, 4)], ids=["lm_gqa", "lm", "vit"]
)
@pytest.mark.parametrize("scaling", [None, 0.3])
def test_varlen_call_equals_segment_loop(monkeypatch, api, causal, heads_kv, scaling) -> None:
    ref = ReferenceVarlen(APIS[api])
    monkeypatch.setattr(pa, "_varlen_op", lambda: (ref, APIS[api]))
    results = []
    for fn in (pa._varlen_call, pa._segment_loop):
        q, k, v = _qkv(heads_kv, seed=7)
        if fn is pa._varlen_call:
            out = fn(q, k, v, CU.long(), 22, causal=causal, scaling=scaling)
        else:
            out = fn(q, k, v, CU, causal=causal, scaling=scaling, dropout=0.0)
        assert out.shape == (1, int(CU[-1]), 4, 16)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        (out * weights).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert ref.calls == 1 and ref.causal_calls == int(causal)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_segment_attention_dispatch(monkeypatch) -> None:
    """`segment_sdpa` takes the varlen path for a packed row where `varlen_available`, the loop otherwise,
    plain SDPA for a padded batch, and `packed_attention(varlen=False)` forces the loop."""
    ref = ReferenceVarlen()
    monkeypatch.setattr(pa, "_varlen_op", lambda: (ref, API_FULL))
    monkeypatch.setattr(pa, "varlen_available", lambda q: pa._use_varlen[0])
    module = torch.nn.Module()
    q, k, v = _qkv(2, seed=1)
    packed = dict(cu_seq_lens_q=CU, max_length_q=22)
    out, _ = pa.segment_sdpa(module, q, k, v, None, is_causal=True, **packed)
    assert ref.calls == 1
    loop, _ = pa.segment_sdpa(module, q, k, v, None, is_causal=True, cu_seq_lens_q=CU)  # max length derived
    assert ref.calls == 2
    torch.testing.assert_close(out, loop)
    pa._use_varlen[0] = False
    try:
        pa.segment_sdpa(module, q, k, v, None, is_causal=True, **packed)
        pa.segment_sdpa(module, q, k, v, None, is_causal=True)
    finally:
        pa._use_varlen[0] = True
    assert ref.calls == 2


def test_varlen_not_used_on_cpu() -> None:
    """The real kernel is CUDA-only: a CPU (or float32) row never reaches it."""
    q = torch.randn(1, 4, 8, 16)
    assert not pa.varlen_available(q)
    assert not pa.varlen_available(q.bfloat16())
