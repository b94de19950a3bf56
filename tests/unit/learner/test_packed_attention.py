"""`learner.kernels.attention` and `learner.kernels.varlen`: the varlen path (one kernel call per packed row)
equals the per-segment SDPA fallback — values and gradients, causal with GQA (language model) and full (vision
tower), both kernels (the APIs of `torch.nn.attention.varlen.varlen_attn`, and FlashAttention-4 through
`learner.kernels.varlen.fa4`'s custom ops). Their kernels run on CUDA only, so on CPU dense stand-ins
(`varlen_reference`) take their place: what is checked here is the layout, the arguments, the custom ops'
autograd and tracing, and the dispatch; `bench/bench_packing.py --gpu --vlm` checks the real kernels on CUDA
(and `packed_attention` checks each once per device before it serves)."""

from __future__ import annotations

import pytest
import torch

from learner.kernels import attention as pa
from learner.kernels.varlen import base, fa4, torch_op
from tests.unit.learner.varlen_reference import API_FULL, APIS, ReferenceFA4, ReferenceVarlen

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
    monkeypatch.setattr(torch_op, "_varlen_op", lambda: (ref, APIS[api]))
    results = []
    for fn in (base.varlen_attention, base.segment_loop):
        q, k, v = _qkv(heads_kv, seed=7)
        if fn is base.varlen_attention:
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
    """`segment_sdpa` takes the varlen path for a packed row where a kernel runs, the loop otherwise, plain
    SDPA for a padded batch, and the choice "" (`packed_attention(varlen=False)`) forces the loop."""
    ref = ReferenceVarlen()
    monkeypatch.setattr(torch_op, "_varlen_op", lambda: (ref, API_FULL))
    monkeypatch.setattr(pa, "varlen_kernel", lambda q, k, causal, choice: "torch" if choice else None)
    module = torch.nn.Module()
    q, k, v = _qkv(2, seed=1)
    packed = dict(cu_seq_lens_q=CU, max_length_q=22)
    out, _ = pa.segment_sdpa(module, q, k, v, None, is_causal=True, **packed)
    assert ref.calls == 1
    loop, _ = pa.segment_sdpa(module, q, k, v, None, is_causal=True, cu_seq_lens_q=CU)  # max length derived
    assert ref.calls == 2
    torch.testing.assert_close(out, loop)
    pa.segment_sdpa(module, q, k, v, None, is_causal=True, varlen_choice="", **packed)
    pa.segment_sdpa(module, q, k, v, None, is_causal=True)
    assert ref.calls == 2


def test_varlen_not_used_on_cpu() -> None:
    """The real kernel is CUDA-only: a CPU (or float32) row never reaches it."""
    q = torch.randn(1, 4, 8, 16)
    assert not pa.varlen_available(q)
    assert not pa.varlen_available(q.bfloat16())


@pytest.mark.parametrize(
    ("causal", "heads_kv"), [(True, 2), (True, 4), (False, 4)], ids=["lm_gqa", "lm", "vit"]
)
@pytest.mark.parametrize("scaling", [None, 0.3])
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_fa4_call_equals_segment_loop(monkeypatch, causal, heads_kv, scaling, compiled) -> None:
    """The FA4 kernel's path (custom ops, autograd, `(T, H, D)` layout, native GQA) equals the fallback in
    values and gradients; compiled (`aot_eager`, full graph, as `model.compile_blocks` traces a block) the
    ops stay opaque and still run the interface's forward and backward once each."""
    ref = ReferenceFA4()
    monkeypatch.setattr(fa4, "_interface", lambda: ref)
    torch._dynamo.reset()

    def varlen(q, k, v):
        return base.varlen_attention(q, k, v, CU.long(), 22, causal=causal, scaling=scaling, kernel="fa4")

    fn = torch.compile(varlen, backend="aot_eager", fullgraph=True) if compiled else varlen
    results = []
    for run in (
        fn,
        lambda q, k, v: base.segment_loop(q, k, v, CU, causal=causal, scaling=scaling, dropout=0.0),
    ):
        q, k, v = _qkv(heads_kv, seed=7)
        out = run(q, k, v)
        assert out.shape == (1, int(CU[-1]), 4, 16)
        weights = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
        (out * weights).sum().backward()
        results.append((out.detach(), q.grad, k.grad, v.grad))
    assert (ref.fwd_calls, ref.bwd_calls) == (1, 1)
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-10, atol=1e-10)


def test_kernel_choice(monkeypatch) -> None:
    """`auto` takes the first kernel of `VARLEN_KERNEL_NAMES` that passed its check on the device (FA4, then
    PyTorch's), a named kernel only itself, and none: the per-segment loop."""
    dev, dt = torch.device("cuda:0"), torch.bfloat16
    checked = {}
    monkeypatch.setattr(base, "_checked", checked)
    monkeypatch.setattr(base, "kernel_works", lambda *a: pytest.fail(f"checked again: {a}"))
    for fa4_ok, torch_ok, choice, picked in [
        (True, True, "auto", "fa4"),
        (False, True, "auto", "torch"),
        (True, True, "torch", "torch"),
        (False, True, "fa4", None),
        (False, False, "auto", None),
    ]:
        config = (128, True, True)
        checked.update({("fa4", "cuda:0", dt, *config): fa4_ok, ("torch", "cuda:0", dt, *config): torch_ok})
        assert base.first_kernel(choice, dev, dt, config) == picked, (fa4_ok, torch_ok, choice)
    checked.clear()  # another configuration is checked on its own
    monkeypatch.setattr(base, "kernel_works", lambda device, dtype, kernel, config: config[0] == 64)
    assert base.first_kernel("auto", dev, dt, (64, False, False)) == "fa4"
    assert base.first_kernel("auto", dev, dt, (128, False, False)) is None


def test_fa4_absent_is_skipped() -> None:
    """Where FA4 cannot run (here: a CPU, and flash-attn-4 not installed) its check says no without raising,
    so `auto` goes on to the next kernel."""
    assert not fa4.fa4_supported(torch.device("cpu"))
    assert base.get_kernel("fa4").missing(torch.device("cpu"))
    assert not base.kernel_works(torch.device("cpu"), torch.bfloat16, "fa4")
    with pytest.raises(ValueError, match="varlen kernel"):
        with pa.packed_attention(torch.nn.Linear(2, 2), kernel="fa3"):
            pass
