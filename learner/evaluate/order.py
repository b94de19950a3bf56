"""Which object order a detector emits its answers in, measured on its own rollouts: every order the code
knows by name (`learner.stage2.targets.order.ORDER_NAMES`: ``listed``, ``sorted``) is scored by the pairs of
matched predictions it ranks the way the model emitted them (Kendall concordance, pooled over samples).

`python -m learner.evaluate` writes it to `metrics.json` (``object_order``), so a user learns the order their
base follows before choosing `data.object_ordering` or `stage2.targets.reorder_orders`;
`bench/ab_learning.py`'s ``sft-canonical`` arm trains plain SFT on the annotations in the order measured here.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from learner.predictions.records import SamplePrediction
from learner.stage2.gt import GTObject
from learner.stage2.targets.order import (
    MIN_ORDER_PAIRS,
    ORDER_NAMES,
    REORDER_AGREEMENT,
    OrderMeasurement,
    measure_order,
)

__all__ = ["OrderMeasurement", "emitted_order", "measure_order", "prediction_order"]


def emitted_order(prediction: SamplePrediction) -> list[int]:
    """GT indices of ``prediction``'s matched objects, in the order the model emitted them."""
    return [p.gt for p in prediction.preds if p.gt is not None]


def prediction_order(
    predictions: Iterable[SamplePrediction],
    names: Sequence[str] = ORDER_NAMES,
    *,
    threshold: float = REORDER_AGREEMENT,
) -> OrderMeasurement:
    """:func:`measure_order` of evaluated samples (the predictions of `learner.evaluate.runner`); an order is
    only called followed over :data:`MIN_ORDER_PAIRS` pairs or more."""

    def gt_objects(p: SamplePrediction) -> list[GTObject]:
        return [GTObject(j + 1, g.desc, g.geom_type, g.bins) for j, g in enumerate(p.gts)]  # type: ignore[arg-type]

    emissions = ((emitted_order(p), gt_objects(p)) for p in predictions)
    return measure_order(emissions, names, threshold=threshold, min_pairs=MIN_ORDER_PAIRS)
