"""`learner.stage2.step.micro_step_loss`: the one micro-step (forward over a prepared micro-batch, then the
§13 losses) that the trainer, the benches and the tests call. It is the composition it replaced — the forward
(`forward_for_loss`), `step_loss_sums` and `micro_loss` — value for value and gradient for gradient, with the
step's totals, its normalization and its logits mode from `stage2.loss`."""

from __future__ import annotations

import pytest
import torch

from learner.batching.packed_batch import pack_segments, pad_segments
from learner.kernels import packed_attention
from learner.stage2.losses import CoordLossConfig, LossConfig, micro_loss, step_loss_sums
from learner.stage2.step import forward_for_loss, micro_step_loss
from tests.unit.learner.segment_factory import COORD_IDS, EOT, PAD, coord, make_segment


def _segments():
    return [
        make_segment([7, 8, 9, 10, 11], [12, coord(5), 13], [14, coord(600), EOT], prefix_targets={1: 7}),
        make_segment([7, 9], [], [15, coord(999), coord(0), 16, EOT], tail_ignore=[3]),
    ]


def _by_hand(model, batch, loss_cfg: LossConfig, totals, world_size: int, gas: int):
    outputs, columns = forward_for_loss(
        model, batch, compact=loss_cfg.compact_logits, segment_attention=loss_cfg.segment_attention
    )
    sums = step_loss_sums(
        outputs.logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT, columns=columns
    )
    n_ce, n_coord = totals if totals is not None else (sums.n_ce, sums.n_coord)
    return micro_loss(sums, n_ce, n_coord, world_size, loss_cfg.normalization, gas), sums, columns


@pytest.mark.parametrize(
    ("layout", "loss_cfg", "totals", "world_size", "gas"),
    [
        ("packed", LossConfig(), None, 1, 1),
        ("padded", LossConfig(compact_logits=False), (40, 9), 2, 1),
        ("packed", LossConfig(normalization="micro_mean", segment_attention=False), None, 1, 4),
    ],
    ids=["defaults", "padded_full_logits_totals", "micro_mean_no_segment_attention"],
)
def test_micro_step_equals_the_steps_it_replaced(tiny_model_dir, layout, loss_cfg, totals, world_size, gas):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    batch = pad_segments(_segments(), PAD) if layout == "padded" else pack_segments(_segments())
    results, marks = [], []
    for public in (True, False):
        model.zero_grad()
        with packed_attention(model, enabled=loss_cfg.segment_attention):
            if public:
                step = micro_step_loss(
                    model,
                    batch,
                    coord_ids=COORD_IDS,
                    eos_id=EOT,
                    loss_cfg=loss_cfg,
                    totals=totals,
                    world_size=world_size,
                    gas=gas,
                    after_forward=lambda: marks.append(1),
                )
                loss, sums, columns = step.loss, step.sums, step.columns
                assert step.outputs.logits.shape[1] == (
                    len(columns) if columns is not None else batch.input_ids.shape[1]
                )
            else:
                loss, sums, columns = _by_hand(model, batch, loss_cfg, totals, world_size, gas)
            loss.backward()
        grads = [p.grad.detach().clone() for p in model.parameters()]
        results.append((loss.detach(), sums.metric_sums(), columns, grads))
    assert marks == [1]
    (loss_a, sums_a, cols_a, grads_a), (loss_b, sums_b, cols_b, grads_b) = results
    assert loss_a == loss_b and sums_a == sums_b
    assert (cols_a is None) == (cols_b is None) == (not loss_cfg.compact_logits)
    for a, b in zip(grads_a, grads_b, strict=True):
        assert torch.equal(a, b)
