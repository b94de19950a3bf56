"""Losses (docs/ALGORITHM.md#losses, tests of §20.10 and the empty micro-step of §20.9)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from learner.batching.packed_batch import pad_segments
from learner.stage2.losses import (
    CoordLossConfig,
    LossConfig,
    ce_sum,
    coord_loss_terms,
    gaussian_targets,
    micro_loss,
    sanitize_logits,
    step_loss_sums,
    zero_loss,
)
from tests.unit.learner.segment_factory import COORD_IDS, EOT, PAD, VOCAB_SIZE, coord, make_segment

V_SPEC = 2000
SPEC_COORD_IDS = torch.arange(500, 1500)  # 1000 coord ids inside a vocabulary of 2000


def _rows(coord_logits: torch.Tensor, other: float) -> torch.Tensor:
    rows = torch.full((coord_logits.shape[0], V_SPEC), other)
    rows[:, SPEC_COORD_IDS] = coord_logits
    return rows


def test_spec_uniform_logits_section_20_10() -> None:
    terms = coord_loss_terms(torch.zeros(1, V_SPEC), torch.tensor([500]), SPEC_COORD_IDS, CoordLossConfig())
    assert terms.softce.item() == pytest.approx(math.log(1000), abs=1e-5)
    assert terms.softce.item() == pytest.approx(6.907755, abs=1e-5)
    assert terms.w1.item() == pytest.approx(0.248687, abs=1e-5)
    assert terms.gate.item() == pytest.approx(math.log(2), abs=1e-5)
    assert terms.total.item() == pytest.approx(7.849589, abs=1e-5)
    assert not terms.nonfinite.any()


def test_spec_one_hot_full_range_shift_costs_one() -> None:
    coord_logits = torch.full((1, 1000), -1e4)
    coord_logits[0, 999] = 0.0
    cfg = CoordLossConfig(target_truncate=0)
    terms = coord_loss_terms(_rows(coord_logits, -1e4), torch.tensor([0]), SPEC_COORD_IDS, cfg)
    assert terms.w1.item() == pytest.approx(1.0, abs=1e-5)
    assert terms.gate.item() == pytest.approx(0.0, abs=1e-5)


def test_spec_one_hot_neighbour_costs_one_over_999() -> None:
    coord_logits = torch.full((1, 1000), -1e4)
    coord_logits[0, 499] = 0.0
    cfg = CoordLossConfig(target_truncate=0)
    terms = coord_loss_terms(_rows(coord_logits, -1e4), torch.tensor([500]), SPEC_COORD_IDS, cfg)
    assert terms.w1.item() == pytest.approx(1 / 999, abs=1e-6)


def test_spec_logits_equal_log_q_give_entropy() -> None:
    q = gaussian_targets(torch.tensor([500]), 2.0, None)
    terms = coord_loss_terms(_rows(q.log(), -1e4), torch.tensor([500]), SPEC_COORD_IDS, CoordLossConfig())
    assert terms.softce.item() == pytest.approx(2.112086, abs=1e-5)
    assert terms.w1.item() < 1e-6


def test_gaussian_targets_shape_normalization_and_truncation() -> None:
    q = gaussian_targets(torch.tensor([0, 500, 999]), 2.0, None)
    assert q.shape == (3, 1000)
    assert torch.allclose(q.sum(-1), torch.ones(3))
    assert q.argmax(-1).tolist() == [0, 500, 999]
    qt = gaussian_targets(torch.tensor([500]), 2.0, 3)
    assert (qt[0, :497] == 0).all() and (qt[0, 504:] == 0).all() and (qt[0, 497:504] > 0).all()
    one_hot = gaussian_targets(torch.tensor([42]), 2.0, 0)
    assert one_hot[0, 42] == 1.0 and one_hot.sum() == 1.0


def test_sanitize_logits() -> None:
    x = torch.tensor([float("nan"), float("inf"), -float("inf"), 3e5, -3e5, 1.5], dtype=torch.bfloat16)
    out = sanitize_logits(x)
    assert out.dtype == torch.float32
    assert out.tolist() == [0.0, 1e4, -1e4, 1e4, -1e4, 1.5]


def test_nan_and_inf_logits_give_finite_loss_and_gradient() -> None:
    rows = torch.randn(3, V_SPEC)
    rows[0, 10] = float("nan")
    rows[0, 600] = float("nan")
    rows[1, 700] = float("inf")
    rows[2, :] = -float("inf")
    rows.requires_grad_(True)
    terms = coord_loss_terms(rows, torch.tensor([100, 200, 300]), SPEC_COORD_IDS, CoordLossConfig())
    assert torch.isfinite(terms.total).all()
    terms.total.sum().backward()
    assert torch.isfinite(rows.grad).all()


def test_nonfinite_loss_is_zeroed_and_counted() -> None:
    # A tiny temperature overflows z to inf even after sanitizing: ℓ becomes NaN and must be replaced.
    rows = torch.zeros(2, V_SPEC)
    rows[0, 600] = 1e4
    rows.requires_grad_(True)
    cfg = CoordLossConfig(temperature=1e-38)
    terms = coord_loss_terms(rows, torch.tensor([5, 5]), SPEC_COORD_IDS, cfg)
    assert terms.nonfinite.tolist() == [True, False]
    assert terms.total[0].item() == 0.0 and torch.isfinite(terms.total).all()
    terms.total.sum().backward()
    assert torch.isfinite(rows.grad).all()
    assert (rows.grad[0] == 0).all()


def test_gate_weight_zero_skips_gate_and_weights_combine() -> None:
    rows = torch.randn(4, V_SPEC)
    bins = torch.tensor([1, 10, 500, 998])
    full = coord_loss_terms(rows, bins, SPEC_COORD_IDS, CoordLossConfig())
    cfg = CoordLossConfig(gate_weight=0.0, soft_ce_weight=0.5, w1_weight=2.0)
    part = coord_loss_terms(rows, bins, SPEC_COORD_IDS, cfg)
    assert (part.gate == 0).all()
    assert torch.allclose(part.total, 0.5 * full.softce + 2.0 * full.w1)
    assert torch.allclose(full.total, full.softce + full.w1 + full.gate)


def test_temperature_divides_logits() -> None:
    rows = torch.randn(2, V_SPEC)
    bins = torch.tensor([3, 700])
    hot = coord_loss_terms(rows, bins, SPEC_COORD_IDS, CoordLossConfig(temperature=2.0))
    ref = coord_loss_terms(rows / 2.0, bins, SPEC_COORD_IDS, CoordLossConfig())
    assert torch.allclose(hot.total, ref.total)


def test_ce_sum_matches_shifted_cross_entropy_and_eos_split() -> None:
    torch.manual_seed(0)
    logits = torch.randn(2, 6, 11)
    labels = torch.full((2, 6), -100)
    labels[0, 2], labels[0, 4], labels[1, 1], labels[1, 5] = 3, EOT, 7, EOT
    out = ce_sum(logits, labels, eos_id=EOT)
    expected = [
        F.cross_entropy(logits[b, t - 1], labels[b, t], reduction="sum")
        for b, t in [(0, 2), (0, 4), (1, 1), (1, 5)]
    ]
    assert out.count == 4 and out.eos_count == 2
    assert out.total.item() == pytest.approx(sum(e.item() for e in expected), rel=1e-6)
    assert out.eos_total.item() == pytest.approx(expected[1].item() + expected[3].item(), rel=1e-6)


def _two_segments():
    a = make_segment([7, 8, 9], [10, coord(5), 11], [12, coord(600), 13], prefix_targets={1: 7}, sample_id=1)
    b = make_segment([7, 9], [], [14, coord(999), coord(0), 15], tail_ignore=[3], sample_id=2)
    return a, b


def test_step_loss_sums_counts_and_split() -> None:
    batch = pad_segments(_two_segments(), PAD)
    torch.manual_seed(0)
    logits = torch.randn(*batch.input_ids.shape, VOCAB_SIZE, requires_grad=True)
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    assert sums.n_ce == batch.n_ce == (2 + 1) + (1 + 1)
    assert sums.n_coord == 4 and sums.n_coord_prefix == 1 and sums.n_coord_tail == 3
    assert sums.n_ce_eos == 2
    terms = coord_loss_terms(
        logits[batch.coord_batch_idx, batch.coord_pos - 1], batch.coord_bins, COORD_IDS, CoordLossConfig()
    )
    assert sums.s_coord.item() == pytest.approx(terms.total.sum().item(), rel=1e-6)
    assert sums.s_coord_prefix.item() + sums.s_coord_tail.item() == pytest.approx(
        sums.s_coord.item(), rel=1e-6
    )
    assert sums.s_coord_prefix.item() == pytest.approx(terms.total[0].item(), rel=1e-6)
    m = sums.metric_sums()
    assert m["loss/count_ce"] == 5 and m["loss/count_coord"] == 4 and m["loss/coord_nonfinite"] == 0
    (sums.s_ce + sums.s_coord).backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()


def test_step_loss_sums_without_coord_slots_keeps_graph() -> None:
    seg = make_segment([7], [], [8, 9])
    batch = pad_segments([seg], PAD)
    logits = torch.randn(1, seg.encoded_len, VOCAB_SIZE, requires_grad=True)
    sums = step_loss_sums(logits, batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT)
    assert sums.n_coord == 0 and sums.s_coord.item() == 0.0
    micro_loss(sums, sums.n_ce, 0, 1, "token_weighted", 1).backward()
    assert logits.grad is not None


class _TinyLM(torch.nn.Module):
    """Embedding + MLP + head; the loss algebra, not attention, is under test here."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = torch.nn.Embedding(VOCAB_SIZE, 16)
        self.mix = torch.nn.Linear(16, 16)
        self.head = torch.nn.Linear(16, VOCAB_SIZE)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.emb(input_ids))))


def _grads(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.grad.detach().clone() for p in model.parameters()]


def _token_weighted_setup():
    # micro 1: 3 supervised tokens (2 CE + 1 coord); micro 2: 7 (4 CE + 3 coord).
    m1 = [make_segment([7, 8], [], [9, coord(3)])]
    m2 = [
        make_segment([7], [coord(10)], [20, 21, coord(400)], prefix_targets={0: 12}),
        make_segment([9, 9], [], [coord(999)]),
    ]
    b1, b2 = pad_segments(m1, PAD), pad_segments(m2, PAD)
    assert b1.n_ce + b1.n_coord == 3 and b2.n_ce + b2.n_coord == 7
    return b1, b2, pad_segments(m1 + m2, PAD)


def _sums(model: _TinyLM, batch):
    return step_loss_sums(
        model(batch.input_ids), batch, coord_ids=COORD_IDS, coord_cfg=CoordLossConfig(), eos_id=EOT
    )


def test_token_weighted_accumulation_equals_one_big_step() -> None:
    b1, b2, whole = _token_weighted_setup()
    n_ce, n_coord = b1.n_ce + b2.n_ce, b1.n_coord + b2.n_coord

    model = _TinyLM()
    for b in (b1, b2):
        micro_loss(
            _sums(model, b), n_ce, n_coord, world_size=1, normalization="token_weighted", gas=2
        ).backward()
    accumulated = _grads(model)

    ref = _TinyLM()
    s = _sums(ref, whole)
    assert (s.n_ce, s.n_coord) == (n_ce, n_coord)
    (s.s_ce / n_ce + s.s_coord / n_coord).backward()
    for got, want in zip(accumulated, _grads(ref), strict=True):
        assert torch.allclose(got, want, atol=1e-6, rtol=0)

    # Data-parallel form: two ranks with one micro-step each, gradients averaged (world_size factor).
    ranks = []
    for b in (b1, b2):
        rank_model = _TinyLM()
        micro_loss(
            _sums(rank_model, b), n_ce, n_coord, world_size=2, normalization="token_weighted", gas=1
        ).backward()
        ranks.append(_grads(rank_model))
    for g0, g1, want in zip(*ranks, _grads(ref), strict=True):
        assert torch.allclose((g0 + g1) / 2, want, atol=1e-6, rtol=0)

    # micro_mean weighs the two micro-steps equally, so with 3 vs 7 tokens it differs.
    mm = _TinyLM()
    for b in (b1, b2):
        micro_loss(_sums(mm, b), n_ce, n_coord, world_size=1, normalization="micro_mean", gas=2).backward()
    assert any(not torch.allclose(a, b, atol=1e-6) for a, b in zip(_grads(mm), _grads(ref), strict=True))


def test_micro_loss_formulas() -> None:
    b1, _, _ = _token_weighted_setup()
    s = _sums(_TinyLM(), b1)
    tw = micro_loss(s, 10, 4, world_size=4, normalization="token_weighted", gas=3)
    assert tw.item() == pytest.approx(4 * (s.s_ce.item() / 10 + s.s_coord.item() / 4), rel=1e-6)
    mm = micro_loss(s, 10, 4, world_size=4, normalization="micro_mean", gas=3)
    assert mm.item() == pytest.approx((s.s_ce.item() / s.n_ce + s.s_coord.item() / s.n_coord) / 3, rel=1e-6)
    zero_counts = micro_loss(s, 0, 0, world_size=1, normalization="token_weighted", gas=1)
    assert zero_counts.item() == pytest.approx(s.s_ce.item() + s.s_coord.item(), rel=1e-6)
    with pytest.raises(ValueError, match="normalization"):
        micro_loss(s, 1, 1, world_size=1, normalization="sequence_mean", gas=1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="world_size"):
        micro_loss(s, 1, 1, world_size=0, normalization="token_weighted", gas=1)


def test_zero_loss_backward_leaves_all_gradients_zero() -> None:
    model = _TinyLM()
    model.mix.bias.requires_grad_(False)
    loss = zero_loss(model)
    assert loss.item() == 0.0
    loss.backward()
    for name, p in model.named_parameters():
        if p.requires_grad:
            assert p.grad is not None and (p.grad == 0).all(), name
        else:
            assert p.grad is None
    frozen = torch.nn.Linear(2, 2).requires_grad_(False)
    with pytest.raises(ValueError, match="requires_grad"):
        zero_loss(frozen)


def test_configs_validate() -> None:
    cfg = CoordLossConfig()
    assert (cfg.target_sigma, cfg.target_truncate, cfg.temperature) == (2.0, None, 1.0)
    assert (cfg.soft_ce_weight, cfg.w1_weight, cfg.gate_weight) == (1.0, 1.0, 1.0)
    for bad in (
        {"target_sigma": 0},
        {"temperature": -1},
        {"w1_weight": -0.1},
        {"target_truncate": -1},
        {"sigma": 1},
    ):
        with pytest.raises(ValidationError):
            CoordLossConfig(**bad)
    with pytest.raises(ValidationError):
        cfg.target_sigma = 3.0  # type: ignore[misc]
    loss = LossConfig()
    assert (loss.normalization, loss.fn_desc_ce, loss.prefix_structure_ce) == ("token_weighted", False, False)
    with pytest.raises(ValidationError, match="normalization"):
        LossConfig(normalization="mean")  # type: ignore[arg-type]
    with pytest.raises(ValidationError):
        LossConfig(fn_desc_ce=True, extra_knob=1)  # type: ignore[call-arg]
