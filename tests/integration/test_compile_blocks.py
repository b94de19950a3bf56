"""`model.compile_blocks` on the real tiny Qwen3-VL (vision tower included), on CPU, float32.

The policy loaded with `compile_blocks: true` (`learner.kernels.compile_blocks`: every decoder layer and ViT
block under `torch.compile(dynamic=True)`) against the same checkpoint loaded eagerly:

- a packed row of three image segments (different image-token counts) through the learner's own training
  step (`packed_attention` + `micro_step_loss` + backward of its sums) gives the same loss and
  parameter gradients, also under gradient checkpointing, and a second row of other lengths reuses the graphs
  (no recompilation);
- the colocated HF rollout of an image prompt gives the same greedy tokens and compiles nothing (generation
  runs under `force_eager`);
- the knob's validation: with `liger_kernel` it is a clear error;
- `load_policy` merges the deepstack features by index (`learner.kernels.index_deepstack`) and the training
  step equals transformers' boolean-mask merge.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from pydantic import ValidationError

from learner.batching.packing import pack_segments
from learner.config import ModelConfig, RunConfig
from learner.data.prompt_encoding import PromptEncoder
from learner.kernels import index_deepstack, packed_attention
from learner.policy import load_policy
from learner.rollout.colocate.hf import HfColocateBackend
from learner.stage2.step import micro_step_loss
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig

pytestmark = pytest.mark.integration


def _cfg(model_dir: Path, compile_blocks: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir), "dtype": "float32", "compile_blocks": compile_blocks},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
        }
    )


@pytest.fixture(scope="module")
def policies(tiny_vlm_dir: Path):
    """(eager policy, compiled policy, the compiled blocks' count) of the same checkpoint."""
    eager = load_policy(_cfg(tiny_vlm_dir, False).model, tiny_vlm_dir)
    compiled = load_policy(_cfg(tiny_vlm_dir, True).model, tiny_vlm_dir)
    n = sum(getattr(m, "_compiled_call_impl", None) is not None for m in compiled.model.modules())
    return eager, compiled, n


def test_compile_blocks_compiles_every_decoder_layer_and_vit_block(policies) -> None:
    eager, _, n = policies
    cfg = eager.model.config
    assert n == cfg.text_config.num_hidden_layers + cfg.vision_config.depth
    assert not any(getattr(m, "_compiled_call_impl", None) is not None for m in eager.model.modules())


def _segments(policy, tiny_vlm_dir: Path, folder: Path, sizes: list[tuple[int, int]]):
    from PIL import Image

    from learner.data.records import build_sample, validate_record
    from learner.stage2.pipeline import prepare_segment
    from learner.trainers.build import sample_context
    from shared_schemas.infer import Choice, InferResult

    cfg = _cfg(tiny_vlm_dir, False)
    encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
    ctx = sample_context(cfg, policy.tokenizer, encoder)
    objects = [
        {"desc": "cat", "bbox_2d": [10, 20, 300, 400]},
        {"desc": "dog", "bbox_2d": [500, 520, 760, 900]},
    ]
    answer = (
        '{"object_1": {"desc": "cat", "bbox_2d": [<|coord_12|>, <|coord_20|>, <|coord_290|>, <|coord_400|>]}}'
    )
    segments = []
    for k, (w, h) in enumerate(sizes):
        Image.radial_gradient("L").convert("RGB").resize((w, h)).save(folder / f"img{k}.png")
        record = validate_record(
            {"images": [f"img{k}.png"], "width": w, "height": h, "objects": objects},
            path=str(folder / "d.jsonl"),
        )
        sample = build_sample(record, base_idx=k, dataset="d", dataset_namespace=0)
        prompt = ctx.encode_prompt(sample)
        ids = policy.tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        result = InferResult(
            index=k,
            request_id=None,
            prompt_token_ids=list(prompt.ids),
            choices=[Choice(token_ids=ids, text="", finish_reason="stop")],
            weight_version=0,
        )
        seg, outcome = prepare_segment(sample, result, ctx, rollout_step=0)
        assert seg is not None, outcome.counters
        segments.append(seg)
    return segments, torch.tensor(ctx.coord_vocab.ids), ctx.eot_id


def _train_step(
    model, batch, coord_ids, eos_id: int, checkpointing: bool = False
) -> tuple[float, dict[str, torch.Tensor]]:
    """The learner's step on one packed row: (loss, {parameter name: gradient})."""
    model.train()
    model.zero_grad()
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    with packed_attention(model):
        sums = micro_step_loss(model, batch, coord_ids=coord_ids, eos_id=eos_id).sums
        loss = sums.s_ce + sums.s_coord
        loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad()
    model.gradient_checkpointing_disable()
    model.eval()
    return float(loss.detach()), grads


def test_compiled_training_step_equals_eager(policies, tiny_vlm_dir: Path, tmp_path: Path) -> None:
    from torch._dynamo.utils import counters

    eager, compiled, _ = policies
    first, coord_ids, eos_id = _segments(eager, tiny_vlm_dir, tmp_path, [(64, 64), (128, 96), (96, 160)])
    second, _, _ = _segments(eager, tiny_vlm_dir, tmp_path, [(160, 96), (64, 64), (96, 96)])
    for segments in (first, second):
        batch = pack_segments(segments)
        loss_eager, grads_eager = _train_step(eager.model, batch, coord_ids, eos_id)
        loss_compiled, grads_compiled = _train_step(compiled.model, batch, coord_ids, eos_id)
        assert loss_compiled == pytest.approx(loss_eager, rel=1e-5)
        assert grads_eager.keys() == grads_compiled.keys() and grads_eager
        for name, grad in grads_eager.items():
            torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-5, msg=name)
        if segments is first:
            graphs = counters["stats"]["unique_graphs"]
            assert graphs > 0  # the blocks did compile
    # A row of other lengths (same segment count: the CPU fallback unrolls its per-segment loop) reuses them.
    assert counters["stats"]["unique_graphs"] == graphs


def test_compiled_blocks_under_gradient_checkpointing(policies, tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """Checkpointing re-runs each compiled block in the backward: same loss and gradients as the eager step
    without checkpointing."""
    eager, compiled, _ = policies
    segments, coord_ids, eos_id = _segments(eager, tiny_vlm_dir, tmp_path, [(64, 64), (128, 96), (96, 160)])
    batch = pack_segments(segments)
    loss_eager, grads_eager = _train_step(eager.model, batch, coord_ids, eos_id)
    loss_compiled, grads_compiled = _train_step(compiled.model, batch, coord_ids, eos_id, checkpointing=True)
    assert loss_compiled == pytest.approx(loss_eager, rel=1e-5)
    assert grads_eager.keys() == grads_compiled.keys()
    for name, grad in grads_eager.items():
        torch.testing.assert_close(grads_compiled[name], grad, rtol=1e-4, atol=1e-5, msg=name)


def test_generation_stays_eager_and_equal(policies) -> None:
    from PIL import Image
    from torch._dynamo.utils import counters

    eager, compiled, _ = policies
    image = Image.linear_gradient("L").convert("RGB").resize((128, 96))
    messages = [
        {"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "List."}]}
    ]
    tokens = []
    for policy in (eager, compiled):
        encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
        backend = HfColocateBackend(policy.model, policy.tokenizer, batch_size=1, encoder=encoder)
        before = dict(counters["stats"])
        batch = InferBatch(
            infer_requests=[InferRequest(messages=messages)], request_config=RequestConfig(max_tokens=8)
        )
        tokens.append(backend.generate(batch)[0].choices[0].token_ids)
        assert dict(counters["stats"]) == before  # nothing traced or compiled while decoding
    assert tokens[1] == tokens[0] and tokens[0]


def test_compile_blocks_with_liger_is_rejected() -> None:
    with pytest.raises(ValidationError, match="do not compose"):
        ModelConfig.model_validate({"path": "x", "compile_blocks": True, "liger_kernel": True})


def test_policy_merges_deepstack_by_index_as_transformers(
    policies, tiny_vlm_dir: Path, tmp_path: Path
) -> None:
    eager, _, _ = policies
    (text_model,) = [m for m in eager.model.modules() if type(m).__name__ == "Qwen3VLTextModel"]
    assert "_deepstack_process" in vars(text_model)  # load_policy applied it
    assert eager.model.config.vision_config.deepstack_visual_indexes  # the tiny model has deepstack layers
    segments, coord_ids, eos_id = _segments(eager, tiny_vlm_dir, tmp_path, [(64, 64), (128, 96)])
    batch = pack_segments(segments)
    loss_index, grads_index = _train_step(eager.model, batch, coord_ids, eos_id)
    index_deepstack(eager.model, enabled=False)
    try:
        assert "_deepstack_process" not in vars(text_model)
        loss_mask, grads_mask = _train_step(eager.model, batch, coord_ids, eos_id)
    finally:
        index_deepstack(eager.model)
    assert loss_index == pytest.approx(loss_mask, rel=1e-6)
    assert grads_index.keys() == grads_mask.keys()
    for name, grad in grads_mask.items():
        torch.testing.assert_close(grads_index[name], grad, rtol=1e-5, atol=1e-7, msg=name)
