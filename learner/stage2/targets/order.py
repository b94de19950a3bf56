"""The order `unmatched_prefix: reorder` teacher-forces the ground truth in: the model's own for its
matches, the misses placed by the order the matches follow (`stage2.targets.reorder_orders`)."""

from __future__ import annotations

from collections.abc import Sequence

from learner.stage2.gt import GTObject, anchor_order
from learner.stage2.matching.match import MatchResult

__all__ = [
    "ORDER_NAMES",
    "REORDER_AGREEMENT",
    "candidate_order",
    "concordant_pairs",
    "model_order",
    "reorder_ground_truth",
]

ORDER_NAMES = ("listed", "sorted")
"""The object orders the code knows by name (`stage2.targets.reorder_orders`): ``listed``, as the record
lists the GT (after `data.object_ordering`); ``sorted``, by the ``(y, x)`` anchor (as `object_ordering:
sorted` lists it)."""


def candidate_order(name: str, objects: Sequence[GTObject]) -> list[int]:
    """Indices of ``objects`` (the listed GT) in the order named ``name`` (one of :data:`ORDER_NAMES`).

    Raises:
        ValueError: ``name`` is not one of :data:`ORDER_NAMES`.
    """
    if name == "listed":
        return list(range(len(objects)))
    if name == "sorted":
        return anchor_order(objects)
    raise ValueError(f"object order {name!r} is not one of {list(ORDER_NAMES)}")


def concordant_pairs(emitted: Sequence[int], order: Sequence[int]) -> int:
    """Pairs of ``emitted`` (GT indices in the order a model emitted them) that ``order`` ranks the same way
    (Kendall concordance; ``len(emitted) * (len(emitted) - 1) / 2`` pairs in all)."""
    rank = {j: r for r, j in enumerate(order)}
    return sum(rank[a] < rank[b] for i, a in enumerate(emitted) for b in emitted[i + 1 :])


def reorder_ground_truth(
    match: MatchResult, objects: Sequence[GTObject], order_names: Sequence[str]
) -> list[GTObject]:
    """``objects`` (the listed GT) in :func:`model_order`, the candidate orders named by ``order_names``
    (:func:`candidate_order`)."""
    orders = [candidate_order(name, objects) for name in order_names]
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
    best, best_concordant = candidates[0], -1
    for order in candidates:
        concordant = concordant_pairs(matched, order)
        if concordant > best_concordant:
            best, best_concordant = order, concordant
    best_rank = {j: r for r, j in enumerate(best)}
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
