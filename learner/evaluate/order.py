"""Which object order a detector emits its answers in, measured on its own rollouts: every order the code
knows by name (`learner.stage2.targets.order.ORDER_NAMES`: ``listed``, ``sorted``) is scored by the pairs of
matched predictions it ranks the way the model emitted them (Kendall concordance, pooled over samples).

`python -m learner.evaluate` writes it to `metrics.json` (``object_order``), so a user learns the order their
base follows before choosing `data.object_ordering` or `stage2.targets.reorder_orders`;
`bench/ab_learning.py`'s ``sft-canonical`` arm trains plain SFT on the annotations in the order measured here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from learner.predictions.records import SamplePrediction
from learner.stage2.gt import GTObject
from learner.stage2.targets.order import ORDER_NAMES, REORDER_AGREEMENT, candidate_order, concordant_pairs

__all__ = ["OrderMeasurement", "emitted_order", "measure_order", "prediction_order"]


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
        follows: ``best`` when its agreement reaches ``threshold``, else None (the model follows none).
        threshold: the agreement ``follows`` asks for.
    """

    agreement: dict[str, float | None]
    pairs: int
    samples: int
    best: str | None
    tied: tuple[str, ...]
    follows: str | None
    threshold: float

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
        }


def measure_order(
    emissions: Iterable[tuple[Sequence[int], Sequence[GTObject]]],
    names: Sequence[str] = ORDER_NAMES,
    *,
    threshold: float = REORDER_AGREEMENT,
) -> OrderMeasurement:
    """The order a model follows, from its matched predictions.

    Args:
        emissions: per sample, the GT indices its predictions matched, in the order the model emitted them
            (:func:`emitted_order`), and the sample's GT objects as listed.
        names: the candidate orders (:func:`learner.stage2.targets.order.candidate_order` names).
        threshold: the agreement a candidate needs for ``follows`` (default: the one `unmatched_prefix:
            reorder` asks of a sample's matches, :data:`~learner.stage2.targets.order.REORDER_AGREEMENT`).

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
        return OrderMeasurement(dict.fromkeys(names), 0, 0, None, (), None, threshold)
    top = max(concordant.values())
    tied = tuple(name for name in names if concordant[name] == top)
    agreement: dict[str, float | None] = {name: concordant[name] / pairs for name in names}
    best = tied[0]
    follows = best if top / pairs >= threshold else None
    return OrderMeasurement(agreement, pairs, samples, best, tied, follows, threshold)


def emitted_order(prediction: SamplePrediction) -> list[int]:
    """GT indices of ``prediction``'s matched objects, in the order the model emitted them."""
    return [p.gt for p in prediction.preds if p.gt is not None]


def prediction_order(
    predictions: Iterable[SamplePrediction],
    names: Sequence[str] = ORDER_NAMES,
    *,
    threshold: float = REORDER_AGREEMENT,
) -> OrderMeasurement:
    """:func:`measure_order` of evaluated samples (the predictions of `learner.evaluate.runner`)."""

    def gt_objects(p: SamplePrediction) -> list[GTObject]:
        return [GTObject(j + 1, g.desc, g.geom_type, g.bins) for j, g in enumerate(p.gts)]  # type: ignore[arg-type]

    return measure_order(((emitted_order(p), gt_objects(p)) for p in predictions), names, threshold=threshold)
