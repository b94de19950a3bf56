"""Detection rewards (learner/rewards/detection.py, issue 23 item 4) on the REAL tiny tokenizer: completions
are token ids as an engine samples them (answer + ``<|im_end|>``), parsed by the stage-2 parser and matched
against the row's GT objects with the stage-2 matcher."""

from __future__ import annotations

from typing import Any

import pytest

from learner.rewards.detection import DETECTION_TASK, DetectionScorer
from learner.rewards.registry import DETECTION_REWARDS, PRESETS, REWARD_NAMES, get_reward, total_reward
from learner.stage2.format import serialize_entry
from learner.stage2.matching.match import MatchingConfig, mask_iou

GT = [
    {"desc": "cat", "bbox_2d": [100, 100, 300, 300]},
    {"desc": "dog", "bbox_2d": [500, 100, 700, 300]},
    {"desc": "tree", "poly": [200, 500, 300, 700, 100, 700]},
    {"desc": "car", "bbox_2d": [600, 600, 900, 900]},
]
ROW = {"task_mode": DETECTION_TASK, "objects": GT, "sample_id": 7}
NAMES = ("detection.f1", "detection.maskiou", "detection.format", "detection.precision", "detection.recall")


def answer(objects: list[dict[str, Any]]) -> str:
    """The serializer's answer text (what stage-1 SFT teaches) for raw objects."""
    entries = []
    for n, obj in enumerate(objects, start=1):
        geom = "bbox_2d" if "bbox_2d" in obj else "poly"
        entries.append(serialize_entry(n, obj["desc"], geom, obj[geom]))
    return "{" + ", ".join(entries) + "}"


@pytest.fixture(scope="module")
def scorer(tiny_tokenizer) -> DetectionScorer:
    return DetectionScorer.from_tokenizer(tiny_tokenizer)


def score(
    scorer: DetectionScorer, text: str, row: dict[str, Any] = ROW, *, eot: bool = True
) -> dict[str, float]:
    """Every detection reward of one completion, scored from its token ids (``text`` + ``<|im_end|>``)."""
    ids = scorer.tokenizer.encode(text + ("<|im_end|>" if eot else ""), add_special_tokens=False)
    decoded = scorer.tokenizer.decode(ids, skip_special_tokens=True)
    _, per = total_reward([decoded], [row], dict.fromkeys(NAMES, 1.0), token_ids=[ids], detection=scorer)
    return {name.removeprefix("detection."): values[0] for name, values in per.items()}


def test_perfect_answer_scores_one(scorer: DetectionScorer) -> None:
    assert score(scorer, answer(GT)) == {
        "f1": 1.0,
        "maskiou": 1.0,
        "format": 1.0,
        "precision": 1.0,
        "recall": 1.0,
    }


def test_order_does_not_matter(scorer: DetectionScorer) -> None:
    assert score(scorer, answer(GT[::-1]))["f1"] == 1.0


@pytest.mark.parametrize(
    ("text", "well_formed"),
    [("{}", 1.0), ("", 0.0), ("I see a cat", 0.0), ('{"object_1": {"desc": "cat", "bbox_2d": [', 0.0)],
    ids=["empty-answer", "no-text", "garbled", "cut-in-first-object"],
)
def test_empty_or_garbled_answer_scores_zero(scorer: DetectionScorer, text: str, well_formed: float) -> None:
    got = score(scorer, text)
    assert (got["f1"], got["maskiou"], got["precision"], got["recall"]) == (0.0, 0.0, 0.0, 0.0)
    assert got["format"] == well_formed


def test_half_right_answers_give_their_f1(scorer: DetectionScorer) -> None:
    # two of the four GT objects, nothing else: 2·2 / (2 + 4)
    got = score(scorer, answer(GT[:2]))
    assert got["f1"] == pytest.approx(2 / 3) and got["precision"] == 1.0 and got["recall"] == 0.5
    # all four plus four far-away false positives: 2·4 / (8 + 4)
    far = [{"desc": "x", "bbox_2d": [10 + 2 * i, 950, 12 + 2 * i, 960]} for i in range(4)]
    got = score(scorer, answer(GT + far))
    assert got["f1"] == pytest.approx(8 / 12) and got["precision"] == 0.5 and got["recall"] == 1.0
    assert got["format"] == 1.0 and got["maskiou"] == 1.0


def test_matching_gate_and_mean_maskiou(scorer: DetectionScorer) -> None:
    shifted = {"desc": "cat", "bbox_2d": [150, 100, 350, 300]}  # IoU 150/250 = 0.6 > gate 0.3
    beside = {"desc": "dog", "bbox_2d": [640, 100, 840, 300]}  # IoU 60/340 < gate
    iou = mask_iou(("bbox_2d", (150, 100, 350, 300)), ("bbox_2d", (100, 100, 300, 300)))
    got = score(scorer, answer([shifted, beside]))
    assert iou == pytest.approx(0.6)
    assert got["f1"] == pytest.approx(2 * 1 / (2 + 4)) and got["maskiou"] == pytest.approx(iou)
    strict = DetectionScorer.from_tokenizer(scorer.tokenizer, matching=MatchingConfig(maskiou_gate=0.7))
    assert score(strict, answer([shifted, beside]))["f1"] == 0.0


@pytest.mark.parametrize(
    "text",
    [
        answer(GT)[:-1],  # truncated: the top level never closes
        answer(GT) + " and more",  # text after the top-level close
        "Sure: " + answer(GT),  # text before the answer
        answer(GT)[:-1] + ', "note": "x"}',  # a key that is not an object entry
        answer(GT[:3])[:-1] + ', "object_4": {"desc": "car", "bbox_2d": ["<|coord_600|>", "<|coord_600|>"]}}',
        answer(GT[:3])[:-1] + ', "object_4": {"desc": "car", "bbox_2d": ["600", "600", "900", "900"]}}',
    ],
    ids=["unclosed", "trailing-text", "leading-text", "extra-key", "short-bbox", "plain-text-coords"],
)
def test_malformed_answer_gets_format_zero(scorer: DetectionScorer, text: str) -> None:
    got = score(scorer, text)
    assert got["format"] == 0.0
    assert got["f1"] >= 0.75  # the complete, valid objects still count (as in the stage-2 eval F1)


def test_stop_marker_ends_the_answer(scorer: DetectionScorer) -> None:
    """Whatever follows the end-of-turn marker is not part of the answer (§6.2 hard stop)."""
    assert score(scorer, answer(GT) + "<|im_end|> junk", eot=False)["format"] == 1.0
    assert (
        score(scorer, answer(GT), eot=False)["format"] == 1.0
    )  # cut by max_new_tokens right after the close


def test_image_with_nothing_to_find(scorer: DetectionScorer) -> None:
    empty = {"task_mode": DETECTION_TASK, "objects": []}
    assert set(score(scorer, "{}", empty).values()) == {1.0}
    assert set(score(scorer, "nothing here", empty).values()) == {0.0}
    got = score(scorer, answer(GT[:1]), empty)
    assert (got["f1"], got["precision"], got["format"]) == (0.0, 0.0, 1.0)


def test_malformed_gt_objects_are_left_out(scorer: DetectionScorer) -> None:
    row = {**ROW, "objects": [*GT, {"desc": "", "bbox_2d": [1, 2, 3, 4]}]}
    assert score(scorer, answer(GT))["f1"] == score(scorer, answer(GT), row)["f1"] == 1.0


def test_text_path_equals_token_path(scorer: DetectionScorer) -> None:
    texts = [answer(GT), answer(GT[:2]), "{}", "garbage", answer(GT) + " more"]
    ids = [scorer.tokenizer.encode(t, add_special_tokens=False) for t in texts]
    rows = [ROW] * len(texts)
    weights = PRESETS["detection"]
    assert total_reward(texts, rows, weights, detection=scorer) == total_reward(
        texts, rows, weights, token_ids=ids, detection=scorer
    )


def test_detection_preset_total_and_other_tasks(scorer: DetectionScorer) -> None:
    summary_row = {"task_mode": "summary", "domain": "BBU", "summary_ref": {"统计": []}}
    texts = [answer(GT[:2]), answer(GT), answer(GT)]
    rows = [ROW, ROW, summary_row]
    totals, per = total_reward(texts, rows, PRESETS["detection"], detection=scorer)
    assert totals[0] == pytest.approx(1.0 * 2 / 3 + 0.5 * 1.0 + 0.25 * 1.0)
    assert totals[1] == pytest.approx(1.75) and totals[2] == 0.0  # detection rewards score 0 on a summary row
    assert list(per) == list(PRESETS["detection"])
    # a summary reward scores a detection row 0 too
    _, per = total_reward(texts, rows, {"summary.format": 1.0, "detection.f1": 1.0}, detection=scorer)
    assert per["summary.format"][:2] == [0.0, 0.0] and per["detection.f1"] == [pytest.approx(2 / 3), 1.0, 0.0]


def test_registry_names_and_errors(scorer: DetectionScorer) -> None:
    assert set(PRESETS["detection"]) == set(DETECTION_REWARDS) and set(DETECTION_REWARDS) <= set(REWARD_NAMES)
    assert {n for n, w in PRESETS["detection"].items() if w == 0} == {
        "detection.precision",
        "detection.recall",
        "detection.no_duplicates",
        "detection.count",
        "detection.f1_iou50",
    }
    assert set(PRESETS["detection_dedup"]) == set(DETECTION_REWARDS)
    assert get_reward("detection.f1") is DETECTION_REWARDS["detection.f1"]
    with pytest.raises(KeyError, match="detection.maskiou"):
        get_reward("detection.map")
    with pytest.raises(ValueError, match="tokenizer"):
        total_reward(["{}"], [ROW], {"detection.f1": 1.0})
    with pytest.raises(ValueError, match="token id lists"):
        total_reward(["{}"], [ROW], {"detection.f1": 1.0}, token_ids=[], detection=scorer)


def test_duplicates_and_unmatched_predictions_lower_the_reward(scorer: DetectionScorer) -> None:
    """Issue 33: a duplicate (a second prediction of an object already predicted: the one-to-one matcher
    leaves it unmatched) and a prediction matching nothing count as false positives: F1 and the preset's total
    drop; the mean maskIoU of the matches and the format term do not see them."""
    weights = PRESETS["detection"]
    exact = answer(GT)
    duplicate = answer([*GT, GT[0]])
    stray = answer([*GT, {"desc": "x", "bbox_2d": [10, 950, 40, 990]}])
    totals, _ = total_reward([exact, duplicate, stray], [ROW] * 3, weights, detection=scorer)
    for text in (duplicate, stray):
        got = score(scorer, text)
        assert got["f1"] == pytest.approx(2 * 4 / (5 + 4)) and got["precision"] == pytest.approx(4 / 5)
        assert (got["recall"], got["maskiou"], got["format"]) == (1.0, 1.0, 1.0)
    assert totals[0] == pytest.approx(1.75)
    assert totals[1] == totals[2] == pytest.approx(1.0 * 8 / 9 + 0.5 + 0.25)
    assert totals[1] < totals[0]


def test_duplicate_free_rate_and_the_dedup_preset(scorer: DetectionScorer) -> None:
    """`detection.no_duplicates` counts what the evaluator counts (a second answer for a matched object),
    not a stray prediction; the `detection_dedup` preset prices both through precision and the duplicate
    term."""
    exact, duplicate = answer(GT), answer([*GT, GT[0]])
    stray = answer([*GT, {"desc": "x", "bbox_2d": [10, 950, 40, 990]}])
    no_dup = get_reward("detection.no_duplicates")
    samples = [scorer.sample(ROW, t) for t in (exact, duplicate, stray, "{}")]
    assert [s.duplicates for s in samples] == [0, 1, 0, 0]
    assert [no_dup(s) for s in samples] == [1.0, pytest.approx(0.8), 1.0, 1.0]
    assert no_dup(scorer.sample({"task_mode": "summary"}, exact)) == 0.0
    totals, _ = total_reward(
        [exact, duplicate, stray], [ROW] * 3, PRESETS["detection_dedup"], detection=scorer
    )
    f1 = 8 / 9  # 4 matches of 5 predictions and 4 objects
    assert totals == [
        pytest.approx(1 + 0.5 + 0.25 + 0.5 + 0.5),
        pytest.approx(f1 + 0.5 + 0.25 + 0.5 * 0.8 + 0.5 * 0.8),
        pytest.approx(f1 + 0.5 + 0.25 + 0.5 * 0.8 + 0.5),
    ]


def test_count_term_prices_missing_and_extra_objects_alike(scorer: DetectionScorer) -> None:
    """`detection.count` is ``1 − min(1, |pred − gt| / gt)``: one object left out costs what one duplicate
    costs, so the `detection_count` preset (unlike `detection_dedup`'s precision term) does not pay for
    leaving out an uncertain object; an empty GT wants `{}`."""
    count = get_reward("detection.count")
    texts = [answer(GT), answer(GT[:3]), answer([*GT, GT[0]]), answer([*GT, *GT]), "{}", answer(GT + GT + GT)]
    samples = [scorer.sample(ROW, t) for t in texts]
    assert [count(s) for s in samples] == [1.0, 0.75, 0.75, 0.0, 0.0, 0.0]
    empty = {"task_mode": DETECTION_TASK, "objects": []}
    assert [count(scorer.sample(empty, t)) for t in ("{}", answer(GT[:1]))] == [1.0, 0.0]
    assert count(scorer.sample({"task_mode": "summary"}, answer(GT))) == 0.0
    assert set(PRESETS["detection_count"]) == set(DETECTION_REWARDS)
    assert PRESETS["detection_count"]["detection.precision"] == 0.0
    # Where the policy already predicts too few, the dedup preset pays for dropping an uncertain (unmatched)
    # guess: +0.23 here, through precision and F1. The count preset leaves the choice to F1 and the count,
    # which pull opposite ways: the guess is kept (it would match a real object if better placed).
    stray = {"desc": "x", "bbox_2d": [10, 950, 40, 990]}
    guessed, dropped = answer([*GT[:3], stray]), answer(GT[:3])
    dedup, _ = total_reward([guessed, dropped], [ROW] * 2, PRESETS["detection_dedup"], detection=scorer)
    counted, _ = total_reward([guessed, dropped], [ROW] * 2, PRESETS["detection_count"], detection=scorer)
    f1_guessed, f1_dropped = 2 * 3 / 8, 2 * 3 / 7
    assert dedup == [
        pytest.approx(f1_guessed + 0.5 + 0.25 + 0.5 * 0.75 + 0.5),
        pytest.approx(f1_dropped + 0.5 + 0.25 + 0.5 * 1.0 + 0.5),
    ]
    assert counted == [
        pytest.approx(f1_guessed + 0.5 + 0.25 + 0.5 + 0.5 * 1.0),
        pytest.approx(f1_dropped + 0.5 + 0.25 + 0.5 + 0.5 * 0.75),
    ]
    assert dedup[1] - dedup[0] > 0.2 and counted[0] > counted[1]


def test_f1_at_iou50_counts_only_tight_boxes(scorer: DetectionScorer) -> None:
    """`detection.f1_iou50` is the evaluator's F1 at maskIoU 0.5: a box shifted to maskIoU ~0.3 of its object
    still matches at the gate (0.3), so `detection.f1` pays it in full; at 0.5 it is a miss and a stray. The
    `detection_iou50` preset swaps the two F1 terms and keeps the rest of `detection_count`."""
    loose_cat = {"desc": "cat", "bbox_2d": [160, 160, 360, 360]}  # 140² ∩ of 200² boxes: IoU 19600 / 60400
    loose = answer([loose_cat, *GT[1:]])
    iou = mask_iou(("bbox_2d", loose_cat["bbox_2d"]), ("bbox_2d", GT[0]["bbox_2d"]))
    assert 0.3 <= iou < 0.5
    exact_s, loose_s = (scorer.sample(ROW, t) for t in (answer(GT), loose))
    f1, f1_50 = get_reward("detection.f1"), get_reward("detection.f1_iou50")
    assert (f1(exact_s), f1_50(exact_s)) == (1.0, 1.0)
    assert f1(loose_s) == 1.0 and f1_50(loose_s) == pytest.approx(2 * 3 / 8)
    assert loose_s.matched == 4 and loose_s.matched_iou50 == 3
    assert f1_50(scorer.sample({"task_mode": DETECTION_TASK, "objects": []}, "{}")) == 1.0
    preset = PRESETS["detection_iou50"]
    assert set(preset) == set(DETECTION_REWARDS) and preset["detection.f1"] == 0.0
    assert {k: v for k, v in preset.items() if k not in ("detection.f1", "detection.f1_iou50")} == {
        k: v for k, v in PRESETS["detection_count"].items() if k not in ("detection.f1", "detection.f1_iou50")
    }
    totals, _ = total_reward([answer(GT), loose], [ROW] * 2, preset, detection=scorer)
    assert totals[0] - totals[1] == pytest.approx((1 - 0.75) + 0.5 * (1 - (3 + iou) / 4))
