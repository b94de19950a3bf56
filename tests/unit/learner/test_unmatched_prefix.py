"""`stage2.targets.unmatched_prefix`: `keep` (the spec), `drop` (matched objects only), `reorder` (the ground
truth in the model's order).

Runs `prepare_segment` (parse → match → Y_train → segment) on the tiny model's real tokenizer. Invariants are
checked on token IDS and labels, not on decoded text: two token paths of the same text (`{` `"object` … as
the plain-GT targets train, or the merged `{"` … that encoding the whole answer gives) decode alike, and
training the second one collapsed the text demo (issue 23).
"""

from __future__ import annotations

import pytest

from learner.config import RunConfig
from learner.stage2.format import serialize_entry, serialize_objects
from learner.stage2.gt import extract_gt
from learner.stage2.pipeline import prepare_segment
from learner.trainers.build import sample_context
from shared_schemas.infer import Choice, InferResult
from tests.unit.learner.raw_records import raw_record

CAT = ("cat", "bbox_2d", [100, 100, 300, 300])
BIRD = ("bird", "bbox_2d", [800, 800, 900, 900])  # overlaps no GT object: a false positive
DOG = ("dog", "bbox_2d", [500, 100, 700, 300])
DOG_GT = ("dog", "bbox_2d", [505, 100, 700, 300])  # the prediction is 5 bins off in x1
FISH = ("fish", "bbox_2d", [100, 600, 300, 800])  # never predicted: a false negative


def _raw(obj: tuple[str, str, list[int]]) -> dict:
    desc, geom, bins = obj
    return {"desc": desc, geom: [f"<|coord_{b}|>" for b in bins]}


def _prepare(
    tokenizer,
    tiny_model_dir,
    policy: str,
    predicted,
    gt,
    *,
    empty=False,
    rollout_ids=None,
    opening="split",
    orders=("listed",),
):
    targets = {"unmatched_prefix": policy, "opening": opening, "reorder_orders": list(orders)}
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {"targets": targets},
        }
    )
    ctx = sample_context(cfg, tokenizer)
    sample = raw_record(0, [_raw(o) for o in gt], text="scene")
    answer = "{" + ", ".join(serialize_entry(n + 1, *o) for n, o in enumerate(predicted)) + "}"
    result = InferResult(
        index=0,
        request_id="r0",
        prompt_token_ids=ctx.prompt_ids(sample),
        choices=[
            Choice(
                token_ids=[]
                if empty
                else rollout_ids
                if rollout_ids is not None
                else tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False),
                text="",
                finish_reason="stop",
            )
        ],
        weight_version=1,
    )
    segment, outcome = prepare_segment(sample, result, ctx, rollout_step=0)
    assert segment is not None
    answer_ids = list(
        segment.input_ids[segment.meta.prompt_len : segment.meta.prompt_len + segment.meta.train_len]
    )
    return tokenizer.decode(answer_ids), segment, outcome


@pytest.mark.parametrize("policy", ["keep", "drop"])
def test_a_false_positive_stays_in_the_prefix_or_is_dropped(tiny_tokenizer, tiny_model_dir, policy) -> None:
    text, segment, outcome = _prepare(
        tiny_tokenizer, tiny_model_dir, policy, [CAT, BIRD, DOG], [CAT, DOG_GT, FISH]
    )
    gts = extract_gt([_raw(o) for o in [FISH]], sample_id=0).objects
    if policy == "keep":  # the spec: the FP stays, FISH is appended as object_4
        assert (
            text
            == "{"
            + ", ".join(
                [
                    *(serialize_entry(n + 1, *o) for n, o in enumerate([CAT, BIRD, DOG])),
                    serialize_entry(4, *FISH),
                ]
            )
            + "}"
        )
    else:  # the matched objects in the model's order (its own coordinates), renumbered, then the FN
        assert text == serialize_objects([_obj(CAT), _obj(DOG), *gts])
    # the generated rollout is what the counters describe, either way
    assert outcome.counters["valid_pred_objects"] == 3.0 and outcome.counters["fp"] == 1.0
    assert outcome.counters["matched_for_supervision"] == 2.0 and outcome.counters["fn_appended"] == 1.0
    # the two matched predictions' coordinate slots are supervised toward their GT (dog's x1: 500 → 505)
    prefix_bins = [
        int(b) for b, is_prefix in zip(segment.coord_bins, segment.coord_is_prefix, strict=True) if is_prefix
    ]
    assert prefix_bins == [100, 100, 300, 300, 505, 100, 700, 300]


def test_a_rollout_without_unmatched_objects_is_trained_on_its_own_tokens(
    tiny_tokenizer, tiny_model_dir
) -> None:
    kept = _prepare(tiny_tokenizer, tiny_model_dir, "keep", [CAT, DOG], [CAT, DOG_GT, FISH])
    dropped = _prepare(tiny_tokenizer, tiny_model_dir, "drop", [CAT, DOG], [CAT, DOG_GT, FISH])
    assert list(kept[1].input_ids) == list(dropped[1].input_ids) and list(kept[1].labels) == list(
        dropped[1].labels
    )


def test_a_rollout_with_nothing_matched_becomes_the_ground_truth(tiny_tokenizer, tiny_model_dir) -> None:
    text, _, outcome = _prepare(tiny_tokenizer, tiny_model_dir, "drop", [BIRD], [CAT, FISH])
    assert text == serialize_objects(extract_gt([_raw(CAT), _raw(FISH)], sample_id=0).objects)
    assert outcome.counters["fp"] == 1.0 and outcome.counters["valid_pred_objects"] == 1.0


class _obj:  # noqa: N801 - a SerializableObject built from a (desc, geom_type, bins) tuple
    def __init__(self, o: tuple[str, str, list[int]]) -> None:
        self.desc, self.geom_type, self.bins = o


def test_an_empty_rollout_gives_the_plain_ground_truth_either_way(tiny_tokenizer, tiny_model_dir) -> None:
    """The stage-1 warm-up (`stage2.sft_warmup_steps`) trains on an empty rollout: identical segments."""
    kept = _prepare(tiny_tokenizer, tiny_model_dir, "keep", [], [CAT, FISH], empty=True)
    dropped = _prepare(tiny_tokenizer, tiny_model_dir, "drop", [], [CAT, FISH], empty=True)
    assert list(kept[1].input_ids) == list(dropped[1].input_ids) and list(kept[1].labels) == list(
        dropped[1].labels
    )
    assert kept[0] == serialize_objects(extract_gt([_raw(CAT), _raw(FISH)], sample_id=0).objects)


# -- invariants on token ids (issue 23) ----------------------------------------------------------------------
def _sft_path(tokenizer, objects) -> list[int]:
    """What a model trained on the plain-GT targets generates for `objects`: their token path, then the end of
    turn."""
    from learner.stage2.coords import CoordVocab
    from learner.stage2.targets.y_train import answer_ids

    return answer_ids([_obj(o) for o in objects], tokenizer, CoordVocab.from_tokenizer(tokenizer)) + [
        tokenizer.convert_tokens_to_ids("<|im_end|>")
    ]


def _same(a, b) -> bool:
    return (
        list(a.input_ids) == list(b.input_ids)
        and list(a.labels) == list(b.labels)
        and list(a.coord_pos) == list(b.coord_pos)
        and list(a.coord_bins) == list(b.coord_bins)
    )


@pytest.mark.parametrize("policy", ["keep", "drop", "reorder"])
def test_a_rollout_equal_to_the_ground_truth_is_trained_on_the_plain_sft_tokens(
    tiny_tokenizer, tiny_model_dir, policy
) -> None:
    """The model answers exactly the GT, in the token path the warm-up trained: every policy teacher-forces
    the plain-SFT token ids; `reorder` also supervises them exactly as plain SFT does (labels and coordinate
    slots), `keep`/`drop` leave the prefix's desc values unsupervised (§12)."""
    gt = [CAT, DOG_GT, FISH]
    sft = _prepare(tiny_tokenizer, tiny_model_dir, policy, [], gt, empty=True)[1]
    rm = _prepare(tiny_tokenizer, tiny_model_dir, policy, gt, gt, rollout_ids=_sft_path(tiny_tokenizer, gt))[
        1
    ]
    assert list(rm.input_ids) == list(sft.input_ids)
    if policy == "reorder":
        assert _same(rm, sft)


@pytest.mark.parametrize("policy", ["drop", "reorder"])
@pytest.mark.parametrize(
    "case",
    ["all_false_positive", "nothing_parsable", "text_before_the_brace"],
)
def test_a_rollout_without_usable_objects_is_trained_exactly_like_plain_sft(
    tiny_tokenizer, tiny_model_dir, policy, case
) -> None:
    """Nothing matched (a hallucination, garbage, or text before the `{`): the target is the plain-GT
    segment, token for token and label for label — the first answer token is the bare `{` the model opens
    with, never the merged `{"` (the collapse of issue 23)."""
    gt = [CAT, FISH]
    im_end = tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    rollout = {
        "all_false_positive": _sft_path(tiny_tokenizer, [BIRD]),
        "nothing_parsable": tiny_tokenizer.encode('111":1": cat', add_special_tokens=False) + [im_end],
        "text_before_the_brace": tiny_tokenizer.encode('111":1": ', add_special_tokens=False)
        + _sft_path(tiny_tokenizer, [BIRD]),
    }[case]
    sft = _prepare(tiny_tokenizer, tiny_model_dir, policy, [], gt, empty=True)[1]
    rm = _prepare(tiny_tokenizer, tiny_model_dir, policy, [], gt, rollout_ids=rollout)[1]
    assert _same(rm, sft)
    assert rm.input_ids[rm.meta.prompt_len] == tiny_tokenizer.encode("{", add_special_tokens=False)[0]


def test_drop_teacher_forces_the_matched_objects_in_the_plain_sft_token_path(
    tiny_tokenizer, tiny_model_dir
) -> None:
    """A false positive between two matches: the pruned answer's ids are the plain-GT path of the same
    objects (what the model generates), not a fresh encoding of the whole text."""
    rollout = _sft_path(tiny_tokenizer, [CAT, BIRD, DOG])
    _, rm, _ = _prepare(tiny_tokenizer, tiny_model_dir, "drop", [], [CAT, DOG_GT, FISH], rollout_ids=rollout)
    want = _sft_path(tiny_tokenizer, [CAT, DOG, FISH])[:-1]  # the model's own matched objects, then the FN
    got = list(rm.input_ids[rm.meta.prompt_len : rm.meta.prompt_len + rm.meta.train_len])
    assert got == want


def test_reorder_is_plain_sft_of_the_ground_truth_in_the_model_order(tiny_tokenizer, tiny_model_dir) -> None:
    """The model emits DOG before CAT (and a false positive): the target is the GT with DOG first (its GT
    coordinates), then CAT, then the missed FISH — the plain-SFT segment of that order, FP gone."""
    rollout = _sft_path(tiny_tokenizer, [DOG, BIRD, CAT])
    _, rm, outcome = _prepare(
        tiny_tokenizer, tiny_model_dir, "reorder", [], [CAT, DOG_GT, FISH], rollout_ids=rollout
    )
    sft = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], [DOG_GT, CAT, FISH], empty=True)[1]
    assert _same(rm, sft)
    # the counters describe the generated rollout: 3 predictions, 2 matched, 1 FP, 1 FN
    assert outcome.counters["valid_pred_objects"] == 3.0 and outcome.counters["fp"] == 1.0
    assert outcome.counters["matched"] == 2.0 and outcome.counters["fn"] == 1.0


@pytest.mark.parametrize("emitted", [[CAT, FISH], [DOG, FISH], [CAT], [FISH], [CAT, BIRD, FISH]])
def test_reorder_of_a_rollout_in_the_gt_order_that_misses_objects_is_plain_sft(
    tiny_tokenizer, tiny_model_dir, emitted
) -> None:
    """The model follows the GT order (CAT, DOG, FISH) but skips objects (and may add a false positive): the
    missed ones go where the GT order puts them, so the target is the plain-SFT segment token for token and
    label for label — not the matches first and the misses after (CAT, FISH, DOG: an order the data never
    uses, which made `reorder` lose to plain SFT on sorted order)."""
    gt = [CAT, DOG_GT, FISH]
    rollout = _sft_path(tiny_tokenizer, emitted)
    _, rm, outcome = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, rollout_ids=rollout)
    sft = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, empty=True)[1]
    assert _same(rm, sft)
    assert outcome.counters["fn"] == 3.0 - sum(o is not BIRD for o in emitted)


def test_reorder_keeps_the_model_order_when_it_disagrees_with_the_gt_order(
    tiny_tokenizer, tiny_model_dir
) -> None:
    """FISH before CAT (GT order CAT, DOG, FISH), DOG missed: the model's order of its matches, then the
    miss."""
    rollout = _sft_path(tiny_tokenizer, [FISH, CAT])
    gt = [CAT, DOG_GT, FISH]
    _, rm, _ = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, rollout_ids=rollout)
    want = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], [FISH, CAT, DOG_GT], empty=True)[1]
    assert _same(rm, want)


@pytest.mark.parametrize("emitted", [[CAT, FISH], [CAT, DOG, FISH], [DOG, FISH], [CAT, BIRD, FISH]])
def test_reorder_of_a_rollout_in_anchor_order_on_listed_gt_is_plain_sft_of_the_sorted_answer(
    tiny_tokenizer, tiny_model_dir, emitted
) -> None:
    """A model trained on sorted answers, fine-tuned on GT listed otherwise (FISH, DOG, CAT): with
    `reorder_orders: [listed, sorted]` its anchor-ordered rollout (misses and false positives or not) is
    trained on the GT in sorted order, token for token the plain-SFT segment of the sorted answer; with the
    listed order alone, on its matches then the misses in listed order."""
    listed = [FISH, DOG_GT, CAT]
    rollout = _sft_path(tiny_tokenizer, emitted)
    both = ("listed", "sorted")
    rm = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], listed, rollout_ids=rollout, orders=both)[1]
    sorted_sft = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], [CAT, DOG_GT, FISH], empty=True)[1]
    assert _same(rm, sorted_sft)
    old = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], listed, rollout_ids=rollout)[1]
    matched = [DOG_GT if o is DOG else o for o in emitted if o is not BIRD]
    want = matched + [o for o in listed if o not in matched]
    assert _same(old, _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], want, empty=True)[1])


def test_reorder_orders_are_tried_in_turn(tiny_tokenizer, tiny_model_dir) -> None:
    """GT listed in anchor order: both orders fit and give the plain-SFT answer; a rollout
    that fits neither keeps the model's order, misses in listed order."""
    gt = [CAT, DOG_GT, FISH]
    both = ("sorted", "listed")
    sft = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, empty=True)[1]
    rollout = _sft_path(tiny_tokenizer, [CAT, FISH])
    assert _same(
        _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, rollout_ids=rollout, orders=both)[1], sft
    )
    rollout = _sft_path(tiny_tokenizer, [FISH, CAT])
    got = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], gt, rollout_ids=rollout, orders=both)[1]
    assert _same(
        got, _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], [FISH, CAT, DOG_GT], empty=True)[1]
    )


# Five objects in anchor (sorted) order, one row apart, for orders long enough to be nearly followed.
ROW = [(f"o{k}", "bbox_2d", [100 * k + 50, 100, 100 * k + 120, 170]) for k in range(5)]


def test_reorder_places_the_misses_by_the_order_a_nearly_ordered_rollout_follows(
    tiny_tokenizer, tiny_model_dir
) -> None:
    """A crowded row: the model swaps two neighbours (o1 after o2) and misses o3. Its matches agree with the
    listed order on 5 of 6 pairs, so the miss goes where that order puts it (before o4), not after the
    matches: target o0, o2, o1, o3, o4 — the model's order plus the miss in place (on the crowded sorted task
    the misses-at-the-end target cost 0.06 held-out F1 against plain SFT, bench/RESULTS.md)."""
    o0, o1, o2, o3, o4 = ROW
    rollout = _sft_path(tiny_tokenizer, [o0, o2, o1, o4])
    _, rm, outcome = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], ROW, rollout_ids=rollout)
    want = _prepare(tiny_tokenizer, tiny_model_dir, "reorder", [], [o0, o2, o1, o3, o4], empty=True)[1]
    assert _same(rm, want)
    assert outcome.counters["matched"] == 4.0 and outcome.counters["fn"] == 1.0


def test_reorder_orders_must_be_distinct(tiny_model_dir) -> None:
    with pytest.raises(ValueError, match="names an order twice"):
        RunConfig.model_validate(
            {
                "model": {"path": str(tiny_model_dir)},
                "data": {"train": ["x.jsonl"]},
                "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
                "stage2": {"targets": {"reorder_orders": ["sorted", "sorted"]}},
            }
        )


@pytest.mark.parametrize(
    ("policy", "rollout", "order"),
    [
        ("keep", None, [CAT, FISH]),  # None: an empty rollout (the plain-GT warm-up)
        ("drop", None, [CAT, FISH]),
        ("reorder", None, [CAT, FISH]),
        ("drop", [BIRD, CAT, FISH], [CAT, FISH]),  # the false positive is dropped
        ("reorder", [FISH, CAT], [FISH, CAT]),  # the GT in the model's order
    ],
)
def test_merged_opening_trains_the_whole_text_encoding(
    tiny_tokenizer, tiny_model_dir, policy, rollout, order
) -> None:
    """`stage2.targets.opening: merged`: the plain-GT answer is its text encoded in one piece (the merged `{"`
    first), for an empty rollout and for rollouts `drop` / `reorder` rewrite (`drop` keeps the model's own
    objects as its unsupervised prefix); `split` (the default) opens with `{` alone."""
    text = serialize_objects(extract_gt([_raw(o) for o in order], sample_id=0).objects)
    want = tiny_tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
    assert tiny_tokenizer.decode(want[:1]) == '{"'
    kw = {"empty": True} if rollout is None else {}
    _, seg, _ = _prepare(
        tiny_tokenizer, tiny_model_dir, policy, rollout or [], [CAT, FISH], opening="merged", **kw
    )
    start = seg.meta.prompt_len
    supervised = [i for i, label in enumerate(seg.labels) if i >= start and label != -100]
    assert list(seg.input_ids[start : supervised[-1] + 1]) == want
    if rollout is None or policy == "reorder":  # wholly plain GT: the opening token is trained too
        assert supervised[0] == start
    _, split, _ = _prepare(tiny_tokenizer, tiny_model_dir, policy, rollout or [], [CAT, FISH], **kw)
    assert tiny_tokenizer.decode([split.input_ids[split.meta.prompt_len]]) == "{"
