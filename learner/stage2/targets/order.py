"""The order `unmatched_prefix: reorder` teacher-forces the ground truth in: the model's own, recognised as
the listed or the sorted order wherever its matches follow one (`stage2.targets.reorder_orders`)."""

from __future__ import annotations

from collections.abc import Sequence

from learner.stage2.gt import GTObject, anchor_order
from learner.stage2.matching.match import MatchResult

__all__ = ["model_order", "reorder_ground_truth"]


def reorder_ground_truth(
    match: MatchResult, objects: Sequence[GTObject], order_names: Sequence[str]
) -> list[GTObject]:
    """``objects`` (the listed GT) in :func:`model_order`, the candidate orders named by ``order_names``
    (``listed``: as given; ``sorted``: by the ``(y, x)`` anchor)."""
    named = {"listed": lambda: range(len(objects)), "sorted": lambda: anchor_order(objects)}
    orders = [named[name]() for name in order_names]
    return [objects[j] for j in model_order(match, len(objects), orders)]


def model_order(match: MatchResult, n_gt: int, orders: Sequence[Sequence[int]] | None = None) -> list[int]:
    """GT indices in the order `unmatched_prefix: reorder` teacher-forces them.

    ``orders``: candidate orders of all ``n_gt`` GT indices (default: the listed order alone;
    `stage2.targets.reorder_orders`). The first order the model's matches follow is returned whole (misses
    where it puts them: for the listed order exactly the plain-SFT target; see docs/ALGORITHM.md); when none
    fits, the matched GT objects in the model's order, then the missed ones in the first order."""
    candidates = [list(o) for o in orders] if orders is not None else [list(range(n_gt))]
    matched = [j for _, j, _ in match.pairs]  # pairs are sorted by prediction index: the model's order
    for order in candidates:
        rank = {j: r for r, j in enumerate(order)}
        if all(rank[a] < rank[b] for a, b in zip(matched, matched[1:], strict=False)):
            return order
    seen = set(matched)
    return matched + [j for j in candidates[0] if j not in seen]
