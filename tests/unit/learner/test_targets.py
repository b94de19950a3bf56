"""Prefix coord targets and Y_train (docs/ALGORITHM.md#prefix-targets, §10, §12.2; required tests §20.8,
§20.12, §21.2–21.4)."""

from __future__ import annotations

import numpy as np
import pydantic
import pytest

import learner.stage2.targets.prefix_coords as prefix_coords_mod
from learner.stage2.format import serialize_entry
from learner.stage2.gt import GTObject, extract_gt
from learner.stage2.targets.ot import barycentric_batch, barycentric_padded, barycentric_projection
from learner.stage2.targets.prefix_coords import prefix_coord_targets, prefix_coord_targets_batch
from learner.stage2.targets.y_train import (
    TargetsConfig,
    YTrain,
    find_desc_value_spans,
    matching_rates,
    serialize_append,
)
from tests.unit.learner.worked_example import (
    COORDS,
    GT_RAW,
    MULTI,
    ROLLOUT_IDS,
    TAIL_TEXT,
    TOKENIZER,
    make_tokenizer,
    piece,
    rollout_of,
    run_pipeline,
)

SQUARE = ("poly", (100, 100, 200, 100, 200, 200, 100, 200))
TRIANGLE = ("poly", (100, 100, 200, 100, 150, 200))


# ---------------------------------------------------------------- §20.8 OT targets


def test_ot_identical_squares_eps1_iters50() -> None:
    t = prefix_coord_targets(SQUARE, SQUARE, TargetsConfig(ot_epsilon=1.0, ot_iters=50))
    assert t is not None and len(t) == 8
    assert np.max(np.abs(np.array(t) - np.array(SQUARE[1]))) <= 2


def test_ot_square_poly_vs_shifted_gt_bbox() -> None:
    t = prefix_coord_targets(SQUARE, ("bbox_2d", (110, 110, 210, 210)), TargetsConfig())
    assert t == [110, 110, 210, 110, 210, 210, 110, 210]


def test_ot_pred_bbox_vs_gt_triangle() -> None:
    assert prefix_coord_targets(("bbox_2d", (100, 100, 200, 200)), TRIANGLE, TargetsConfig()) == [
        100,
        100,
        200,
        167,
    ]


def test_ot_pred_triangle_vs_gt_bbox() -> None:
    t = prefix_coord_targets(TRIANGLE, ("bbox_2d", (100, 100, 200, 200)), TargetsConfig())
    assert t == [100, 125, 200, 125, 150, 200]


def test_bbox_bbox_targets_are_gt_bins_in_order_clamped() -> None:
    cfg = TargetsConfig()
    assert prefix_coord_targets(("bbox_2d", (1, 2, 3, 4)), ("bbox_2d", (100, 80, 300, 620)), cfg) == [
        100,
        80,
        300,
        620,
    ]
    # GT order is kept even when unsorted; out-of-range values are clamped.
    assert prefix_coord_targets(("bbox_2d", (1, 2, 3, 4)), ("bbox_2d", (300, 80, 100, 1200)), cfg) == [
        300,
        80,
        100,
        999,
    ]


def test_ot_rounding_is_half_even() -> None:
    # eps so large that K == 1 exactly: uniform plan, every prediction point maps to the GT mean.
    cfg = TargetsConfig(ot_epsilon=1e300, ot_iters=3)
    # 4 points each side: all masses are powers of two, so the means are exactly x.5.
    pred = ("poly", (100, 0) * 4)
    assert (
        prefix_coord_targets(pred, ("poly", (100, 0, 101, 0, 100, 0, 101, 0)), cfg) == [100, 0] * 4
    )  # 100.5
    assert (
        prefix_coord_targets(pred, ("poly", (101, 3, 102, 4, 101, 3, 102, 4)), cfg) == [102, 4] * 4
    )  # 101.5, 3.5


def test_ot_l1_cost_matches_reference() -> None:
    rng = np.random.default_rng(1)
    p, g = rng.uniform(0, 300, size=(5, 2)), rng.uniform(0, 300, size=(4, 2))
    got = barycentric_projection(p, g, cost="l1", epsilon=20.0, iters=30)
    ref = _reference_sinkhorn(p, g, eps=20.0, iters=30, cost="l1")
    np.testing.assert_allclose(got, ref, rtol=1e-9, atol=1e-9)
    assert not np.allclose(got, _reference_sinkhorn(p, g, eps=20.0, iters=30))  # l1 really differs from l2


def test_batched_sinkhorn_equals_single_pairs() -> None:
    rng = np.random.default_rng(0)
    preds = [rng.uniform(0, 999, size=(int(n), 2)) for n in rng.integers(3, 9, size=12)]
    gts = [rng.uniform(0, 999, size=(int(m), 2)) for m in rng.integers(3, 9, size=12)]
    batch = barycentric_batch(preds, gts, cost="l2", epsilon=10.0, iters=30)
    for p, g, b in zip(preds, gts, batch, strict=True):
        single = _reference_sinkhorn(p, g, eps=10.0, iters=30)
        assert b is not None
        np.testing.assert_allclose(b, single, rtol=1e-9, atol=1e-9)


def _reference_sinkhorn(p: np.ndarray, g: np.ndarray, eps: float, iters: int, cost: str = "l2") -> np.ndarray:
    """The §9 formulas written out literally."""
    d = p[:, None, :] - g[None, :, :]
    c = np.sqrt((d**2).sum(-1)) if cost == "l2" else np.abs(d).sum(-1)
    k = np.exp(np.clip(-c / eps, -50, 50))
    a, b = np.full(len(p), 1 / len(p)), np.full(len(g), 1 / len(g))
    u, v = np.ones(len(p)), np.ones(len(g))
    for _ in range(iters):
        u = a / np.maximum(k @ v, 1e-300)
        v = b / np.maximum(k.T @ u, 1e-300)
    t = u[:, None] * k * v[None, :]
    return (t @ g) / t.sum(1)[:, None]


def test_target_failure_returns_none() -> None:
    cfg = TargetsConfig()
    bad = [
        (("poly", (1, 2, 3)), ("poly", (1, 2, 3, 4, 5, 6))),  # odd poly
        (("bbox_2d", (1, 2, 3)), ("bbox_2d", (1, 2, 3, 4))),  # wrong arity
        (("poly", ()), ("bbox_2d", (1, 2, 3, 4))),  # no points
    ]
    assert prefix_coord_targets_batch(bad, cfg) == [None, None, None]
    good = prefix_coord_targets_batch([bad[0], (SQUARE, SQUARE)], cfg)
    assert good[0] is None and good[1] == list(SQUARE[1])


def test_targets_config_forbids_unknown_keys() -> None:
    with pytest.raises(pydantic.ValidationError):
        TargetsConfig(ot_eps=3.0)
    with pytest.raises(pydantic.ValidationError):
        TargetsConfig(ot_cost="l3")
    with pytest.raises(pydantic.ValidationError):
        TargetsConfig(ot_epsilon=0.0)


# ---------------------------------------------------------------- §10 separators and numbering


def _gt(i: int, desc: str, geom: str, bins: tuple[int, ...]) -> GTObject:
    return GTObject(index=i, desc=desc, geom_type=geom, bins=bins)


CAT = _gt(1, "cat", "bbox_2d", (156, 415, 467, 832))


def test_separator_after_closed_object() -> None:
    out = serialize_append([CAT], 4, '{"object_3": {"desc": "x", "bbox_2d": []}')
    assert out == (
        ', "object_4": {"desc": "cat", "bbox_2d": ["<|coord_156|>", "<|coord_415|>", "<|coord_467|>", '
        '"<|coord_832|>"]}}'
    )


def test_no_separator_after_open_brace_and_comma() -> None:
    assert serialize_append([CAT], 1, "{").startswith('"object_1": {"desc": "cat"')
    assert serialize_append([CAT], 2, '{"object_1": {}, ').startswith('"object_2"')
    assert serialize_append([CAT], 1, "junk {  ").endswith("}}")


def test_empty_fn() -> None:
    assert serialize_append([], 2, '{"object_1": {"desc": "x"}') == "}"
    assert "{" + serialize_append([], 1, "{") == "{}"
    with pytest.raises(ValueError, match="','"):
        serialize_append([], 3, '{"object_1": {}, ')


def test_bad_prefix_end_raises() -> None:
    with pytest.raises(ValueError, match="invariant 6.9"):
        serialize_append([CAT], 1, '{"object_1": {"desc": "ca')
    with pytest.raises(ValueError, match="invariant 6.9"):
        serialize_append([CAT], 1, "")


def test_poly_entries_are_pairs_and_numbering_increments() -> None:
    rug = _gt(3, "rug", "poly", (400, 650, 900, 650, 900, 950))
    out = serialize_append([CAT, rug], 7, "{")
    assert '"object_7": {"desc": "cat"' in out and '"object_8": {"desc": "rug"' in out
    assert '"poly": [["<|coord_400|>", "<|coord_650|>"], ["<|coord_900|>", "<|coord_650|>"]' in out


# ---------------------------------------------------------------- §12.2 desc spans


def test_desc_value_spans() -> None:
    text = '{"desc": "cat", "desc" :  "a \\"b\\" c", "x": "desc", "desc":"" , "desc": "open'
    spans = find_desc_value_spans(text)
    assert [text[s:e] for s, e in spans] == ["cat", 'a \\"b\\" c', "", "open"]


def test_desc_key_inside_a_value_is_not_a_key() -> None:
    text = '{"desc": "\\"desc\\": \\"x", "bbox_2d": []}'
    spans = find_desc_value_spans(text)
    assert len(spans) == 1 and text[spans[0][0] : spans[0][1]] == '\\"desc\\": \\"x'


# ---------------------------------------------------------------- §21.2–21.4 worked example, §20.12


def test_worked_example_parse_and_match_section_21() -> None:
    p = run_pipeline(ROLLOUT_IDS, GT_RAW)
    assert len(ROLLOUT_IDS) == 97
    assert [o.coord_token_indices for o in p.parse.valid_objects] == [(18, 21, 24, 27), (48, 51, 54, 57)]
    assert len(p.parse.prefix_token_ids) == 87 and p.parse.prefix_text.endswith('"]}')
    assert p.parse.max_object_index_in_prefix == 3
    assert [(i, j) for i, j, _ in p.y_train.tp] == [(0, 0)]
    assert p.y_train.fp == (1,) and p.y_train.fn == (1, 2)
    assert p.y_train.prefix_coord_pos == (18, 21, 24, 27)
    assert p.y_train.prefix_coord_target_bins == (100, 80, 300, 620)


def test_worked_example_y_train_section_21_4() -> None:
    y = run_pipeline(ROLLOUT_IDS, GT_RAW).y_train
    assert y.append_text == TAIL_TEXT  # object_4, object_5: never a duplicate object_3
    assert '"object_3"' not in y.append_text
    assert len(y.append_ids) == 70 and y.prefix_len == 87 and y.train_len == 157
    assert y.ids[:87] == tuple(run_pipeline(ROLLOUT_IDS, GT_RAW).parse.prefix_token_ids)
    assert TOKENIZER.decode(y.ids) == TOKENIZER.decode(ROLLOUT_IDS[:86]) + "}" + TAIL_TEXT
    coord_tail = [k for k, t in enumerate(y.append_ids) if COORDS.is_coord(t)]
    assert len(coord_tail) == 12
    assert y.tail_ignore_pos == (10, 40)
    assert [piece(TOKENIZER, y.append_ids[k]) for k in y.tail_ignore_pos] == ["dog", "rug"]
    assert 70 - 12 - 2 == 56
    assert y.counters["fn_start_bumped"] == 1.0


def test_worked_example_metrics_section_20_12() -> None:
    p = run_pipeline(ROLLOUT_IDS, GT_RAW)
    c = p.y_train.counters
    assert c["gating_rejections"] == 5 and c["candidate_pairs"] == 6
    rates = matching_rates(c)
    assert rates["gating_rejection_rate"] == pytest.approx(0.8333, abs=1e-4)
    assert rates["precision"] == pytest.approx(0.5)
    assert rates["recall"] == pytest.approx(0.3333, abs=1e-4)
    assert rates["f1"] == pytest.approx(0.4)
    assert extract_gt(GT_RAW, sample_id=0).n_malformed == 0
    assert p.parse.dropped_invalid == 2


def test_appended_coord_ids_equal_serialized_coordinates() -> None:
    y = run_pipeline(ROLLOUT_IDS, GT_RAW).y_train
    got = [COORDS.bin_of(t) for t in y.append_ids if COORDS.is_coord(t)]
    assert got == [520, 400, 760, 640, 400, 650, 900, 650, 900, 950, 400, 950]


class _CoordSplittingTokenizer(type(TOKENIZER)):
    """Misconfigured: <|coord_760|> is not an added token, so it is spelled out character by character."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        parts = text.split("<|coord_760|>")
        out = super().encode(parts[0])
        for part in parts[1:]:
            out += [self.id_of(ch) for ch in "<|coord_760|>"] + super().encode(part)
        return out


def test_misconfigured_tokenizer_raises() -> None:
    with pytest.raises(ValueError, match="tokenizer"):
        run_pipeline(ROLLOUT_IDS, GT_RAW, tokenizer=_CoordSplittingTokenizer(MULTI))


def test_prefix_open_brace_and_no_gt_gives_empty_object() -> None:
    # No '{' at all: §6.4 fallback prefix encode("{"); no GT → Y_train text "{}".
    p = run_pipeline(TOKENIZER.encode("sorry, nothing"), [])
    assert p.parse.fallback
    assert TOKENIZER.decode(p.y_train.ids) == "{}"
    assert p.y_train.append_text == "}"


def test_fn_start_not_bumped_when_keys_are_all_valid() -> None:
    ids = rollout_of([("1", "person", [104, 84, 296, 610])], close_top=True)
    p = run_pipeline(ids, GT_RAW)
    assert p.parse.max_object_index_in_prefix == 1
    assert p.y_train.counters["fn_start_bumped"] == 0.0
    assert p.y_train.append_text.startswith(', "object_2": {"desc": "dog"')


def test_excluded_pair_becomes_fn(monkeypatch: pytest.MonkeyPatch) -> None:
    # A poly GT forces OT; make OT fail: the pair is excluded and its GT appended.
    gt = [{"desc": "rug", "poly": [100, 80, 300, 80, 300, 620, 100, 620]}]
    ids = rollout_of([("1", "rug", [100, 80, 300, 620])])
    ok = run_pipeline(ids, gt)
    assert len(ok.y_train.tp) == 1 and ok.y_train.prefix_coord_target_bins == (100, 80, 300, 620)

    def failing(p, g, **kw):
        proj, ok, ns = barycentric_padded(p, g, **kw)
        return proj * np.nan, ok & False, ns

    monkeypatch.setattr(prefix_coords_mod, "barycentric_padded", failing)
    bad = run_pipeline(ids, gt)
    assert bad.y_train.tp == () and len(bad.y_train.excluded) == 1
    assert bad.y_train.fn == (0,) and bad.y_train.fp == (0,)
    assert bad.y_train.prefix_coord_pos == ()
    assert bad.y_train.counters["excluded_from_supervision"] == 1.0
    assert bad.y_train.counters["matched"] == 1.0 and bad.y_train.counters["matched_for_supervision"] == 0.0
    assert '"object_2": {"desc": "rug", "poly"' in bad.y_train.append_text


def test_fused_desc_closing_quote_token_is_masked_whole() -> None:
    tok = make_tokenizer(extra=['og",'])
    gt = [{"desc": "hog", "bbox_2d": [1, 2, 3, 4]}]
    ids = tok.ids_of(["{"])
    p = run_pipeline(ids, gt, tokenizer=tok)
    pieces = [piece(tok, t) for t in p.y_train.append_ids]
    masked = [pieces[k] for k in p.y_train.tail_ignore_pos]
    assert masked == ["h", 'og",']
    assert run_pipeline(ids, gt, tokenizer=tok, fn_desc_ce=True).y_train.tail_ignore_pos == ()


# ------------------------------------------------------------- §10 token seam (stage2.targets.canonical_seam)


def _seam_case(
    tokenizer: object, rollout_text: str, gt_raw: list[dict], canonical: bool
) -> tuple[list[int], YTrain]:
    from learner.stage2.coords import CoordVocab
    from learner.stage2.matching.match import MatchingConfig, gt_geoms, match, pred_geoms
    from learner.stage2.parse.parser import parse_rollout
    from learner.stage2.targets.y_train import build_y_train

    coords = CoordVocab.from_tokenizer(tokenizer)
    ids = tokenizer.encode(rollout_text, add_special_tokens=False) + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]
    parsed = parse_rollout(ids, tokenizer, coords)
    gts = extract_gt(gt_raw, sample_id=0).objects
    matched = match(
        pred_geoms(parsed.valid_objects, parsed.response_token_ids, coords), gt_geoms(gts), MatchingConfig()
    )
    y = build_y_train(parsed, gts, matched, tokenizer, coords, TargetsConfig(canonical_seam=canonical))
    return ids, y


ONE_CAT = "{" + serialize_entry(1, "cat", "bbox_2d", [10, 20, 30, 40]) + "}"
CAT_GT = {"desc": "cat", "bbox_2d": [10, 20, 30, 40]}


def test_canonical_seam_gives_back_the_rollout_when_nothing_is_appended(tiny_tokenizer: object) -> None:
    """The real Qwen tokenizer merges the closing brackets (`"]}}`, `]}}`) into fewer tokens than the cut
    after the object re-encodes (`"]}`) plus the spec's separately encoded `}`; the canonical seam encodes
    them together."""
    ids, spec = _seam_case(tiny_tokenizer, ONE_CAT, [CAT_GT], canonical=False)
    _, canon = _seam_case(tiny_tokenizer, ONE_CAT, [CAT_GT], canonical=True)
    decode = tiny_tokenizer.decode  # type: ignore[attr-defined]
    assert decode(list(spec.ids)) == decode(list(canon.ids)) == ONE_CAT
    assert list(canon.ids) == ids[:-1]  # the rollout's own tokens, `]}}` included
    assert len(spec.ids) > len(canon.ids) and spec.append_ids == tuple(tiny_tokenizer.encode("}"))  # type: ignore[attr-defined]
    assert canon.prefix_coord_pos == spec.prefix_coord_pos and canon.prefix_len < spec.prefix_len


def test_canonical_seam_keeps_the_coordinates_and_encodes_the_fn_tail_with_the_seam(
    tiny_tokenizer: object,
) -> None:
    dog = {"desc": "dog", "bbox_2d": [50, 60, 70, 80]}
    _, spec = _seam_case(tiny_tokenizer, ONE_CAT, [CAT_GT, dog], canonical=False)
    ids, canon = _seam_case(tiny_tokenizer, ONE_CAT, [CAT_GT, dog], canonical=True)
    decode = tiny_tokenizer.decode  # type: ignore[attr-defined]
    assert decode(list(spec.ids)) == decode(list(canon.ids))
    assert list(canon.ids[: canon.prefix_len]) == ids[: canon.prefix_len]  # untouched rollout tokens
    assert canon.prefix_coord_target_bins == spec.prefix_coord_target_bins == (10, 20, 30, 40)
    assert canon.counters["fn_appended"] == 1.0
