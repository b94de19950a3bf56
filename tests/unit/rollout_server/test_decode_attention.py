"""Grouped-query decode attention: same output as transformers' `sdpa` path, taken only where it applies, and
the model's attention implementation restored afterwards."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from rollout_server.engines import decode_attention
from rollout_server.engines.decode_attention import GROUPED_DECODE_SDPA, grouped_decode_sdpa


def padded_mask(lengths: list[int], kv_len: int, width: int) -> torch.Tensor:
    """Additive `(B, 1, 1, width)` mask: the last `lengths[b]` of the first `kv_len` keys attend."""
    keep = torch.zeros(len(lengths), width, dtype=torch.bool)
    for b, n in enumerate(lengths):
        keep[b, kv_len - n :] = True
    keep[:, kv_len:] = True
    return torch.zeros(keep.shape).masked_fill(~keep, torch.finfo(torch.float32).min)[:, None, None, :]


@pytest.mark.parametrize("groups", [2, 4, 7])
@pytest.mark.parametrize("mask_width", ["exact", "longer"])
def test_grouped_decode_equals_sdpa_with_repeat_kv(groups: int, mask_width: str) -> None:
    torch.manual_seed(groups)
    batch, kv_heads, kv_len, dim = 3, 2, 19, 32
    module = SimpleNamespace(num_key_value_groups=groups, is_causal=True)
    query = torch.randn(batch, kv_heads * groups, 1, dim)
    key, value = torch.randn(batch, kv_heads, kv_len, dim), torch.randn(batch, kv_heads, kv_len, dim)
    mask = padded_mask([19, 4, 11], kv_len, kv_len if mask_width == "exact" else 32)
    got, _ = grouped_decode_sdpa(module, query, key, value, mask, scaling=dim**-0.5)
    want, _ = sdpa_attention_forward(module, query, key, value, mask[..., :kv_len], scaling=dim**-0.5)
    assert got.shape == want.shape == (batch, 1, kv_heads * groups, dim)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_non_decode_calls_are_plain_sdpa(monkeypatch) -> None:
    """Prefill (several queries), no mask, or no GQA: delegated to transformers' function untouched."""
    calls = []

    def spy(*args, **kwargs):
        calls.append(args[1].shape)
        return sdpa_attention_forward(*args, **kwargs)

    monkeypatch.setattr("transformers.integrations.sdpa_attention.sdpa_attention_forward", spy)
    grouped = SimpleNamespace(num_key_value_groups=2, is_causal=True)
    plain = SimpleNamespace(num_key_value_groups=1, is_causal=True)
    key = value = torch.randn(1, 1, 5, 32)
    mask = padded_mask([5], 5, 5)
    grouped_decode_sdpa(grouped, torch.randn(1, 2, 5, 32), key, value, None)  # prefill
    grouped_decode_sdpa(grouped, torch.randn(1, 2, 1, 32), key, value, None)  # unpadded decode
    grouped_decode_sdpa(plain, torch.randn(1, 1, 1, 32), key, value, mask)  # no GQA
    assert len(calls) == 3
    grouped_decode_sdpa(grouped, torch.randn(1, 2, 1, 32), key, value, mask)  # the grouped path
    assert len(calls) == 3


def test_decode_switches_and_restores_the_implementation(tiny_model_dir, tiny_tokenizer, monkeypatch) -> None:
    """A padded batch decodes through the grouped function (the tiny model has 2 query heads per KV head)
    and leaves the model on `sdpa`; an `eager` model is never switched."""
    from transformers import AutoModelForCausalLM

    from rollout_server.engines.hf_decode import decode_rows

    grouped_steps = []
    original = decode_attention.grouped_decode_sdpa

    def counting(module, query, *args, **kwargs):
        grouped_steps.append(query.shape[2])
        return original(module, query, *args, **kwargs)

    monkeypatch.setattr(decode_attention, "grouped_decode_sdpa", counting)
    monkeypatch.setattr(decode_attention, "_registered", False)
    cfg_kwargs = dict(pad_id=0, eos_ids=[2], end_of_turn_id=2, decode_text=tiny_tokenizer.decode)
    from shared_schemas.infer import RequestConfig

    prompts = [tiny_tokenizer.encode("a"), tiny_tokenizer.encode("the lamp and the dog")]
    cfg = RequestConfig(max_tokens=4, temperature=0.0, ignore_eos=True)
    for attn, expect_grouped in (("sdpa", True), ("eager", False)):
        grouped_steps.clear()
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation=attn).eval()
        decode_rows(model, prompts, [0, 1], cfg, **cfg_kwargs)
        assert model.config._attn_implementation == attn
        layers = model.config.num_hidden_layers
        # Prefill goes through the function too (delegated); the 3 one-token steps are grouped.
        assert (grouped_steps.count(1) == 3 * layers) is expect_grouped
    # Re-register the real function for the rest of the session.
    monkeypatch.undo()
    decode_attention._registered = False
    assert decode_attention._register()


def test_concurrent_decodes_share_one_switch(tiny_model_dir) -> None:
    """Two threads inside the switch on one model: the implementation is restored only after both leave."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, attn_implementation="sdpa")
    inside, release = threading.Barrier(2), threading.Event()
    seen = []

    def hold() -> None:
        with decode_attention._grouped_decode(model):
            inside.wait()
            seen.append(model.config._attn_implementation)
            release.wait()

    first = threading.Thread(target=hold)
    first.start()
    with decode_attention._grouped_decode(model):
        inside.wait()
        release.set()
        first.join()
        assert model.config._attn_implementation == GROUPED_DECODE_SDPA
    assert seen == [GROUPED_DECODE_SDPA]
    assert model.config._attn_implementation == "sdpa"
