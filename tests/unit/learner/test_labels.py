"""Teacher-forced checks and labels (docs/ALGORITHM.md#teacher-forced-encoding, §12; label items of §20.10;
§21.5, §21.6)."""

from __future__ import annotations

import logging

import pytest
import torch

from learner.stage2.targets.labels import (
    IGNORE_INDEX,
    MITIGATIONS,
    SegmentTooLongError,
    build_labels,
    check_prompt_alignment,
    check_segment_length,
    encode_segment,
)
from tests.unit.learner.worked_example import (
    COORDS,
    EOT,
    GT_RAW,
    NEWLINE,
    PROMPT_IDS,
    ROLLOUT_IDS,
    TOKENIZER,
    piece,
    rollout_of,
    run_pipeline,
)

PROMPT_LEN = 300
A, B, C, D, E, P = (TOKENIZER.id_of(ch) for ch in "ABCDEP")

# ---------------------------------------------------------------- §21.5 table


def _supervised(labels) -> list[int]:
    return [p for p, v in enumerate(labels) if v != IGNORE_INDEX]


def test_worked_example_labels_section_21_5() -> None:
    seg = run_pipeline(ROLLOUT_IDS, GT_RAW).segment
    m = seg.meta
    assert (m.prompt_len, m.prefix_len, m.train_len, m.encoded_len) == (300, 87, 157, 459)
    assert seg.input_ids[457] == EOT and seg.input_ids[458] == NEWLINE
    ce = _supervised(seg.labels)
    assert len(ce) == 57  # n_ce
    assert all(seg.labels[p] == seg.input_ids[p] for p in ce)
    # Prompt and rollout prefix: no CE.
    assert not [p for p in ce if p < 387]
    # Tail: CE on the 56 structure tokens; -100 at 397 (dog), 427 (rug) and on coord tokens.
    tail_coord = [406, 409, 412, 415, 433, 436, 439, 442, 445, 448, 451, 454]
    assert [p for p in ce if 387 <= p <= 456] == [
        p for p in range(387, 457) if p not in (397, 427) and p not in tail_coord
    ]
    assert piece(TOKENIZER, seg.input_ids[397]) == "dog" and piece(TOKENIZER, seg.input_ids[427]) == "rug"
    # End of turn supervised, newline after it not.
    assert seg.labels[457] == EOT and seg.labels[458] == IGNORE_INDEX
    # Coord supervision: 4 prefix slots then 12 tail slots (n_coord = 16).
    assert seg.coord_pos == (318, 321, 324, 327, *tail_coord)
    assert seg.coord_bins == (100, 80, 300, 620, 520, 400, 760, 640, 400, 650, 900, 650, 900, 950, 400, 950)
    assert seg.coord_is_prefix == (True,) * 4 + (False,) * 12
    # A coord token never carries a CE label; FP object_2 (tokens 30..59) gets nothing.
    assert all(
        seg.labels[p] == IGNORE_INDEX for p in range(len(seg.input_ids)) if COORDS.is_coord(seg.input_ids[p])
    )
    assert not set(range(330, 360)) & (set(ce) | set(seg.coord_pos))
    assert m.sample_id == 7 and m.rollout_step == 3 and m.prompt_ids == tuple(PROMPT_IDS)
    assert m.counters["fn_start_bumped"] == 1.0


def test_worked_example_prefix_structure_ce_section_21_6() -> None:
    seg = run_pipeline(ROLLOUT_IDS, GT_RAW, prefix_structure_ce=True).segment
    expected = [*range(300, 309), *range(310, 318), 319, 320, 322, 323, 325, 326, 328]
    assert len(expected) == 24
    assert seg.meta.prefix_ce_pos == tuple(p - 300 for p in expected)
    ce = _supervised(seg.labels)
    assert [p for p in ce if p < 387] == expected
    assert len(ce) == 57 + 24
    assert seg.labels[309] == IGNORE_INDEX and seg.labels[329] == IGNORE_INDEX  # 'person', '},'


def test_fn_desc_ce_supervises_tail_desc_tokens() -> None:
    base = run_pipeline(ROLLOUT_IDS, GT_RAW).segment
    seg = run_pipeline(ROLLOUT_IDS, GT_RAW, fn_desc_ce=True).segment
    assert seg.meta.tail_ignore_pos == ()
    assert seg.labels[397] == seg.input_ids[397] and seg.labels[427] == seg.input_ids[427]
    assert len(_supervised(seg.labels)) == 59
    assert (seg.coord_pos, seg.coord_bins, seg.coord_is_prefix) == (
        base.coord_pos,
        base.coord_bins,
        base.coord_is_prefix,
    )


def test_prefix_ce_separators_between_consecutive_tp_entries_only() -> None:
    gts = [
        {"desc": "person", "bbox_2d": [100, 80, 300, 620]},
        {"desc": "dog", "bbox_2d": [520, 400, 760, 640]},
        {"desc": "cat", "bbox_2d": [20, 700, 200, 900]},
    ]
    # object_1 TP, object_2 TP, object_3 FP (far from every GT); top level closed with '}}'.
    ids = rollout_of(
        [
            ("1", "person", [100, 80, 300, 620]),
            ("2", "dog", [520, 400, 760, 640]),
            ("3", "cat", [900, 20, 990, 60]),
        ]
    )
    p = run_pipeline(ids, gts, prefix_structure_ce=True)
    assert [(i, j) for i, j, _ in p.y_train.tp] == [(0, 0), (1, 1)]
    pieces = [piece(TOKENIZER, t) for t in p.parse.prefix_token_ids]
    ce = set(p.y_train.prefix_ce_pos)
    # '},' between the two TPs and the ' "' opening object_2's key are CE;
    # the ones towards FP object_3 are not.
    assert pieces[29] == "}," and 29 in ce and pieces[30] == ' "' and 30 in ce
    assert pieces[59] == "}," and 59 not in ce and pieces[60] == ' "' and 60 not in ce
    assert not ce & set(range(60, len(pieces)))
    # Desc values and coord tokens never get CE.
    assert pieces[9] == "person" and 9 not in ce and pieces[39] == "dog" and 39 not in ce
    assert not [k for k in ce if COORDS.is_coord(p.parse.prefix_token_ids[k])]


# ---------------------------------------------------------------- build_labels rules


def _toy(prompt=3, prefix=None, tail=None):
    c = COORDS.ids
    prefix = prefix if prefix is not None else [A, c[5], B, c[6]]
    tail = tail if tail is not None else [C, c[7], D, E]
    ids = [P] * prompt + prefix + tail + [EOT, NEWLINE]
    return ids, prompt, len(prefix), len(prefix) + len(tail)


def test_build_labels_regions() -> None:
    ids, pl, fl, tl = _toy()
    lab = build_labels(ids, pl, fl, tl, [1, 3], [50, 60], [2], [0, 1], COORDS)
    labels, coord_pos, coord_bins, is_prefix = lab
    assert labels[:pl] == [IGNORE_INDEX] * pl
    assert labels[pl + 0] == A  # prefix_ce token
    assert labels[pl + 1] == IGNORE_INDEX  # coord token listed in prefix_ce_pos: still no CE
    assert labels[pl + 2] == IGNORE_INDEX and labels[pl + 3] == IGNORE_INDEX
    assert labels[pl + fl : pl + tl] == [C, IGNORE_INDEX, IGNORE_INDEX, E]  # tail: coord, ignored desc
    assert labels[pl + tl] == EOT and labels[pl + tl + 1] == IGNORE_INDEX
    assert coord_pos == [pl + 1, pl + 3, pl + fl + 1]
    assert coord_bins == [50, 60, 7]  # prefix: provided targets; tail: own bin
    assert is_prefix == [True, True, False]


def test_build_labels_accepts_tensor_ids() -> None:
    ids, pl, fl, tl = _toy()
    a = build_labels(ids, pl, fl, tl, [1], [9], [], [], COORDS)
    b = build_labels(torch.tensor(ids), pl, fl, tl, [1], [9], [], [], COORDS)
    assert tuple(a) == tuple(b)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"prefix_coord_pos": [0]}, "not a coord token"),
        ({"prefix_coord_pos": [5]}, "outside the prefix"),
        ({"prefix_coord_target_bins": [1000]}, "outside 0..999"),
        ({"prefix_coord_target_bins": [1, 2]}, "target bins"),
        ({"tail_ignore_pos": [4]}, "tail_ignore_pos"),
        ({"prefix_ce_pos": [4]}, "prefix CE position"),
        ({"train_len": 10}, "inconsistent lengths"),
        ({"prompt_len": 0}, "inconsistent lengths"),
    ],
)
def test_build_labels_invariants_raise(kwargs, match) -> None:
    ids, pl, fl, tl = _toy()
    args = {
        "prompt_len": pl,
        "prefix_len": fl,
        "train_len": tl,
        "prefix_coord_pos": [1],
        "prefix_coord_target_bins": [3],
        "tail_ignore_pos": [],
        "prefix_ce_pos": [],
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        build_labels(ids, coord_vocab=COORDS, **args)


def test_every_supervised_position_inside_span() -> None:
    seg = run_pipeline(ROLLOUT_IDS, GT_RAW, prefix_structure_ce=True).segment
    lo, hi = seg.meta.prompt_len, seg.meta.prompt_len + seg.meta.train_len
    sup = _supervised(seg.labels) + list(seg.coord_pos)
    assert min(sup) >= lo and max(sup) == hi


# ---------------------------------------------------------------- §11 checks


def test_prompt_alignment() -> None:
    assert check_prompt_alignment([1, 2, 3], [1, 2, 3]) is None
    m = check_prompt_alignment([1, 2, 3, 4], [1, 2, 9, 4])
    assert (m.len_tf, m.len_rollout, m.first_diff) == (4, 4, 2)
    m = check_prompt_alignment([1, 2, 3, 4, 5], [1, 2, 3])
    assert (m.len_tf, m.len_rollout, m.first_diff) == (5, 3, 3)


def test_segment_too_long_message() -> None:
    check_segment_length(100, 100, 5)
    with pytest.raises(SegmentTooLongError) as exc:
        check_segment_length(101, 100, 5)
    msg = str(exc.value)
    assert "segment of 101 tokens exceeds packing_length 100 (sample_id=5)" in msg
    assert "Mitigations:" in msg and msg.endswith(MITIGATIONS)
    assert MITIGATIONS == (
        "Mitigations: raise global_max_length (and the engine max_model_len); lower max_new_tokens; "
        "enable repeat_terminate or lower max_object_keys; filter or split images with very many objects; "
        "lower the image pixel budget."
    )


def _encode(prompt_tf, prompt_rollout, **kw):
    y = run_pipeline(ROLLOUT_IDS, GT_RAW).y_train
    return encode_segment(
        prompt_tf, prompt_rollout, y, EOT, NEWLINE, COORDS, sample_id=11, base_idx=11, rollout_step=0, **kw
    )


def test_encode_segment_prompt_mismatch_policies(caplog: pytest.LogCaptureFixture) -> None:
    other = PROMPT_IDS[:-1] + [TOKENIZER.id_of("b")]
    with caplog.at_level(logging.WARNING, logger="learner.stage2.targets.labels"):
        seg, counters = _encode(PROMPT_IDS, other, packing_length=4096)
    assert seg is None and counters == {"prompt_mismatch_dropped": 1.0}
    assert "sample_id=11" in caplog.text and "300 tokens" in caplog.text and "position 299" in caplog.text
    with pytest.raises(ValueError, match="on_prompt_mismatch=raise"):
        _encode(PROMPT_IDS, other, packing_length=4096, on_prompt_mismatch="raise")


def test_encode_segment_oversize_policies() -> None:
    seg, counters = _encode(PROMPT_IDS, PROMPT_IDS, packing_length=459)
    assert seg is not None and seg.encoded_len == 459 and counters["oversize_dropped"] == 0.0
    with pytest.raises(SegmentTooLongError, match="Mitigations:"):
        _encode(PROMPT_IDS, PROMPT_IDS, packing_length=458)
    seg, counters = _encode(PROMPT_IDS, PROMPT_IDS, packing_length=458, oversize_policy="drop")
    assert seg is None and counters == {"oversize_dropped": 1.0}
