"""Teacher forcing with images on the real tiny Qwen3-VL (vision tower included):
docs/ALGORITHM.md#teacher-forced-encoding, §13, §14.

Segments come from the learner's own path — image records → `build_sample` → `SampleContext.encode_prompt`
(processor-expanded ids, vision tensors, M-RoPE prompt positions) → `prepare_segment` with a rollout that
matched part of the GT — for three images of different sizes (different image-token counts). Checked:

- a segment's M-RoPE positions (prompt positions continued over the answer) equal the model's own
  `get_rope_index` over the whole segment;
- a packed row of the three segments computes what each segment computes alone (per-segment logits), and
  its loss sums equal the right-padded rows' within 1e-5, with full and with compact logits;
- negative control: the same packed row with plain 1-D positions (no M-RoPE rows) gives different logits,
  so the test sees the positions.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.batching.packed_batch import segment_rope_positions
from learner.batching.packing import pack_segments, pad_segments
from learner.config import RunConfig
from learner.data.prompt_encoding import PromptEncoder
from learner.data.records import build_sample, validate_record
from learner.policy import load_policy
from learner.stage2.losses import CoordLossConfig, read_columns, step_loss_sums
from learner.stage2.pipeline import prepare_segment
from learner.trainers.build import sample_context
from shared_schemas.infer import Choice, InferResult

pytestmark = pytest.mark.integration

SIZES = [(64, 64), (128, 96), (96, 160)]  # 4, 12 and 15 image tokens
OBJECTS = [
    {"desc": "cat", "bbox_2d": [10, 20, 300, 400]},
    {"desc": "dog", "bbox_2d": [500, 520, 760, 900]},
]


def _cfg(model_dir: Path) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {"loss": {"fn_desc_ce": True}},
        }
    )


@pytest.fixture(scope="module")
def vl_parts(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    from PIL import Image

    cfg = _cfg(tiny_vlm_dir)
    policy = load_policy(cfg.model, tiny_vlm_dir)
    model = policy.model.eval()
    encoder = PromptEncoder.for_model(model, policy.tokenizer, policy.processor)
    ctx = sample_context(cfg, policy.tokenizer, encoder)
    folder = tmp_path_factory.mktemp("vl_images")
    segments = []
    for k, (w, h) in enumerate(SIZES):
        img = Image.radial_gradient("L").convert("RGB").resize((w, h))
        img.save(folder / f"img{k}.png")
        record = validate_record(
            {"images": [f"img{k}.png"], "width": w, "height": h, "objects": OBJECTS},
            path=str(folder / "d.jsonl"),
        )
        sample = build_sample(record, base_idx=k, dataset="d", dataset_namespace=0)
        prompt = ctx.encode_prompt(sample)
        # A rollout that got the first object (and wrote a different second one):
        # prefix + matched targets + miss.
        answer = (
            '{"object_1": {"desc": "cat", "bbox_2d": '
            "[<|coord_12|>, <|coord_20|>, <|coord_290|>, <|coord_400|>]}}"
        )
        result = InferResult(
            index=k,
            request_id=None,
            prompt_token_ids=list(prompt.ids),
            choices=[
                Choice(
                    token_ids=policy.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False),
                    text="",
                    finish_reason="stop",
                )
            ],
            weight_version=0,
        )
        seg, outcome = prepare_segment(sample, result, ctx, rollout_step=0)
        assert seg is not None, outcome.counters
        segments.append(seg)
    coord_ids = torch.tensor(ctx.coord_vocab.ids)
    return model, segments, coord_ids, ctx


def test_segments_carry_images_and_their_own_rope_positions(vl_parts) -> None:
    model, segments, _, _ = vl_parts
    image_id = model.config.image_token_id
    counts = [sum(t == image_id for t in s.input_ids) for s in segments]
    assert counts == [4, 12, 15]
    for seg in segments:
        assert seg.mm_inputs["image_grid_thw"].shape == (1, 3)
        ids = torch.tensor([seg.input_ids])
        types = (ids == image_id).long()
        expected, _ = model.model.get_rope_index(
            ids, mm_token_type_ids=types, image_grid_thw=seg.mm_inputs["image_grid_thw"]
        )
        assert segment_rope_positions(seg.rope_positions, len(seg.input_ids)) == expected[:, 0].tolist()
        assert expected[1:, 0].ne(expected[0, 0]).any()  # real 2-D image positions, not plain text positions


def _alone(model, seg) -> torch.Tensor:
    batch = pack_segments([seg])
    with torch.no_grad():
        return model(**batch.model_inputs()).logits[0]


def test_packed_row_equals_each_segment_alone(vl_parts) -> None:
    model, segments, _, _ = vl_parts
    packed = pack_segments(segments)
    assert packed.position_ids.shape == (4, 1, sum(len(s.input_ids) for s in segments))
    assert packed.mm_inputs["image_grid_thw"].shape == (3, 3)
    bounds = packed.cu_seqlens.tolist()
    with torch.no_grad():
        logits = model(**packed.model_inputs()).logits[0]
        flat = model(**{**packed.model_inputs(), "position_ids": packed.position_ids[0]}).logits[0]
    for i, seg in enumerate(segments):
        alone = _alone(model, seg)
        torch.testing.assert_close(logits[bounds[i] : bounds[i + 1]], alone, rtol=1e-5, atol=1e-5)
        if i:  # 1-D positions disagree with M-RoPE after the first image token
            assert (flat[bounds[i] : bounds[i + 1]] - alone).abs().max() > 1e-4


@pytest.mark.parametrize("compact", [False, True])
def test_packed_and_padded_losses_are_equal(vl_parts, compact: bool) -> None:
    model, segments, coord_ids, ctx = vl_parts
    cfg = CoordLossConfig()
    sums = []
    for batch in (pack_segments(segments), pad_segments(segments, ctx.tokenizer.pad_token_id)):
        columns = read_columns(batch.labels, batch.coord_pos) if compact else None
        keep = {} if columns is None else {"logits_to_keep": columns}
        with torch.no_grad():
            logits = model(**batch.model_inputs(), **keep).logits
        sums.append(
            step_loss_sums(
                logits, batch, coord_ids=coord_ids, coord_cfg=cfg, eos_id=ctx.eot_id, columns=columns
            )
        )
    packed, padded = sums
    assert (packed.n_ce, packed.n_coord) == (padded.n_ce, padded.n_coord)
    assert packed.n_coord > 0 and packed.n_ce > 0
    for name in ("s_ce", "s_coord", "s_coord_prefix", "s_ce_eos"):
        a, b = getattr(packed, name).item(), getattr(padded, name).item()
        assert a == pytest.approx(b, rel=1e-5, abs=1e-5), name


def _step(model, batch, coord_ids, eos_id: int, **forward_kwargs):
    """`forward_for_loss` (compact logits) + `step_loss_sums` + backward of CE + coord; returns
    `(outputs, columns, {parameter name: gradient})`."""
    from learner.stage2.step import forward_for_loss

    out, columns = forward_for_loss(model, batch, compact=True, **forward_kwargs)
    sums = step_loss_sums(
        out.logits, batch, coord_ids=coord_ids, coord_cfg=CoordLossConfig(), eos_id=eos_id, columns=columns
    )
    (sums.s_ce + sums.s_coord).backward()
    return out, columns, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("layout", ["packed", "padded"])
def test_segment_attention_equals_sdpa_values_and_gradients(vl_parts, layout: str) -> None:
    """`stage2.loss.segment_attention`: per-segment causal SDPA without a mask = transformers' sdpa with its
    block-diagonal (packed) or padding (padded) mask — logits at the read columns and parameter gradients."""
    from learner.kernels import SEGMENT_SDPA

    model, segments, coord_ids, ctx = vl_parts
    batch = (
        pack_segments(segments) if layout == "packed" else pad_segments(segments, ctx.tokenizer.pad_token_id)
    )
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(True)  # the vision tower's gradients too
    results = []
    for segment_attention in (False, True):
        model.zero_grad()
        out, columns, grads = _step(model, batch, coord_ids, ctx.eot_id, segment_attention=segment_attention)
        # Padded rows: positions past a row's end are padding (don't-care without a mask; no loss reads them).
        real = torch.ones_like(out.logits[..., 0], dtype=torch.bool)
        if batch.attention_mask is not None:
            real = batch.attention_mask[:, columns].bool()
        results.append((out.logits.detach()[real], grads))
    assert model.config.text_config._attn_implementation == "sdpa"  # restored after the forward
    assert SEGMENT_SDPA != "sdpa"
    (ref_logits, ref_grads), (seg_logits, seg_grads) = results
    torch.testing.assert_close(seg_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == seg_grads.keys() and any("visual" in n for n in ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(seg_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    model.zero_grad()
    for n, p in model.named_parameters():
        p.requires_grad_(trainable[n])


def test_segment_attention_under_gradient_checkpointing(vl_parts) -> None:
    """Checkpointing re-runs the forward inside the backward: wrapped around forward AND backward (as the
    trainer's `training_step` is), the packed row's gradients equal the plain sdpa ones without
    checkpointing."""
    from learner.kernels import packed_attention
    from learner.stage2.step import forward_for_loss

    model, segments, coord_ids, ctx = vl_parts
    batch = pack_segments(segments)

    def grads(checkpointing: bool, segment_attention: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        try:
            with packed_attention(model, enabled=segment_attention):
                out, columns = forward_for_loss(
                    model, batch, compact=True, segment_attention=segment_attention
                )
                sums = step_loss_sums(
                    out.logits,
                    batch,
                    coord_ids=coord_ids,
                    coord_cfg=CoordLossConfig(),
                    eos_id=ctx.eot_id,
                    columns=columns,
                )
                (sums.s_ce + sums.s_coord).backward()
        finally:
            model.gradient_checkpointing_disable()
            model.eval()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    reference = grads(checkpointing=False, segment_attention=False)
    checkpointed = grads(checkpointing=True, segment_attention=True)
    assert reference and reference.keys() == checkpointed.keys()
    for name, grad in reference.items():
        torch.testing.assert_close(checkpointed[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    model.zero_grad()


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
def test_varlen_attention_equals_segment_loop(vl_parts, monkeypatch, checkpointing: bool) -> None:
    """The varlen path (one kernel call per packed row in every language layer AND every vision block) gives
    the per-segment loop's logits and gradients. The flash kernel is CUDA-only, so a dense stand-in takes its
    place on CPU (`tests/unit/learner/varlen_reference.py`); its call counts show both towers used it."""
    from learner.kernels import attention as pa
    from learner.kernels.varlen import torch_op
    from tests.unit.learner.varlen_reference import API_FULL, ReferenceVarlen

    model, segments, coord_ids, ctx = vl_parts
    ref = ReferenceVarlen()
    monkeypatch.setattr(torch_op, "_varlen_op", lambda: (ref, API_FULL))
    monkeypatch.setattr(pa, "varlen_kernel", lambda q, k, causal, choice: "torch" if choice else None)
    batch = pack_segments(segments)
    trainable = {n: p.requires_grad for n, p in model.named_parameters()}
    for p in model.parameters():
        p.requires_grad_(True)
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
    results = []
    try:
        for varlen in (False, True):
            model.zero_grad()
            with pa.packed_attention(model, varlen=varlen):
                out, _, grads = _step(model, batch, coord_ids, ctx.eot_id)
            results.append((out.logits.detach(), grads))
    finally:
        model.gradient_checkpointing_disable()
        model.eval()
        model.zero_grad()
        for n, p in model.named_parameters():
            p.requires_grad_(trainable[n])
    text, vision = model.config.text_config, model.config.vision_config
    assert text._attn_implementation == vision._attn_implementation == "sdpa"  # restored
    layers, blocks = text.num_hidden_layers, vision.depth
    passes = 2 if checkpointing else 1  # checkpointing re-runs the forward in the backward
    assert ref.causal_calls == passes * layers and ref.calls == passes * (layers + blocks)
    (ref_logits, ref_grads), (var_logits, var_grads) = results
    torch.testing.assert_close(var_logits, ref_logits, rtol=1e-5, atol=1e-5)
    assert ref_grads.keys() == var_grads.keys() and any("visual" in n for n in ref_grads)
    for name, grad in ref_grads.items():
        torch.testing.assert_close(var_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_vision_tower_ignores_the_rows_bounds(vl_parts, monkeypatch) -> None:
    """Some transformers releases (5.17) pass the whole model's keyword arguments, the language model's
    `cu_seq_lens_q` / `max_length_q` among them, on into the vision tower, whose varlen branch names its own
    `cu_seq_lens_q`: under `packed_attention` the tower drops the row's bounds and attends per image."""
    from learner.kernels import attention as pa
    from learner.kernels.varlen import torch_op
    from tests.unit.learner.varlen_reference import API_FULL, ReferenceVarlen

    model, segments, _, _ = vl_parts
    ref = ReferenceVarlen()
    monkeypatch.setattr(torch_op, "_varlen_op", lambda: (ref, API_FULL))
    monkeypatch.setattr(pa, "varlen_kernel", lambda q, k, causal, choice: "torch")
    batch = pack_segments(segments)
    tower = model.model.visual
    pixels, grid = batch.mm_inputs["pixel_values"], batch.mm_inputs["image_grid_thw"]
    with torch.no_grad():
        plain = tower(pixels, grid_thw=grid).pooler_output
        with pa.packed_attention(model):
            leaked = tower(
                pixels, grid_thw=grid, cu_seq_lens_q=batch.cu_seqlens, max_length_q=batch.max_seqlen
            )
    assert ref.calls == model.config.vision_config.depth and ref.causal_calls == 0
    torch.testing.assert_close(leaked.pooler_output, plain, rtol=1e-5, atol=1e-5)
