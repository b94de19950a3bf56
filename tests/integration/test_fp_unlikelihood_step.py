"""The unlikelihood loss on false positives over a whole step (docs/ALGORITHM.md#fp-unlikelihood): the planner
records the false positives of the kept prefix, the real model's step loss gains the term, packed and padded
rows agree. One path for text and image samples: the tiny Qwen2 on text records and the tiny Qwen3-VL (vision
tower, processor-expanded image tokens, M-RoPE positions) on image records, answered by a scripted policy."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.config import RunConfig
from learner.data.prompt_encoding import PromptEncoder
from learner.metrics import StepMetrics
from learner.policy import load_policy
from learner.stage2.losses import StepCounts
from learner.stage2.step import micro_step_loss
from learner.trainers.build import sample_context
from learner.trainers.overlap import RolloutOverlap
from learner.trainers.planner import StepPlanner
from tests.integration.test_reorder_step import ScriptedPolicy, _answer, _image_samples, _text_samples

pytestmark = pytest.mark.integration

ORDERS = [[0, 3, 1, 2], [0, 1, 2, 0], [0, 1, 2]]
"""Per sample, the objects the scripted model emits (indices into the reorder test's boxes): a box no GT
object overlaps (3), a duplicate of a matched object (the second 0), and a clean answer."""


@pytest.fixture(scope="module", params=["text", "image"])
def parts(request, tmp_path_factory):
    """`(model dir, policy, encoder or None, samples)` of the text or the image path."""
    folder = tmp_path_factory.mktemp(f"fp-{request.param}")
    if request.param == "text":
        model_dir = request.getfixturevalue("tiny_model_dir")
        policy = load_policy(_cfg(model_dir, 1.0, packed=False).model, model_dir)
        return model_dir, policy, None, _text_samples(3, folder)
    model_dir = request.getfixturevalue("tiny_vlm_dir")
    policy = load_policy(_cfg(model_dir, 1.0, packed=False).model, model_dir)
    encoder = PromptEncoder.for_model(policy.model.eval(), policy.tokenizer, policy.processor)
    return model_dir, policy, encoder, _image_samples(3, folder)


def _cfg(model_dir: Path, weight: float, *, packed: bool) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {
                "targets": {"unmatched_prefix": "keep"},
                "loss": {"fp_unlikelihood_weight": weight},
                "packing": {"enabled": packed},
            },
            "training": {"seed": 3},
        }
    )


def _step_loss(parts, weight: float, *, packed: bool):
    """The planned step's micro-batches, their summed step loss and `LossSums` metric sums."""
    model_dir, policy, encoder, samples = parts
    cfg = _cfg(model_dir, weight, packed=packed)
    ctx = sample_context(cfg, policy.tokenizer, encoder)
    answers = {int(s["sample_id"]): _answer(s, order) for s, order in zip(samples, ORDERS, strict=True)}
    prompts = {int(s["sample_id"]): ctx.prompt_ids(s) for s in samples}
    planner = StepPlanner.from_config(
        cfg, ScriptedPolicy(policy.tokenizer, answers, prompts), ctx, batch_size=len(samples)
    )
    raws = [list(samples)]
    planner.new_window()
    batch = planner.step_batch(raws, 10)
    overlap = RolloutOverlap(planner.source.infer, endpoints=planner.source.endpoints)
    rollouts = overlap.fetch(batch, 10, sync=lambda: 0.0)
    step = planner.build(raws, rollouts, global_step=10, metrics=StepMetrics())
    counts = StepCounts(step.n_ce, step.n_coord, step.n_fp)
    coord_ids = torch.tensor(ctx.coord_vocab.ids, dtype=torch.long)
    metrics = StepMetrics()
    total = 0.0
    model = policy.model.eval()
    with torch.no_grad():
        for prepared in step.prepared:
            micro = micro_step_loss(
                model, prepared["batch"], coord_ids=coord_ids, eos_id=ctx.eot_id,
                loss_cfg=cfg.stage2.loss, totals=counts,
            )  # fmt: skip
            total += float(micro.loss)
            metrics.add(micro.sums.metric_sums(weight))
    return step, total, metrics.finalize()


def test_false_positives_get_a_loss_and_packing_does_not_change_it(parts) -> None:
    on, loss_on, m_on = _step_loss(parts, 1.0, packed=False)
    off, loss_off, m_off = _step_loss(parts, 0.0, packed=False)
    packed, loss_packed, m_packed = _step_loss(parts, 1.0, packed=True)
    # sample 1: the box nothing overlaps; sample 2: the duplicate; 4 coordinate tokens each
    assert on.n_fp == 8 and off.n_fp == 0 and packed.n_fp == 8
    assert m_on["loss/fp_unlikelihood"] > 0 and m_on["train/fp_tokens_penalized"] == 8
    assert "loss/fp_unlikelihood" not in m_off
    # the term is added, nothing else moves (the FP tokens are read by compact logits, never labelled)
    assert (on.n_ce, on.n_coord) == (off.n_ce, off.n_coord)
    assert loss_on == pytest.approx(loss_off + m_on["loss/fp_unlikelihood"], rel=1e-4)
    assert m_packed["loss/fp_unlikelihood"] == pytest.approx(m_on["loss/fp_unlikelihood"], rel=1e-4)
    assert loss_packed == pytest.approx(loss_on, rel=1e-4)
    if parts[2] is not None:  # the image path: the rows carry the vision inputs too
        assert all(p["batch"].mm_inputs for p in packed.prepared)
