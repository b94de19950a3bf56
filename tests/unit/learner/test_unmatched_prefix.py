"""`stage2.targets.unmatched_prefix: drop`: the teacher-forced answer keeps the matched objects only.

Runs `prepare_segment` (parse → match → Y_train → segment) on the tiny model's real tokenizer, once with the
spec's `keep` and once with `drop`, on a rollout holding a false positive between two matches.
"""

from __future__ import annotations

import pytest

from learner.config import RunConfig
from learner.stage2.format import serialize_entry, serialize_objects
from learner.stage2.gt import extract_gt
from learner.stage2.pipeline import prepare_segment
from learner.trainers.build import _sample_context
from shared_schemas.infer import Choice, InferResult

CAT = ("cat", "bbox_2d", [100, 100, 300, 300])
BIRD = ("bird", "bbox_2d", [800, 800, 900, 900])  # overlaps no GT object: a false positive
DOG = ("dog", "bbox_2d", [500, 100, 700, 300])
DOG_GT = ("dog", "bbox_2d", [505, 100, 700, 300])  # the prediction is 5 bins off in x1
FISH = ("fish", "bbox_2d", [100, 600, 300, 800])  # never predicted: a false negative


def _raw(obj: tuple[str, str, list[int]]) -> dict:
    desc, geom, bins = obj
    return {"desc": desc, geom: [f"<|coord_{b}|>" for b in bins]}


def _prepare(tokenizer, tiny_model_dir, policy: str, predicted, gt, *, empty: bool = False):
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {"targets": {"unmatched_prefix": policy}},
        }
    )
    ctx = _sample_context(cfg, tokenizer)
    sample = {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "scene"}]}],
        "gt_objects": [_raw(o) for o in gt],
        "images": [],
        "width": 1000,
        "height": 1000,
        "base_idx": 0,
        "dataset": "t",
        "sample_id": 0,
    }
    answer = "{" + ", ".join(serialize_entry(n + 1, *o) for n, o in enumerate(predicted)) + "}"
    result = InferResult(
        index=0,
        request_id="r0",
        prompt_token_ids=ctx.prompt_ids(sample),
        choices=[
            Choice(
                token_ids=[] if empty else tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False),
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
