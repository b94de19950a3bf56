"""`learner.flops`: the FLOP count of a micro-step by hand on a made-up model (trained, frozen tower, frozen
everything), the parameter split of a real (tiny) Qwen3-VL, the peak table and the MFU arithmetic."""

from __future__ import annotations

import pytest

from learner.flops import FlopModel, peak_tflops, utilization


def _model(vision_trainable: bool, lm_trainable: bool) -> FlopModel:
    return FlopModel(
        vision_patch=(100, 100 if vision_trainable else 0),
        vision_merged=(10, 10 if vision_trainable else 0),
        lm_body=(1000, 1000 if lm_trainable else 0),
        lm_head=(50, 50 if lm_trainable else 0),
        lm_attn=(2, 4, 8),
        vision_attn=(3, 2, 16),
        merge=4,
    )


SEGMENTS = [3, 5]  # 8 language tokens, 6 + 15 = 21 causal pairs
FRAMES = [(1, 8), (2, 4)]  # 16 patches (4 merged tokens); 64 + 2 * 16 = 96 attention pairs per block


@pytest.mark.parametrize(
    ("vision_trainable", "lm_trainable", "model_flops", "attn_mult_lm", "attn_mult_vision"),
    [
        # all trained: 6 N n everywhere except the tower's first part, which no gradient has to pass
        (True, True, 4 * 100 * 16 + 6 * 10 * 4 + 6 * 1000 * 8 + 6 * 50 * 2, 3, 3),
        # frozen tower (the default): forward only there, 6 N n in the language model
        (False, True, 2 * 100 * 16 + 2 * 10 * 4 + 4 * 1000 * 8 + 6 * 50 * 2, 3, 1),
        # nothing trained: forward only
        (False, False, 2 * 100 * 16 + 2 * 10 * 4 + 2 * 1000 * 8 + 2 * 50 * 2, 1, 1),
    ],
    ids=["all_trained", "frozen_tower", "frozen"],
)
def test_step_flops(vision_trainable, lm_trainable, model_flops, attn_mult_lm, attn_mult_vision) -> None:
    flops = _model(vision_trainable, lm_trainable).step(SEGMENTS, logit_columns=2, image_frames=FRAMES)
    assert flops.tokens == 8
    assert flops.model == pytest.approx(model_flops)
    lm_attn = 4 * 4 * 8 * 21 * 2 * attn_mult_lm
    vision_attn = 4 * 2 * 16 * 96 * 3 * attn_mult_vision
    assert flops.attention == pytest.approx(lm_attn + vision_attn)


def test_trained_frozen_tower_lm_first_layer() -> None:
    """Text only, frozen tower: the language model is the first trained part, so its weights cost 4 N n (no
    input gradient to pass on), the head after it 6 N n."""
    flops = _model(False, True).step([4], logit_columns=4)
    assert flops.model == pytest.approx(4 * 1000 * 4 + 6 * 50 * 4)


def test_from_model_splits_tiny_qwen3_vl() -> None:
    from shared_schemas.vlm_shim import ensure_vl_imports

    ensure_vl_imports()
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 1e4, "mrope_section": [2, 1, 1]},
    )
    vision = dict(
        depth=2,
        hidden_size=16,
        intermediate_size=32,
        num_heads=2,
        patch_size=4,
        out_hidden_size=32,
        num_position_embeddings=16,
        deepstack_visual_indexes=[1],
    )
    model = Qwen3VLForConditionalGeneration(
        Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=True)
    )  # fmt: skip
    fm = FlopModel.from_model(model)
    embed = model.get_input_embeddings().weight.numel()
    pos = model.model.visual.pos_embed.weight.numel()
    total = sum(p.numel() for p in model.parameters())
    head_tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    assert fm.parameters == total - pos - (0 if head_tied else embed)
    assert fm.lm_head[0] == model.get_output_embeddings().weight.numel()
    assert fm.vision_patch[0] > 0 and fm.vision_merged[0] > 0 and fm.lm_body[0] > 0
    assert fm.lm_attn[0] == model.config.text_config.num_hidden_layers
    assert fm.vision_attn is not None and fm.vision_attn[0] == model.config.vision_config.depth
    for p in model.model.visual.parameters():
        p.requires_grad_(False)
    frozen = FlopModel.from_model(model)
    assert frozen.vision_patch == (fm.vision_patch[0], 0) and frozen.lm_body == fm.lm_body


def test_peak_table() -> None:
    assert peak_tflops("NVIDIA H100 80GB HBM3") == 989.0
    assert peak_tflops("NVIDIA H100 PCIe") == 756.0
    assert peak_tflops("NVIDIA H200") == 989.0
    assert peak_tflops("NVIDIA A100-SXM4-80GB") == 312.0
    assert peak_tflops("cpu") is None
    assert peak_tflops("cpu", override=1.5) == 1.5


def test_utilization() -> None:
    sums = {"perf/tokens": 8000.0, "perf/model_flops": 4e15, "perf/attn_flops": 1e15}
    out = utilization(sums, seconds=2.0, gpus=2, peak=1000.0)
    assert out["perf/tokens_per_s"] == pytest.approx(4000.0)
    assert out["perf/tflops_per_gpu"] == pytest.approx(1000.0)  # 4e15 / (2 s * 2 GPUs) / 1e12
    assert out["perf/attn_tflops_per_gpu"] == pytest.approx(250.0)
    assert out["perf/mfu"] == pytest.approx(1.0) and out["perf/mfu_with_attn"] == pytest.approx(1.25)
    assert "perf/mfu" not in utilization(sums, 2.0, 2, None)
    assert utilization(sums, 0.0, 2, 1000.0) == {}
