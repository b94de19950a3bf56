"""`learner.evaluate.order`: which known object order a model's matched predictions follow (pair agreement
pooled over samples), on synthetic emissions; and `metrics.json`'s `object_order` from evaluated samples."""

from __future__ import annotations

import random

import pytest

from learner.evaluate.order import emitted_order, measure_order, prediction_order
from learner.stage2.gt import GTObject, anchor_order
from learner.stage2.targets.order import (
    MIN_ORDER_PAIRS,
    ORDER_NAMES,
    REORDER_AGREEMENT,
    candidate_order,
    concordant_pairs,
)
from tests.unit.learner.evaluate.helpers import gt, pred, sample


def _scene(rng: random.Random, n: int) -> list[GTObject]:
    """``n`` boxes at distinct random anchors, listed in random order (a `random`-ordering record)."""
    cells = rng.sample(range(100), n)
    return [
        GTObject(k + 1, "a", "bbox_2d", (x, y, x + 5, y + 5))
        for k, (y, x) in enumerate((10 * (c // 10), 10 * (c % 10)) for c in cells)
    ]


def _emissions(style: str, seed: int = 0, samples: int = 40) -> list[tuple[list[int], list[GTObject]]]:
    """Per sample, the GT indices a model matched in the order it emitted them (about 2 in 3 found)."""
    rng = random.Random(seed)
    out = []
    for _ in range(samples):
        objects = _scene(rng, rng.randint(4, 12))
        order = {"sorted": anchor_order(objects), "listed": list(range(len(objects)))}.get(style)
        if order is None:  # no habit: any order
            order = rng.sample(range(len(objects)), len(objects))
        out.append(([j for j in order if rng.random() < 0.67], objects))
    return out


def test_a_model_emitting_the_anchor_order_follows_sorted() -> None:
    got = measure_order(_emissions("sorted"))
    assert got.agreement["sorted"] == 1.0 and got.best == got.follows == "sorted"
    assert 0.35 < got.agreement["listed"] < 0.65  # the random listing is unrelated to the anchor order
    assert got.tied == ("sorted",) and got.pairs > 100 and 0 < got.samples <= 40


def test_a_model_emitting_the_listed_order_follows_listed() -> None:
    got = measure_order(_emissions("listed"))
    assert got.agreement["listed"] == 1.0 and got.follows == "listed"


def test_a_model_without_an_order_follows_none() -> None:
    got = measure_order(_emissions("none", seed=3))
    assert all(0.35 < a < 0.65 for a in got.agreement.values())  # type: ignore[operator]
    assert got.follows is None and got.best in ORDER_NAMES


def test_a_swap_now_and_then_still_follows_the_order() -> None:
    emissions = _emissions("sorted", seed=1)
    for emitted, _ in emissions[::3]:
        if len(emitted) >= 2:
            emitted[0], emitted[1] = emitted[1], emitted[0]
    got = measure_order(emissions)
    assert REORDER_AGREEMENT <= got.agreement["sorted"] < 1.0 and got.follows == "sorted"  # type: ignore[operator]


def test_orders_the_data_cannot_tell_apart_tie_and_the_first_named_wins() -> None:
    """Annotations listed in sorted order: both candidates rank every pair alike."""
    rng = random.Random(2)
    emissions = []
    for _ in range(10):
        scene = _scene(rng, 6)
        objects = [scene[j] for j in anchor_order(scene)]  # listed = sorted
        emissions.append(([j for j in range(6) if rng.random() < 0.8], objects))
    got = measure_order(emissions)
    assert got.tied == ("listed", "sorted") and got.best == got.follows == "listed"
    assert measure_order(emissions, ("sorted", "listed")).best == "sorted"


def test_no_pair_of_matches_measures_nothing() -> None:
    objects = _scene(random.Random(0), 3)
    got = measure_order([([], objects), ([2], objects)])
    assert got.agreement == {"listed": None, "sorted": None} and got.pairs == got.samples == 0
    assert got.best is None and got.follows is None and got.tied == ()
    assert got.to_json()["agreement"] == {"listed": None, "sorted": None}


def test_a_model_measurement_names_no_order_from_too_few_pairs() -> None:
    """2 pairs in sorted order (what one seed's weak base gave the A/B harness): agreement 1.0, no verdict."""
    objects = [GTObject(k + 1, "a", "bbox_2d", (0, y, 5, y + 5)) for k, y in enumerate((30, 10, 20))]
    few = [([1, 2], objects), ([2, 0], objects)]
    assert measure_order(few, ("sorted",)).follows == "sorted"  # the step-wise use asks for no minimum
    got = measure_order(few, ("sorted",), min_pairs=MIN_ORDER_PAIRS)
    assert got.agreement == {"sorted": 1.0} and got.follows is None
    assert got.to_json()["min_pairs"] == MIN_ORDER_PAIRS
    enough = few * (MIN_ORDER_PAIRS // 2)
    assert measure_order(enough, ("sorted",), min_pairs=MIN_ORDER_PAIRS).follows == "sorted"


def test_pairs_are_pooled_over_samples() -> None:
    """3 pairs all concordant with sorted, then 1 discordant pair: 3 of 4."""
    objects = [GTObject(k + 1, "a", "bbox_2d", (0, y, 5, y + 5)) for k, y in enumerate((30, 10, 20))]
    assert anchor_order(objects) == [1, 2, 0]
    got = measure_order([([1, 2, 0], objects), ([0, 1], objects)], ("sorted",), threshold=0.8)
    assert got.agreement == {"sorted": 0.75} and got.pairs == 4 and got.samples == 2
    assert got.best == "sorted" and got.follows is None  # 0.75 < 0.8


@pytest.mark.parametrize(
    ("emitted", "names", "match"),
    [
        ([0, 0], ORDER_NAMES, "distinct"),
        ([0, 3], ORDER_NAMES, r"in 0\.\.2"),
        ([0, 1], (), "non-empty"),
        ([0, 1], ("sorted", "sorted"), "distinct"),
        ([0, 1], ("diagonal",), "not one of"),
    ],
)
def test_bad_input_is_refused(emitted, names, match) -> None:
    with pytest.raises(ValueError, match=match):
        measure_order([(emitted, _scene(random.Random(0), 3))], names)


def test_candidate_orders_and_concordance() -> None:
    objects = [GTObject(k + 1, "a", "bbox_2d", (0, y, 5, y + 5)) for k, y in enumerate((30, 10, 20))]
    assert candidate_order("listed", objects) == [0, 1, 2] and candidate_order("sorted", objects) == [1, 2, 0]
    assert concordant_pairs([1, 2, 0], [1, 2, 0]) == 3 and concordant_pairs([0, 2, 1], [1, 2, 0]) == 0


def test_evaluated_samples_give_the_order_of_their_matched_predictions() -> None:
    """Predictions in anchor order (top to bottom) of GT listed bottom to top; an unmatched one is skipped."""
    gts = [gt((0, 300, 10, 310)), gt((0, 200, 10, 210)), gt((0, 100, 10, 110))]
    preds = [pred((0, 100, 10, 110), gt=2), pred((0, 500, 10, 510)), pred((0, 200, 10, 210), gt=1)]
    preds.append(pred((0, 300, 10, 310), gt=0))
    s = sample(0, preds, gts)
    assert emitted_order(s) == [2, 1, 0]
    got = prediction_order([s, sample(1, [], [])])
    assert got.agreement == {"listed": 0.0, "sorted": 1.0} and got.pairs == 3
    assert got.follows is None  # 3 pairs: too few to call a model's habit (MIN_ORDER_PAIRS)
    assert prediction_order([s] * (MIN_ORDER_PAIRS // 3)).follows == "sorted"
