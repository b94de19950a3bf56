"""Compact logits (`stage2.loss.compact_logits`): asking the model only for the columns the losses read gives
the same sums and the same parameter gradients as a full forward, on padded and packed batches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from learner.batching.packed_batch import pack_segments, pad_segments
from learner.stage2.losses import CoordLossConfig, micro_loss, read_columns, step_loss_sums
from tests.unit.learner.segment_factory import COORD_IDS, EOT, PAD, VOCAB_SIZE, coord, make_segment

CFG = CoordLossConfig()
DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo_tiny_cpu.yaml"


def _segments():
    return [
        make_segment([7, 8, 9, 10, 11], [12, coord(5), 13], [14, coord(600), EOT], prefix_targets={1: 7}),
        make_segment([7, 9], [], [15, coord(999), coord(0), 16, EOT], tail_ignore=[3]),
        make_segment([7, 8, 9, 10, 11, 12, 13, 14, 15], [16], [17, coord(42), EOT]),
    ]


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_read_columns_are_every_position_a_loss_reads(layout: str) -> None:
    batch = pad_segments(_segments(), PAD) if layout == "padded" else pack_segments(_segments())
    columns = read_columns(batch.labels, batch.coord_pos)
    rows, cols = (batch.labels[:, 1:] != -100).nonzero(as_tuple=True)
    want = set(cols.tolist()) | set((batch.coord_pos - 1).tolist())
    assert columns.tolist() == sorted(want)
    # The prompt is never read: fewer columns than positions.
    assert len(columns) < batch.labels.shape[1] - 1


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_sums_and_logit_gradients_equal_a_full_forward(layout: str) -> None:
    batch = pad_segments(_segments(), PAD) if layout == "padded" else pack_segments(_segments())
    columns = read_columns(batch.labels, batch.coord_pos)
    torch.manual_seed(0)
    full = torch.randn(*batch.input_ids.shape, VOCAB_SIZE, requires_grad=True)
    compact = full.detach()[:, columns].clone().requires_grad_(True)
    a = step_loss_sums(full, batch, coord_ids=COORD_IDS, coord_cfg=CFG, eos_id=EOT)
    b = step_loss_sums(compact, batch, coord_ids=COORD_IDS, coord_cfg=CFG, eos_id=EOT, columns=columns)
    assert a.metric_sums() == pytest.approx(b.metric_sums(), rel=1e-6)
    (a.s_ce + a.s_coord).backward()
    (b.s_ce + b.s_coord).backward()
    torch.testing.assert_close(full.grad[:, columns], compact.grad)
    unread = torch.ones(full.shape[1], dtype=torch.bool)
    unread[columns] = False
    assert full.grad[:, unread].abs().sum() == 0


@pytest.mark.parametrize("layout", ["padded", "packed"])
def test_hf_model_loss_and_parameter_gradients_equal_a_full_forward(tiny_model_dir, layout: str) -> None:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa"
    )
    batch = pad_segments(_segments(), PAD) if layout == "padded" else pack_segments(_segments())
    columns = read_columns(batch.labels, batch.coord_pos)
    results = []
    for keep in (None, columns):
        model.zero_grad()
        extra = {} if keep is None else {"logits_to_keep": keep}
        logits = model(**batch.model_inputs(), **extra).logits
        assert logits.shape[1] == (batch.labels.shape[1] if keep is None else len(columns))
        sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CFG, eos_id=EOT, columns=keep)
        loss = micro_loss(sums, sums.n_ce, sums.n_coord, 1, "token_weighted", 1)
        loss.backward()
        results.append((loss.detach(), [p.grad.detach().clone() for p in model.parameters()]))
    (loss_full, grads_full), (loss_compact, grads_compact) = results
    torch.testing.assert_close(loss_compact, loss_full, rtol=1e-5, atol=1e-6)
    for g_full, g_compact in zip(grads_full, grads_compact, strict=True):
        torch.testing.assert_close(g_compact, g_full, rtol=1e-4, atol=1e-6)


def test_a_forward_without_logits_to_keep_is_a_config_error(tiny_model_dir) -> None:
    from learner.config import load_run_config
    from learner.trainers.build import check_compact_logits
    from learner.yaml_loader import ConfigError

    class NoKeep(torch.nn.Module):
        def forward(self, input_ids, attention_mask=None):  # pragma: no cover - never called
            return input_ids

    cfg = load_run_config(DEMO)
    with pytest.raises(ConfigError, match=r"stage2\.loss\.compact_logits: NoKeep\.forward"):
        check_compact_logits(cfg, NoKeep())
    off = load_run_config(DEMO, {"stage2": {"loss": {"compact_logits": False}}})
    check_compact_logits(off, NoKeep())
