"""Post-rollout packing (docs/ALGORITHM.md#packing, tests of §20.9)."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from learner.batching.packing import (
    CarryBuffer,
    PackingBufferOverflowError,
    PackingConfig,
    best_bin,
    next_packed_batch,
    pack_segments,
    pad_segments,
    select_segments,
    staleness_bound,
)
from learner.stage2.losses import CoordLossConfig, step_loss_sums
from learner.stage2.targets.labels import SegmentTooLongError, build_labels
from tests.unit.learner.segment_factory import (
    COORD_IDS,
    EOT,
    PAD,
    VOCAB,
    VOCAB_SIZE,
    coord,
    make_segment,
    random_segment,
    sized_segment,
)

# ------------------------------------------------------------------------------------------------------------
# Selection (§14.3)


def _reference_constant_volume(items: list[tuple[int, int]], volume: int) -> list[list[int]]:
    """Direct transcription of §14.3 ``constant_volume`` (least-loaded fit, decreasing)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for i, length in sorted(items, key=lambda it: (-it[1], it[0])):
        fits = [b for b in range(len(bins)) if loads[b] + length <= volume]
        if fits:
            b = min(fits, key=lambda b: (loads[b], b))
            bins[b].append(i)
            loads[b] += length
        else:
            bins.append([i])
            loads.append(length)
    return bins


def _reference_select(lens: list[int], cap: int) -> list[int]:
    fifo = _reference_select_fifo(lens, cap)
    rem = cap - lens[0]
    if rem <= 0:
        return fifo
    items = [(i, lens[i]) for i in range(1, len(lens)) if 0 < lens[i] <= rem]
    if not items:
        return fifo
    bins = _reference_constant_volume(items, rem)
    best = min(bins, key=lambda b: (-sum(lens[i] for i in b), len(b), tuple(sorted(b))))
    cand = sorted([0, *best])
    return cand if sum(lens[i] for i in cand) > sum(lens[i] for i in fifo) else fifo


@pytest.mark.parametrize(
    ("lens", "cap", "expected"),
    [
        ([6, 3, 2, 2], 10, [0, 2, 3]),
        ([6, 3, 2, 2, 2], 10, [0, 2, 3]),
        ([4, 5, 3, 3], 10, [0, 2, 3]),
        ([5, 5, 5], 10, [0, 1]),
        ([10, 1], 10, [0]),
    ],
    ids=["s20.9-beats-fifo", "s20.9-extra-2", "s20.9-fifo-9", "s20.9-tie-keeps-fifo", "s20.9-full-oldest"],
)
def test_select_spec_cases(lens: list[int], cap: int, expected: list[int]) -> None:
    results = [select_segments(lens, cap) for _ in range(5)]
    assert all(r == expected for r in results)
    assert sum(lens[i] for i in expected) <= cap


def test_best_bin_tie_breaks() -> None:
    lens = [0, 3, 4, 4, 3]
    # bins {3,4} and {1,2}: equal sums (7) and sizes -> smallest sorted tuple (1, 2)
    assert best_bin([[3, 4], [1, 2]], lens) == [1, 2]
    # a 1-item bin beats a 2-item bin of equal sum
    assert best_bin([[1, 4], [5]], [0, 3, 0, 0, 4, 7]) == [5]
    # a larger sum wins over everything else
    assert best_bin([[5], [1, 2, 3]], [0, 3, 4, 4, 3, 7]) == [1, 2, 3]


@settings(max_examples=300, deadline=None)
@given(lens=st.lists(st.integers(min_value=0, max_value=40), min_size=1, max_size=25), cap=st.integers(1, 60))
def test_select_invariants_and_reference(lens: list[int], cap: int) -> None:
    lens[0] = min(lens[0], cap)
    got = select_segments(lens, cap)
    assert got[0] == 0 and got == sorted(set(got))
    total = sum(lens[i] for i in got)
    assert total <= cap
    fifo_total = sum(lens[i] for i in _reference_select_fifo(lens, cap))
    assert total >= fifo_total
    # binpacking.to_constant_volume reproduces the spec's least-loaded-fit rule exactly
    assert got == _reference_select(lens, cap)


def _reference_select_fifo(lens: list[int], cap: int) -> list[int]:
    fifo, total = [0], lens[0]
    for i in range(1, len(lens)):
        if total + lens[i] <= cap:
            fifo.append(i)
            total += lens[i]
    return fifo


@settings(max_examples=200, deadline=None)
@given(items=st.lists(st.integers(1, 30), min_size=1, max_size=20), volume=st.integers(30, 60))
def test_binpacking_matches_spec_constant_volume(items: list[int], volume: int) -> None:
    import binpacking

    indexed = {i + 1: length for i, length in enumerate(items)}
    got = [sorted(b) for b in binpacking.to_constant_volume(indexed, volume)]
    want = [sorted(b) for b in _reference_constant_volume(list(indexed.items()), volume)]
    assert got == want


def test_select_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="packing_length 10"):
        select_segments([11, 1], 10)
    with pytest.raises(ValueError, match="at least one"):
        select_segments([], 10)


# ------------------------------------------------------------------------------------------------------------
# Config and carry buffer (§14.1, §14.2)


def test_packing_config_defaults_and_drop_last() -> None:
    cfg = PackingConfig()
    assert (cfg.enabled, cfg.packing_length, cfg.packing_buffer, cfg.min_fill_ratio, cfg.drop_last) == (
        False,
        None,
        512,
        0.65,
        True,
    )
    with pytest.raises(ValidationError, match="drop_last"):
        PackingConfig(drop_last=False)
    with pytest.raises(ValidationError, match="packing_bufer"):
        PackingConfig(packing_bufer=3)  # type: ignore[call-arg]
    assert CarryBuffer.from_config(PackingConfig(), global_max_length=4096).packing_length == 4096
    assert CarryBuffer.from_config(PackingConfig(packing_length=100), 4096).packing_length == 100


def test_insert_too_long_raises_with_mitigations_and_leaves_buffer_unchanged() -> None:
    buf = CarryBuffer(packing_length=10, packing_buffer=8)
    buf.insert([sized_segment(4, sample_id=1)])
    with pytest.raises(SegmentTooLongError, match="Mitigations:") as err:
        buf.insert([sized_segment(5, sample_id=2), sized_segment(11, sample_id=77)])
    assert "segment of 11 tokens exceeds packing_length 10 (sample_id=77)" in str(err.value)
    assert buf.lengths == [4]


def test_buffer_overflow_raises_and_leaves_buffer_unchanged() -> None:
    buf = CarryBuffer(packing_length=100, packing_buffer=3)
    buf.insert([sized_segment(4), sized_segment(5)])
    with pytest.raises(PackingBufferOverflowError, match="packing_buffer=3"):
        buf.insert([sized_segment(6), sized_segment(7)])
    assert buf.lengths == [4, 5]
    buf.insert([sized_segment(6)])
    assert len(buf) == 3


def test_take_selects_removes_and_reports() -> None:
    buf = CarryBuffer(packing_length=10, packing_buffer=16, min_fill_ratio=0.95)
    buf.insert([sized_segment(n, sample_id=i, rollout_step=i) for i, n in enumerate([6, 3, 4])])
    segs, stats = buf.take(global_step=5)
    assert [s.meta.sample_id for s in segs] == [0, 2]
    assert buf.lengths == [3]
    assert stats is not None
    assert (stats.fill, stats.total_len, stats.n_segments, stats.buffer_after) == (1.0, 10, 2, 1)
    assert stats.staleness == (5, 3) and not stats.underfilled
    segs, stats = buf.take(global_step=6)
    assert [s.meta.sample_id for s in segs] == [1] and stats is not None and stats.underfilled
    assert buf.take(global_step=6) == ([], None)
    values = stats.metric_values()
    assert values["packing/packs"] == 1 and values["packing/segment_staleness_max"] == 5
    assert buf.avg_segment_len_ema == pytest.approx(0.9 * (0.9 * 6 + 0.1 * 3) + 0.1 * 4)


def test_next_packed_batch_and_empty_micro_step() -> None:
    buf = CarryBuffer(packing_length=10, packing_buffer=16)
    assert next_packed_batch(buf, [], global_step=0) == (None, None)
    batch, stats = next_packed_batch(buf, [sized_segment(6), sized_segment(7)], global_step=0)
    assert batch is not None and batch.input_ids.shape == (1, 6) and stats is not None
    batch, _ = next_packed_batch(buf, [], global_step=1)
    assert batch is not None and batch.input_ids.shape == (1, 7)
    assert staleness_bound(m_steps=2, packing_buffer=512, gas=4) == 2 * 128 - 1


# ------------------------------------------------------------------------------------------------------------
# Packed rows (§14.4–14.6)


def _seg_a():
    return make_segment(
        [7, 8, 9],
        [10, coord(5), 11, coord(6)],
        [12, coord(600), 13],
        prefix_targets={1: 7, 3: 9},
        sample_id=1,
    )


def _seg_b(**kw):
    return make_segment([7, 9], [], [14, coord(999), coord(0), 15, 16], tail_ignore=[3], sample_id=2, **kw)


def test_packed_equivalence_two_segments() -> None:
    a, b = _seg_a(), _seg_b()
    packed = pack_segments([a, b])
    la, lb = a.encoded_len, b.encoded_len
    assert packed.packed and packed.input_ids.shape == (1, la + lb) and packed.attention_mask is None
    assert packed.cu_seqlens is not None and packed.cu_seqlens.dtype == torch.int32
    assert packed.cu_seqlens.tolist() == [0, la, la + lb] and packed.max_seqlen == max(la, lb)
    assert packed.position_ids.tolist() == [list(range(la)) + list(range(lb))]
    per_seg = [build_labels(s.input_ids, s.meta.prompt_len, s.meta.prefix_len, s.meta.train_len,
                            s.meta.prefix_coord_pos, s.meta.prefix_coord_target_bins, s.meta.tail_ignore_pos,
                            s.meta.prefix_ce_pos, VOCAB) for s in (a, b)]  # fmt: skip
    assert packed.labels[0].tolist() == per_seg[0].labels + per_seg[1].labels
    assert packed.coord_pos.tolist() == per_seg[0].coord_pos + [la + p for p in per_seg[1].coord_pos]
    assert packed.coord_bins.tolist() == [7, 9, 600, 999, 0]
    assert packed.coord_is_prefix.tolist() == [True, True, False, False, False]
    assert packed.coord_batch_idx.tolist() == [0] * 5
    assert [m["sample_id"] for m in packed.meta] == [1, 2]
    assert packed.n_ce == a.meta.encoded_len - a.labels.count(-100) + b.meta.encoded_len - b.labels.count(
        -100
    )
    inputs = packed.model_inputs(flash_varlen_kwargs=True)
    assert "attention_mask" not in inputs and inputs["cu_seq_lens_q"] is packed.cu_seqlens
    assert inputs["max_length_k"] == packed.max_seqlen


def test_spec_positions_example() -> None:
    packed = pack_segments([sized_segment(5), sized_segment(3)])
    assert packed.cu_seqlens.tolist() == [0, 5, 8]
    assert packed.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2]]


def test_wrong_prompt_ids_in_second_segment_raises() -> None:
    with pytest.raises(ValueError, match="prompt_ids"):
        pack_segments([_seg_a(), _seg_b(meta_prompt_ids=[7, 8])])
    with pytest.raises(ValueError, match="prompt_ids"):
        pad_segments([_seg_a(), _seg_b(meta_prompt_ids=[7, 8])], PAD)
    with pytest.raises(ValueError, match="at least one"):
        pack_segments([])


def test_pad_segments_layout() -> None:
    a, b = _seg_a(), _seg_b()
    padded = pad_segments([a, b], PAD)
    width = max(a.encoded_len, b.encoded_len)
    assert not padded.packed and padded.input_ids.shape == (2, width) and padded.cu_seqlens is None
    assert a.encoded_len == width > b.encoded_len
    pad = width - b.encoded_len
    assert padded.attention_mask.tolist() == [[1] * width, [1] * b.encoded_len + [0] * pad]
    assert padded.input_ids[1, b.encoded_len :].tolist() == [PAD] * pad
    assert padded.labels[1, b.encoded_len :].tolist() == [-100] * pad
    assert padded.coord_batch_idx.tolist() == [0, 0, 0, 1, 1]
    assert padded.coord_pos.tolist() == list(a.coord_pos) + list(b.coord_pos)
    assert len(padded.meta) == 2 and padded.num_tokens == a.encoded_len + b.encoded_len
    assert "attention_mask" in padded.model_inputs()


def _unpack(batch) -> list[tuple[list[int], list[tuple[int, int, bool]]]]:
    """Per-segment (labels, coord targets) read back from a packed or padded batch."""
    out = []
    if batch.packed:
        bounds = batch.cu_seqlens.tolist()
        spans = [(0, bounds[i], bounds[i + 1]) for i in range(len(bounds) - 1)]
    else:
        spans = [(r, 0, int(batch.attention_mask[r].sum())) for r in range(batch.input_ids.shape[0])]
    for row, start, end in spans:
        slots = [
            (int(p) - start, int(t), bool(f))
            for r, p, t, f in zip(
                batch.coord_batch_idx, batch.coord_pos, batch.coord_bins, batch.coord_is_prefix, strict=True
            )
            if int(r) == row and start <= int(p) < end
        ]
        out.append((batch.labels[row, start:end].tolist(), slots))
    return out


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), n=st.integers(1, 6))
def test_pack_unpack_roundtrip_preserves_labels_and_targets(seed: int, n: int) -> None:
    rng = random.Random(seed)
    segs = [random_segment(rng, sample_id=i) for i in range(n)]
    expected = [
        (list(s.labels), list(zip(s.coord_pos, s.coord_bins, s.coord_is_prefix, strict=True))) for s in segs
    ]
    assert _unpack(pack_segments(segs)) == expected
    assert _unpack(pad_segments(segs, PAD)) == expected


def test_position_wise_loss_sums_packed_equal_padded() -> None:
    # With a position-wise model (no attention) the only thing under test is the indexing.
    rng = random.Random(3)
    segs = [random_segment(rng, sample_id=i) for i in range(4)]
    torch.manual_seed(0)
    table = torch.randn(VOCAB_SIZE, VOCAB_SIZE)
    packed, padded = pack_segments(segs), pad_segments(segs, PAD)
    cfg = CoordLossConfig()
    sp = step_loss_sums(table[packed.input_ids], packed, coord_ids=COORD_IDS, coord_cfg=cfg, eos_id=EOT)
    sd = step_loss_sums(table[padded.input_ids], padded, coord_ids=COORD_IDS, coord_cfg=cfg, eos_id=EOT)
    assert (sp.n_ce, sp.n_coord, sp.n_coord_prefix) == (sd.n_ce, sd.n_coord, sd.n_coord_prefix)
    assert sp.s_ce.item() == pytest.approx(sd.s_ce.item(), rel=1e-6)
    assert sp.s_coord.item() == pytest.approx(sd.s_coord.item(), rel=1e-6)


def test_mm_inputs_concatenated_in_segment_order() -> None:
    import dataclasses

    a = dataclasses.replace(sized_segment(4), mm_inputs={"pixel_values": torch.ones(2, 3)})
    b = sized_segment(5)
    c = dataclasses.replace(sized_segment(6), mm_inputs={"pixel_values": torch.zeros(1, 3)})
    packed = pack_segments([a, b, c])
    assert packed.mm_inputs["pixel_values"].tolist() == [[1.0] * 3, [1.0] * 3, [0.0] * 3]
    assert "pixel_values" in packed.model_inputs()
