"""The order `unmatched_prefix: reorder` teacher-forces the ground truth in: the model's own for its
matches, the misses placed by the order the matches follow (`stage2.targets.reorder_orders`)."""

from __future__ import annotations

from collections.abc import Sequence

from learner.stage2.gt import GTObject, anchor_order
from learner.stage2.matching.match import MatchResult

__all__ = ["REORDER_AGREEMENT", "model_order", "reorder_ground_truth"]


def reorder_ground_truth(
    match: MatchResult, objects: Sequence[GTObject], order_names: Sequence[str]
) -> list[GTObject]:
    """``objects`` (the listed GT) in :func:`model_order`, the candidate orders named by ``order_names``
    (``listed``: as given; ``sorted``: by the ``(y, x)`` anchor)."""
    named = {"listed": lambda: range(len(objects)), "sorted": lambda: anchor_order(objects)}
    orders = [named[name]() for name in order_names]
    return [objects[j] for j in model_order(match, len(objects), orders)]


REORDER_AGREEMENT = 0.75
"""Fraction of the pairs of the model's matches that an order must put the way the model did (Kendall
concordance) for the misses to be placed by it. A model with an order habit (a sorted-trained detector that
swaps two neighbours of a crowded row) agrees 0.9-1.0 with its order; matches in an order unrelated to the
candidate agree 0.5 on average, and their misses go after them as before."""


def model_order(match: MatchResult, n_gt: int, orders: Sequence[Sequence[int]] | None = None) -> list[int]:
    """GT indices in the order `unmatched_prefix: reorder` teacher-forces them.

    ``orders``: candidate orders of all ``n_gt`` GT indices (default: the listed order alone;
    `stage2.targets.reorder_orders`). The matched GT objects keep the model's order; the order that agrees
    best with it (the most concordant pairs of matches; ties: the first) places the missed ones: each goes
    right before the first match that order ranks after it. Where the matches follow that order, the result
    is the order itself (for the listed order exactly the plain-SFT target; see docs/ALGORITHM.md); where they
    agree on fewer than :data:`REORDER_AGREEMENT` of their pairs, the misses follow the matches in the first
    order."""
    candidates = [list(o) for o in orders] if orders is not None else [list(range(n_gt))]
    matched = [j for _, j, _ in match.pairs]  # pairs are sorted by prediction index: the model's order
    best, best_rank, best_concordant = candidates[0], {}, -1
    for order in candidates:
        rank = {j: r for r, j in enumerate(order)}
        concordant = sum(rank[a] < rank[b] for i, a in enumerate(matched) for b in matched[i + 1 :])
        if concordant > best_concordant:
            best, best_rank, best_concordant = order, rank, concordant
    seen = set(matched)
    if best_concordant < REORDER_AGREEMENT * len(matched) * (len(matched) - 1) / 2:
        return matched + [j for j in candidates[0] if j not in seen]
    misses = [j for j in best if j not in seen]  # in rank order
    placed, m = [], 0
    for j in matched:  # each miss right before the first match ranked after it (a followed order: itself)
        while m < len(misses) and best_rank[misses[m]] < best_rank[j]:
            placed.append(misses[m])
            m += 1
        placed.append(j)
    return placed + misses[m:]
