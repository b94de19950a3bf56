"""The unlikelihood loss on false positives (docs/ALGORITHM.md#fp-unlikelihood, §12.5, §13.5): which tokens it
penalizes, its value, its gradient, its normalization, its metrics and its config rule."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from learner.batching.packed_batch import pack_segments, pad_segments
from learner.config import load_run_config
from learner.metrics import StepMetrics
from learner.stage2.losses import (
    CoordLossConfig,
    LossConfig,
    fp_unlikelihood_terms,
    micro_loss,
    read_columns,
    step_loss_sums,
)
from learner.yaml_loader import ConfigError
from tests.unit.learner.segment_factory import COORD_IDS, EOT, VOCAB_SIZE, coord, make_segment
from tests.unit.learner.worked_example import GT_RAW, ROLLOUT_IDS, run_pipeline

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo_tiny_cpu.yaml"


def test_check_values() -> None:
    """ul = -ln(1 - p): p = 3/6 gives ln 2; uniform logits over 2000 ids give ln(2000/1999); a certain token
    costs -ln(1e-6) (1 - p clamped), with a finite gradient."""
    rows = torch.tensor([[math.log(3.0), 0.0, 0.0, 0.0]])
    assert fp_unlikelihood_terms(rows, torch.tensor([0])).item() == pytest.approx(math.log(2.0), rel=1e-6)
    uniform = fp_unlikelihood_terms(torch.zeros(1, 2000), torch.tensor([500])).item()
    assert uniform == pytest.approx(math.log(2000 / 1999), rel=1e-4)
    certain = torch.tensor([[60.0, 0.0, 0.0]], requires_grad=True)
    value = fp_unlikelihood_terms(certain, torch.tensor([0]))
    value.sum().backward()
    assert value.item() == pytest.approx(-math.log(1e-6), rel=1e-3)
    assert torch.isfinite(certain.grad).all()


def _fp_batch(packed: bool):
    """Two segments; the first has a TP slot (prefix 1) and two FP coord tokens (prefix 3, 4)."""
    segments = [
        make_segment(
            [7, 8, 9],
            [12, coord(5), 13, coord(40), coord(41)],
            [14, coord(600), EOT],
            prefix_targets={1: 7},
            prefix_fp=[3, 4],
        ),
        make_segment([7, 9], [coord(70), 16], [15, coord(999), EOT], prefix_fp=[0], sample_id=1),
    ]
    return pack_segments(segments) if packed else pad_segments(segments, 0)


@pytest.mark.parametrize("packed", [True, False], ids=["packed", "padded"])
def test_fp_tokens_are_placed_at_their_segment_and_read_by_compact_logits(packed: bool) -> None:
    batch = _fp_batch(packed)
    if packed:  # the second segment starts after the first's 3 + 8 + 2 = 13 tokens
        assert batch.fp_pos.tolist() == [6, 7, 13 + 2] and batch.fp_batch_idx.tolist() == [0, 0, 0]
    else:
        assert batch.fp_pos.tolist() == [6, 7, 2] and batch.fp_batch_idx.tolist() == [0, 0, 1]
    assert batch.fp_ids.tolist() == [coord(40), coord(41), coord(70)]
    assert batch.n_fp == 3
    columns = read_columns(batch.labels, batch.coord_pos, batch.fp_pos)
    assert set((batch.fp_pos - 1).tolist()) <= set(columns.tolist())


def test_packed_and_padded_rows_give_the_same_unlikelihood_sum() -> None:
    torch.manual_seed(0)
    table = torch.randn(VOCAB_SIZE, VOCAB_SIZE)  # logits as a function of the previous token only
    sums = []
    for packed in (True, False):
        batch = _fp_batch(packed)
        logits = table[batch.input_ids]
        s = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
        sums.append((s.s_fp.item(), s.n_fp))
    assert sums[0][1] == sums[1][1] == 3
    assert sums[0][0] == pytest.approx(sums[1][0], rel=1e-6) and sums[0][0] > 0


def test_a_step_lowers_the_probability_of_the_false_positive_token() -> None:
    batch = _fp_batch(packed=True)
    torch.manual_seed(1)
    logits = torch.randn(1, batch.input_ids.shape[1], VOCAB_SIZE, requires_grad=True)

    def fp_probs(z: torch.Tensor) -> torch.Tensor:
        return torch.softmax(z[0, batch.fp_pos - 1], dim=-1).gather(-1, batch.fp_ids[:, None]).squeeze(-1)

    before = fp_probs(logits.detach())
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    off = micro_loss(sums, sums.n_ce, sums.n_coord, 1, "token_weighted", 1, n_fp_total=3, fp_weight=0.0)
    loss = micro_loss(sums, sums.n_ce, sums.n_coord, 1, "token_weighted", 1, n_fp_total=3, fp_weight=0.5)
    assert loss.item() == pytest.approx(off.item() + 0.5 * sums.s_fp.item() / 3, rel=1e-6)
    grad = torch.autograd.grad(loss - off, logits)[0]  # the unlikelihood's own gradient
    on_emitted = grad[0, batch.fp_pos - 1].gather(-1, batch.fp_ids[:, None]).squeeze(-1)
    assert (on_emitted > 0).all()  # descent lowers the emitted token's logit
    after = fp_probs(logits.detach() - 1.0 * grad)
    assert (after < before).all()


def test_normalization_sums_with_counts() -> None:
    batch = _fp_batch(packed=True)
    logits = torch.zeros(1, batch.input_ids.shape[1], VOCAB_SIZE)
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    ul = math.log(VOCAB_SIZE / (VOCAB_SIZE - 1))
    assert sums.n_fp == 3 and sums.s_fp.item() == pytest.approx(3 * ul, rel=1e-4)
    base = micro_loss(sums, 20, 4, 2, "token_weighted", 1)
    # token_weighted: the step's N_fp divides, inside the world-size factor
    with_fp = micro_loss(sums, 20, 4, 2, "token_weighted", 1, n_fp_total=6, fp_weight=2.0)
    assert with_fp.item() == pytest.approx(base.item() + 2 * 2.0 * 3 * ul / 6, rel=1e-5)
    # a step without false-positive tokens adds nothing and divides by nothing
    assert micro_loss(sums, 20, 4, 2, "token_weighted", 1, n_fp_total=0, fp_weight=2.0).item() == base.item()
    mm = micro_loss(sums, 0, 0, 1, "micro_mean", 4, fp_weight=1.0)
    mm_base = micro_loss(sums, 0, 0, 1, "micro_mean", 4)
    assert mm.item() == pytest.approx(mm_base.item() + ul / 4, rel=1e-4)
    no_fp = pad_segments([make_segment([7, 8], [12], [14, EOT])], 0)
    empty = step_loss_sums(
        torch.zeros(1, no_fp.input_ids.shape[1], VOCAB_SIZE),
        no_fp,
        coord_ids=COORD_IDS,
        coord_cfg=CoordLossConfig(),
        eos_id=EOT,
    )
    assert empty.n_fp == 0 and empty.s_fp.item() == 0.0


def test_metrics_report_the_unlikelihood_and_its_count() -> None:
    batch = _fp_batch(packed=True)
    logits = torch.zeros(1, batch.input_ids.shape[1], VOCAB_SIZE)
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    metrics = StepMetrics()
    metrics.add(sums.metric_sums(fp_weight=2.0))
    out = metrics.finalize()
    ul = math.log(VOCAB_SIZE / (VOCAB_SIZE - 1))
    assert out["loss/fp_unlikelihood"] == pytest.approx(ul, rel=1e-4)
    assert out["train/fp_tokens_penalized"] == 3
    assert out["loss/total"] == pytest.approx(out["loss/ce"] + out["loss/coord"] + 2.0 * ul, rel=1e-5)
    no_fp = pad_segments([make_segment([7], [12], [EOT])], 0)
    zeros = torch.zeros(1, no_fp.input_ids.shape[1], VOCAB_SIZE)
    quiet = StepMetrics()
    quiet.add(
        step_loss_sums(
            zeros, no_fp, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT
        ).metric_sums(2.0)
    )
    assert "loss/fp_unlikelihood" not in quiet.finalize()


@pytest.mark.parametrize(("tokens", "expected"), [("coords", (48, 51, 54, 57)), ("first_coord", (48,))])
def test_worked_example_penalizes_the_unmatched_prediction_only(tokens: str, expected: tuple) -> None:
    """§21: prediction 2 (the dog box nothing overlaps) is the FP; its coordinates are tokens 48, 51, 54, 57
    (30 tokens after object_1's 18, 21, 24, 27). The invalid object_3 and the matched object_1 get nothing."""
    p = run_pipeline(ROLLOUT_IDS, GT_RAW, fp_unlikelihood_tokens=tokens)
    assert p.match.fp == (1,)
    assert p.y_train.prefix_fp_pos == expected == p.segment.meta.prefix_fp_pos
    assert p.segment.fp_pos == tuple(300 + q for q in expected)
    assert all(p.segment.labels[q] == -100 and q not in p.segment.coord_pos for q in p.segment.fp_pos)
    assert run_pipeline(ROLLOUT_IDS, GT_RAW).segment.fp_pos == ()  # off: nothing recorded


@pytest.mark.parametrize("objects", ["all", "duplicates"])
def test_a_duplicate_of_a_matched_object_is_penalized(objects: str) -> None:
    from tests.unit.learner.worked_example import rollout_of

    box = [100, 80, 300, 620]
    ids = rollout_of([("1", "person", box), ("2", "person", [102, 80, 300, 620])])
    p = run_pipeline(ids, GT_RAW[:1], fp_unlikelihood_tokens="coords", fp_unlikelihood_objects=objects)
    assert len(p.match.pairs) == 1 and len(p.match.fp) == 1
    dup = p.parse.valid_objects[p.match.fp[0]]
    assert p.y_train.prefix_fp_pos == tuple(dup.coord_token_indices)


def test_duplicates_only_spares_a_false_positive_that_repeats_nothing() -> None:
    """`fp_unlikelihood_objects: duplicates`: §21's false positive (a dog box no GT object overlaps) is not a
    second answer for a found object, so nothing is penalized; a repeat of the matched person is, and the
    wrong box beside it is not."""
    from tests.unit.learner.worked_example import rollout_of

    dups = {"fp_unlikelihood_tokens": "coords", "fp_unlikelihood_objects": "duplicates"}
    p = run_pipeline(ROLLOUT_IDS, GT_RAW, **dups)
    assert p.match.fp == (1,) and p.y_train.prefix_fp_pos == () and p.segment.fp_pos == ()

    person = [100, 80, 300, 620]
    repeat, stray = [102, 80, 300, 620], [600, 100, 700, 200]
    ids = rollout_of([("1", "person", person), ("2", "person", repeat), ("3", "person", stray)])
    every = run_pipeline(ids, GT_RAW[:1], fp_unlikelihood_tokens="coords")
    only = run_pipeline(ids, GT_RAW[:1], **dups)
    assert every.match.fp == (1, 2) == only.match.fp
    assert only.y_train.prefix_fp_pos == tuple(only.parse.valid_objects[1].coord_token_indices)
    assert set(only.y_train.prefix_fp_pos) < set(every.y_train.prefix_fp_pos)


@pytest.mark.parametrize(
    ("loss", "key"),
    [
        ({"fp_unlikelihood_weight": -1.0}, "stage2.loss.fp_unlikelihood_weight"),
        ({"fp_unlikelihood_weight": "much"}, "stage2.loss.fp_unlikelihood_weight"),
        ({"fp_unlikelihood_tokens": "desc"}, "stage2.loss.fp_unlikelihood_tokens"),
        ({"fp_unlikelihood_objects": "near_misses"}, "stage2.loss.fp_unlikelihood_objects"),
    ],
)
def test_bad_values_are_config_errors_naming_the_key(loss: dict, key: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_run_config(DEMO, {"stage2": {"loss": loss}})
    assert key in str(exc.value)


@pytest.mark.parametrize("prefix", ["drop", "reorder"])
def test_the_loss_needs_the_kept_prefix(prefix: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_run_config(
            DEMO,
            {"stage2": {"loss": {"fp_unlikelihood_weight": 1.0}, "targets": {"unmatched_prefix": prefix}}},
        )
    message = str(exc.value)
    assert "stage2.loss.fp_unlikelihood_weight" in message and "unmatched_prefix: keep" in message
    assert "\n" not in message
    # off, any prefix mode is fine; on, keep is
    load_run_config(DEMO, {"stage2": {"targets": {"unmatched_prefix": prefix}}})
    cfg = load_run_config(
        DEMO, {"stage2": {"loss": {"fp_unlikelihood_weight": 1.0}, "targets": {"unmatched_prefix": "keep"}}}
    )
    assert (
        cfg.stage2.loss.fp_unlikelihood_weight == 1.0 and cfg.stage2.loss.fp_unlikelihood_tokens == "coords"
    )
    assert LossConfig().fp_unlikelihood_weight == 0.0
