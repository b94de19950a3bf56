"""The order `unmatched_prefix: reorder` teacher-forces the ground truth in.

Where a step's rollouts follow one of the candidate orders (`stage2.targets.reorder_orders`, pooled over the
step's samples exactly as `learner.evaluate.order` measures a model: :func:`measure_order`), every sample of
the step is taught that order whole: the model's habit IS that order, so a swap in one sample is an error to
correct, not an order to keep. On annotations listed in the order the model follows, `reorder`'s targets are
then the listed annotations, i.e. plain SFT's, whatever the rollouts' occasional swaps and misses. Where the
rollouts follow no candidate, each sample keeps the model's own order for its matches, the misses placed by
the order its matches agree with best (:func:`model_order`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from learner.stage2.gt import GTObject, anchor_order
from learner.stage2.matching.match import MatchResult

__all__ = [
    "ORDER_NAMES",
    "REORDER_AGREEMENT",
    "OrderMeasurement",
    "measure_order",
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
    match: MatchResult,
    objects: Sequence[GTObject],
    order_names: Sequence[str],
    followed: str | None = None,
) -> list[GTObject]:
    """``objects`` (the listed GT) in the order `reorder` teacher-forces them.

    Args:
        match: the sample's rollout matched to ``objects``.
        objects: the GT objects as listed.
        order_names: the candidate orders (:func:`candidate_order` names, `stage2.targets.reorder_orders`).
        followed: the candidate the step's rollouts follow (:func:`measure_order`'s ``follows``), or None:
            given, the result is ``objects`` in that order whatever this sample's matches are; None, the
            :func:`model_order` of the matches.
    """
    if followed is not None:
        return [objects[j] for j in candidate_order(followed, objects)]
    orders = [candidate_order(name, objects) for name in order_names]
    return [objects[j] for j in model_order(match, len(objects), orders)]


REORDER_AGREEMENT = 0.75
"""Fraction of the pairs of the model's matches that an order must put the way the model did (Kendall
concordance) for the misses to be placed by it. A model with an order habit (a sorted-trained detector that
swaps two neighbours of a crowded row) agrees 0.9-1.0 with its order; matches in an order unrelated to the
candidate agree 0.5 on average, and their misses go after them as before."""


MIN_ORDER_PAIRS = 30
"""Pairs of matched predictions a MODEL's order measurement (`learner.evaluate`) needs before it names an
order the model follows. Fewer are too few to tell a habit from luck: 2 pairs agree with any order by chance
one time in four, 30 pairs at 0.75 one time in ~400 (pairs as independent coin flips). The step-wise
measurement of `reorder` asks for no minimum: a wrong call there moves only the samples it measured."""


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


@dataclass(frozen=True)
class OrderMeasurement:
    """How well each candidate order describes the order a model emits its objects in.

    Attributes:
        agreement: per candidate name, the fraction of scored pairs it ranks as the model emitted them (0.5 on
            average for an order unrelated to the model's; Kendall's tau is ``2 * agreement - 1``); None
            when no pair was scored.
        pairs: pairs of matched predictions scored (a sample of ``m`` matches gives ``m * (m - 1) / 2``).
        samples: samples that gave at least one pair (two matches or more).
        best: the candidate of the highest agreement; ties go to the first in the candidates' order (as
            `stage2.targets.reorder_orders` breaks them); None when no pair was scored.
        tied: every candidate with the best agreement (more than one: the data cannot tell them apart, e.g.
            ``listed`` and ``sorted`` on annotations listed in sorted order).
        follows: ``best`` when its agreement reaches ``threshold`` over ``min_pairs`` pairs or more, else
            None (the model follows none, or too few pairs were scored to say).
        threshold: the agreement ``follows`` asks for.
        min_pairs: the pairs ``follows`` asks for.
    """

    agreement: dict[str, float | None]
    pairs: int
    samples: int
    best: str | None
    tied: tuple[str, ...]
    follows: str | None
    threshold: float
    min_pairs: int = 0

    def to_json(self) -> dict[str, Any]:
        """The ``object_order`` entry of `metrics.json` (and of `bench/ab_learning.py`'s `ab.jsonl`)."""
        return {
            "agreement": dict(self.agreement),
            "pairs": self.pairs,
            "samples": self.samples,
            "best": self.best,
            "tied": list(self.tied),
            "follows": self.follows,
            "threshold": self.threshold,
            "min_pairs": self.min_pairs,
        }


def measure_order(
    emissions: Iterable[tuple[Sequence[int], Sequence[GTObject]]],
    names: Sequence[str] = ORDER_NAMES,
    *,
    threshold: float = REORDER_AGREEMENT,
    min_pairs: int = 0,
) -> OrderMeasurement:
    """The order a model follows, from its matched predictions.

    Args:
        emissions: per sample, the GT indices its predictions matched, in the order the model emitted them
            (:func:`emitted_order`), and the sample's GT objects as listed.
        names: the candidate orders (:func:`learner.stage2.targets.order.candidate_order` names).
        threshold: the agreement a candidate needs for ``follows`` (default: the one `unmatched_prefix:
            reorder` asks of a sample's matches, :data:`~learner.stage2.targets.order.REORDER_AGREEMENT`).
        min_pairs: the scored pairs ``follows`` needs (a model's measurement: :data:`MIN_ORDER_PAIRS`).

    Returns:
        Every candidate's pooled agreement, the best one and whether the model follows it.

    Raises:
        ValueError: ``names`` is empty, names an order twice or names an unknown order; a sample's matched
            indices repeat a GT object or fall outside its GT list.
    """
    if not names or len(set(names)) != len(names):
        raise ValueError(f"candidate orders {list(names)} must be non-empty and distinct")
    concordant = dict.fromkeys(names, 0)
    pairs = samples = 0
    for emitted, objects in emissions:
        if len(set(emitted)) != len(emitted) or any(not 0 <= j < len(objects) for j in emitted):
            raise ValueError(
                f"matched GT indices {list(emitted)} must be distinct and in 0..{len(objects) - 1}"
            )
        n = len(emitted) * (len(emitted) - 1) // 2
        if n == 0:
            continue
        pairs, samples = pairs + n, samples + 1
        for name in names:
            concordant[name] += concordant_pairs(emitted, candidate_order(name, objects))
    if pairs == 0:
        return OrderMeasurement(dict.fromkeys(names), 0, 0, None, (), None, threshold, min_pairs)
    top = max(concordant.values())
    tied = tuple(name for name in names if concordant[name] == top)
    agreement: dict[str, float | None] = {name: concordant[name] / pairs for name in names}
    best = tied[0]
    follows = best if top / pairs >= threshold and pairs >= min_pairs else None
    return OrderMeasurement(agreement, pairs, samples, best, tied, follows, threshold, min_pairs)
