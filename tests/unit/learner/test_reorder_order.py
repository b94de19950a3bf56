"""`learner.stage2.targets.order.model_order`: where `unmatched_prefix: reorder` puts each GT object.

Pure index logic on a hand-built :class:`MatchResult` (the token-level checks of the same rule are in
test_unmatched_prefix.py)."""

from __future__ import annotations

import pytest

from learner.stage2.matching.match import MatchResult
from learner.stage2.targets.order import REORDER_AGREEMENT, model_order


def _match(gt_in_model_order: list[int], n_gt: int) -> MatchResult:
    pairs = tuple((i, j, 1.0) for i, j in enumerate(gt_in_model_order))
    fn = tuple(sorted(set(range(n_gt)) - set(gt_in_model_order)))
    return MatchResult(pairs, (), fn, 0, len(pairs), float(len(pairs)), len(pairs))


@pytest.mark.parametrize("matched", [[], [3], [0, 2, 5], [1, 2, 3, 4], [0, 1, 2, 3, 4, 5]])
def test_matches_in_the_order_give_the_order_itself(matched) -> None:
    assert model_order(_match(matched, 6), 6) == list(range(6))


def test_a_swap_keeps_the_model_order_and_places_each_miss_before_the_first_match_ranked_after_it() -> None:
    # 5 of 6 pairs concordant (0.83 >= REORDER_AGREEMENT): misses 0, 4, 6 go where the listed order puts them
    assert 5 / 6 >= REORDER_AGREEMENT
    assert model_order(_match([1, 3, 2, 5], 7), 7) == [0, 1, 3, 2, 4, 5, 6]


def test_matches_unrelated_to_the_order_keep_the_misses_after_them() -> None:
    # 2 of 6 pairs concordant: no order to place the misses by
    assert model_order(_match([3, 0, 2, 1], 6), 6) == [3, 0, 2, 1, 4, 5]


def test_the_best_agreeing_candidate_places_the_misses() -> None:
    listed = [4, 1, 3, 0, 2, 5]  # the annotator's order
    by_anchor = [0, 1, 2, 3, 4, 5]  # the order the model has a habit of, one swap here
    got = model_order(_match([0, 2, 1, 3, 5], 6), 6, [listed, by_anchor])
    assert got == [0, 2, 1, 3, 4, 5]


@pytest.mark.parametrize("seed", range(20))
def test_every_gt_object_appears_once_and_the_matches_keep_the_model_order(seed) -> None:
    import random

    rng = random.Random(seed)
    n = rng.randint(1, 12)
    matched = rng.sample(range(n), rng.randint(0, n))
    orders = [list(range(n)), rng.sample(range(n), n)]
    got = model_order(_match(matched, n), n, orders)
    assert sorted(got) == list(range(n))
    assert [j for j in got if j in set(matched)] == matched
