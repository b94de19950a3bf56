"""Packed vs unpacked teacher forcing on the real tiny HF Qwen2 model (docs/ALGORITHM.md#packed-rows, §14.6).

Checks, on real segments built from the tiny tokenizer:
- the sum-form losses ``S_ce`` / ``S_coord`` of one packed row equal those of the same segments run as
  right-padded rows (and their counts are identical);
- segment isolation: with ``position_ids`` restarting per segment and ``attention_mask=None``,
  transformers builds the block-diagonal causal mask itself, so the packed row's logits equal each
  segment's logits run alone. Negative controls show what breaks it: an explicit all-ones mask, or a
  KV cache object (``use_cache=True``, the config default) — both silently disable transformers' packed
  sequence detection, hence ``PackedBatch.model_inputs()`` passes ``use_cache=False``.
"""

from __future__ import annotations

import pytest
import torch

from learner.batching.packing import pack_segments, pad_segments
from learner.stage2.coords import CoordVocab
from learner.stage2.losses import CoordLossConfig, step_loss_sums
from learner.stage2.targets.labels import build_labels
from learner.stage2.targets.segment import Segment, SegmentMeta

pytestmark = pytest.mark.integration

CASES = [
    ("find the cats", [(12, 40, 300, 410)], [("dog", (520, 400, 760, 640))]),
    ("list every object in the picture please", [], [("rug", (1, 2, 998, 999)), ("cat", (5, 6, 7, 8))]),
    ("boxes?", [(100, 80, 300, 620), (880, 60, 990, 180)], []),
]


def _obj(k: int, desc: str, box: tuple[int, ...]) -> str:
    coords = ", ".join(f'"<|coord_{b}|>"' for b in box)
    return f'"object_{k}": {{"desc": "{desc}", "bbox_2d": [{coords}]}}'


def _segment(tok, vocab: CoordVocab, case_index: int) -> Segment:
    user, prefix_boxes, tail_objs = CASES[case_index]
    prompt = list(
        tok.apply_chat_template([{"role": "user", "content": user}], add_generation_prompt=True)["input_ids"]
    )
    prefix_text = (
        "{"
        + ", ".join(_obj(i + 1, "thing", b) for i, b in enumerate(prefix_boxes))
        + ("}" if prefix_boxes else "")
    )
    sep = ", " if prefix_boxes else ""
    n0 = len(prefix_boxes)
    tail_text = sep + ", ".join(_obj(n0 + i + 1, d, b) for i, (d, b) in enumerate(tail_objs)) + "}"
    prefix = tok.encode(prefix_text, add_special_tokens=False)
    tail = tok.encode(tail_text, add_special_tokens=False)
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    newline = tok.encode("\n", add_special_tokens=False)
    ids = prompt + prefix + tail + [eot, *newline]
    slots = [i for i, t in enumerate(prefix) if vocab.is_coord(t)]
    targets = [
        min(999, vocab.bin_of(prefix[i]) + 3) for i in slots
    ]  # §9 targets differ from the rollout's bins
    pieces = tok.convert_ids_to_tokens(tail)
    ignore = [i for i, p in enumerate(pieces) if p in {"dog", "rug", "cat"}]
    lab = build_labels(
        ids, len(prompt), len(prefix), len(prefix) + len(tail), slots, targets, ignore, [], vocab
    )
    meta = SegmentMeta(
        sample_id=case_index,
        base_idx=case_index,
        encoded_len=len(ids),
        prompt_len=len(prompt),
        prompt_ids=tuple(prompt),
        prefix_len=len(prefix),
        train_len=len(prefix) + len(tail),
        prefix_coord_pos=tuple(slots),
        prefix_coord_target_bins=tuple(targets),
        tail_ignore_pos=tuple(ignore),
        prefix_ce_pos=(),
        rollout_step=0,
    )
    return Segment(tuple(ids), tuple(lab.labels), tuple(lab.coord_pos), tuple(lab.coord_bins),
                   tuple(lab.coord_is_prefix), meta)  # fmt: skip


@pytest.fixture(scope="module")
def model_and_segments(tiny_model_dir, tiny_tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    model.eval()
    vocab = CoordVocab.from_tokenizer(tiny_tokenizer)
    segments = [_segment(tiny_tokenizer, vocab, i) for i in range(len(CASES))]
    assert len({s.encoded_len for s in segments}) == len(segments)  # different lengths -> real padding
    return model, segments, torch.tensor(vocab.ids), tiny_tokenizer


def test_packed_and_padded_loss_sums_are_equal(model_and_segments) -> None:
    model, segments, coord_ids, tok = model_and_segments
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    packed, padded = pack_segments(segments), pad_segments(segments, tok.pad_token_id)
    cfg = CoordLossConfig()
    with torch.no_grad():
        lp = model(**packed.model_inputs()).logits
        ld = model(**padded.model_inputs()).logits
    sp = step_loss_sums(lp, packed, coord_ids=coord_ids, coord_cfg=cfg, eos_id=eot)
    sd = step_loss_sums(ld, padded, coord_ids=coord_ids, coord_cfg=cfg, eos_id=eot)
    assert (sp.n_ce, sp.n_coord, sp.n_coord_prefix, sp.n_ce_eos) == (
        sd.n_ce,
        sd.n_coord,
        sd.n_coord_prefix,
        3,
    )
    assert sp.n_coord_prefix == 4 + 8 and sp.n_coord == 12 + 12
    assert sp.s_ce.item() == pytest.approx(sd.s_ce.item(), rel=1e-5, abs=1e-5)
    assert sp.s_coord.item() == pytest.approx(sd.s_coord.item(), rel=1e-5, abs=1e-5)
    assert sp.s_coord_prefix.item() == pytest.approx(sd.s_coord_prefix.item(), rel=1e-5, abs=1e-5)
    assert sp.s_ce_eos.item() == pytest.approx(sd.s_ce_eos.item(), rel=1e-5, abs=1e-5)


def _alone(model, segments) -> list[torch.Tensor]:
    with torch.no_grad():
        return [model(input_ids=torch.tensor([s.input_ids]), use_cache=False).logits[0] for s in segments]


def _max_diff_per_segment(logits: torch.Tensor, alone: list[torch.Tensor], bounds: list[int]) -> list[float]:
    return [(logits[bounds[i] : bounds[i + 1]] - a).abs().max().item() for i, a in enumerate(alone)]


def test_segment_isolation_in_packed_row(model_and_segments) -> None:
    model, segments, _, _ = model_and_segments
    packed = pack_segments(segments)
    bounds = packed.cu_seqlens.tolist()
    alone = _alone(model, segments)
    with torch.no_grad():
        logits = model(**packed.model_inputs()).logits[0]
    assert max(_max_diff_per_segment(logits, alone, bounds)) < 1e-5

    # Negative controls: isolation really comes from transformers' packed-sequence detection.
    with torch.no_grad():
        ones = torch.ones_like(packed.input_ids)
        leaked_mask = model(input_ids=packed.input_ids, position_ids=packed.position_ids, attention_mask=ones,
                            use_cache=False).logits[0]  # fmt: skip
        leaked_cache = model(
            input_ids=packed.input_ids, position_ids=packed.position_ids, use_cache=True
        ).logits[0]
    for leaked in (leaked_mask, leaked_cache):
        diffs = _max_diff_per_segment(leaked, alone, bounds)
        assert diffs[0] < 1e-5 and min(diffs[1:]) > 1e-3


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_segment_attention_equals_sdpa(model_and_segments, layout: str) -> None:
    """`stage2.loss.segment_attention` (per-segment causal SDPA, no mask) = sdpa with its mask: values at the
    real positions and parameter gradients (the VL version: tests/integration/test_vl_packing.py)."""
    from learner.stage2.step import forward_for_loss

    model, segments, coord_ids, tok = model_and_segments
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    batch = pack_segments(segments) if layout == "packed" else pad_segments(segments, tok.pad_token_id)
    real = (
        torch.ones_like(batch.input_ids, dtype=torch.bool)
        if batch.attention_mask is None
        else batch.attention_mask.bool()
    )
    results = []
    for segment_attention in (False, True):
        model.zero_grad()
        out, _ = forward_for_loss(model, batch, compact=False, segment_attention=segment_attention)
        sums = step_loss_sums(out.logits, batch, coord_ids=coord_ids, coord_cfg=CoordLossConfig(), eos_id=eot)
        (sums.s_ce + sums.s_coord).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        results.append((out.logits.detach()[real], grads))
    assert model.config._attn_implementation == "sdpa"
    (ref, ref_grads), (seg, seg_grads) = results
    torch.testing.assert_close(seg, ref, rtol=1e-5, atol=1e-5)
    assert ref_grads and ref_grads.keys() == seg_grads.keys()
    for name, grad in ref_grads.items():
        torch.testing.assert_close(seg_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    model.zero_grad()
