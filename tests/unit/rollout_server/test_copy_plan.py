"""The in-place commit's copy plan (`rollout_server.engines.vllm.copy_plan`): a replay writes exactly what the
model's `load_weights` writes, and a load it cannot replay exactly leaves no plan.

The models are small stand-ins with vLLM's `load_weights` contract (checkpoint names → fused slots, a shard
slice of the loaded tensor, vocabulary padding filled); the real one runs on a GPU in
`tests/integration/test_colocate_handoff_gpu.py`."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rollout_server.engines.vllm.copy_plan import CopyPlan, CopyPlanRejected


class _VllmLike(torch.nn.Module):
    """q/k/v → one fused qkv parameter; `shard.weight` loads rows 1:3 of what it is sent (a tensor-parallel
    rank's slice); the embedding has 2 padding rows the loader zeroes; `lm_head` is tied and skipped."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 2, dtype=torch.bfloat16), requires_grad=False)
        self.shard = torch.nn.Parameter(torch.zeros(2, 3), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(6, 2), requires_grad=False)
        self.register_buffer("inv_freq", torch.ones(2))

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue
            if name in ("q", "k", "v"):
                shard = "qkv".index(name)
                self.qkv.data.narrow(0, 2 * shard, 2).copy_(tensor)
            elif name == "shard.weight":
                self.shard.data.copy_(tensor.narrow(0, 1, 2))
            else:
                self.embed.data[: tensor.shape[0]].copy_(tensor)
                self.embed.data[tensor.shape[0] :].fill_(0)
            loaded.add(name)
        return loaded


def _update(scale: float) -> list[tuple[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(int(scale * 10))
    staged = [(n, torch.randn(2, 2, generator=gen) * scale) for n in "qkv"]
    staged.append(("shard.weight", torch.randn(4, 3, generator=gen)))
    staged.append(("embed.weight", torch.randn(4, 2, generator=gen)))
    staged.append(("lm_head.weight", torch.randn(4, 2, generator=gen)))
    return staged


def _packed(staged: list[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
    """The same tensors as views of one flat buffer, as the CUDA-IPC handoff stages them."""
    flat = torch.cat([t.reshape(-1) for _, t in staged])
    out, offset = [], 0
    for name, t in staged:
        out.append((name, flat[offset : offset + t.numel()].view(t.shape)))
        offset += t.numel()
    return out


@pytest.mark.parametrize("layout", ["separate", "one_buffer"])
def test_a_replay_writes_what_load_weights_writes(layout: str) -> None:
    pack = _packed if layout == "one_buffer" else (lambda s: s)
    model = _VllmLike()
    plan, reason = CopyPlan.record(model, pack(_update(1.0)))
    assert plan is not None and reason == ""
    assert {c.name for c in plan.copies} == {"q", "k", "v", "shard.weight", "embed.weight"}  # lm_head skipped
    assert {c.name for c in plan.copies if not c.whole} == {"shard.weight"}  # the one sliced source
    params_before = [p.data_ptr() for p in model.parameters()]
    model.embed.data.fill_(7.0)  # garbage where the padding was (a level-2 sleep discards the weights)
    second = pack(_update(2.0))
    plan.apply(second)
    reference = _VllmLike()
    reference.load_weights(iter(_update(2.0)))
    for (name, ours), theirs in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(ours, theirs), name
    assert [p.data_ptr() for p in model.parameters()] == params_before  # copied into, never replaced


def test_an_update_of_another_signature_does_not_match() -> None:
    plan, _ = CopyPlan.record(_VllmLike(), _update(1.0))
    assert plan is not None
    other = _update(1.0)
    assert not plan.matches(other[:-1])  # a tensor fewer
    other[0] = ("q", other[0][1].double())
    assert not plan.matches(other)  # another dtype
    with pytest.raises(CopyPlanRejected, match="recorded names"):
        plan.apply(other)


class _Transforming(_VllmLike):
    """A loader that writes a transform of the loaded tensor: no exact replay exists."""

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            if name == "q":
                self.qkv.data[:2].copy_(tensor.t() * 2)
        return {"q"}


class _ReadsValue(_VllmLike):
    """A loader that reads a value on the host and writes it (vLLM's one-element `fill_(x.item())`)."""

    def load_weights(self, weights: Any) -> set[str]:
        for name, tensor in weights:
            if name == "q":
                self.qkv.data[0, 0].fill_(tensor[0, 0].item())
        return {"q"}


@pytest.mark.parametrize(("model", "why"), [(_Transforming(), "not a view"), (_ReadsValue(), r"\.item")])
def test_a_load_that_cannot_be_replayed_leaves_no_plan_but_still_loads(model: Any, why: str) -> None:
    staged = _update(1.0)
    plan, reason = CopyPlan.record(model, staged)
    assert plan is None and reason and __import__("re").search(why, reason)
    assert model.qkv.float().abs().sum() > 0  # the load itself happened
