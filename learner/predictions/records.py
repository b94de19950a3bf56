"""One evaluated sample as users read it: its parsed objects with a score, its ground truth, and the matches
between them (a line of `predictions.jsonl`; what the gallery draws and COCO exports).

Object score: the mean log-probability (natural log, per token) of the tokens that spell the object, from the
token holding its key's opening quote to the token holding its value's closing brace. It ranks one model's
objects for COCO AP; it is not a calibrated detector score (a long polygon and a short box are not on one
scale, and a confident wrong answer scores high). It is None when the rollout carries no log-probabilities.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from learner.stage2.matching.breakdown import prf
from learner.stage2.parse.parser import ParsedObject, ParseResult
from learner.stage2.pipeline import RolloutEval
from shared_schemas.infer import InferResult

__all__ = ["GtObject", "PredObject", "SamplePrediction", "object_score", "sample_prediction"]


@dataclass(frozen=True)
class PredObject:
    """One valid predicted object.

    Attributes:
        desc: its description as generated.
        geom_type: `bbox_2d` or `poly`; bins: its flat norm1000 coordinates.
        score: mean token log-probability (module docstring), None without log-probabilities.
        gt: index of the GT object it is matched to at the gate, else None.
        iou: maskIoU with that GT (0.0 when unmatched).
        best_gt / best_iou: its best-IoU GT object (-1 / 0.0 when none overlaps).
        duplicate: counted as a duplicate (`learner.stage2.matching.breakdown`).
    """

    desc: str
    geom_type: str
    bins: tuple[int, ...]
    score: float | None
    gt: int | None
    iou: float
    best_gt: int
    best_iou: float
    duplicate: bool


@dataclass(frozen=True)
class GtObject:
    """One well-formed GT object; `pred` is the prediction matched to it at the gate (None: a miss)."""

    desc: str
    geom_type: str
    bins: tuple[int, ...]
    pred: int | None


@dataclass(frozen=True)
class SamplePrediction:
    """One evaluated sample.

    Attributes:
        index: position in the evaluated sample list (0-based).
        sample_id, dataset, base_idx: the sample's identity (docs/ALGORITHM.md#records §1.5).
        image: its first image reference (None for text-only records).
        width, height: the record's image size in pixels.
        preds, gts: predictions and ground truth with their matches.
        counts: the sample's summable counts (`RolloutEval.counts`).
        finish_reason: why generation stopped; text: the generated text.
    """

    index: int
    sample_id: int
    dataset: str
    base_idx: int
    image: str | None
    width: int
    height: int
    preds: tuple[PredObject, ...]
    gts: tuple[GtObject, ...]
    counts: dict[str, float]
    finish_reason: str
    text: str

    @property
    def f1(self) -> float:
        """The sample's F1 at the matching gate (0 when it has neither predictions nor GT objects)."""
        c = self.counts
        return prf(c.get("matched", 0.0), c.get("valid_pred_objects", 0.0), c.get("gt_objects", 0.0))[2]

    def to_json(self) -> dict[str, Any]:
        """The `predictions.jsonl` line: every field, `f1` included."""
        return {**asdict(self), "f1": self.f1}


def object_score(parse: ParseResult, obj: ParsedObject, logprobs: Sequence[float] | None) -> float | None:
    """Mean log-probability of the tokens spelling `obj` (module docstring); None without log-probs."""
    if not logprobs:
        return None
    start = obj.key_start_char
    end = obj.value_end if obj.value_end is not None else len(parse.text)
    pieces = parse.pieces
    picked = [
        logprobs[i]
        for i in range(min(len(pieces), len(logprobs)))
        if pieces.span(i)[0] < end and pieces.span(i)[1] > start
    ]
    return sum(picked) / len(picked) if picked else None


def sample_prediction(
    index: int, sample: Mapping[str, Any], result: InferResult, evaluation: RolloutEval
) -> SamplePrediction:
    """The user-facing record of one evaluated sample (`PlannedStep.evaluate`'s `on_sample` arguments)."""
    choice = result.choices[0]
    det = evaluation.detection
    pred_to_gt = {p: (g, iou) for p, g, iou in det.gate.pairs}
    gt_to_pred = {g: p for p, g, _ in det.gate.pairs}
    dups = set(det.duplicates)
    preds = tuple(
        PredObject(
            desc=o.desc or "",
            geom_type=str(o.geom_type),
            bins=tuple(o.bins),
            score=object_score(evaluation.parse, o, choice.logprobs),
            gt=pred_to_gt[i][0] if i in pred_to_gt else None,
            iou=pred_to_gt[i][1] if i in pred_to_gt else 0.0,
            best_gt=det.best_gt[i][0],
            best_iou=det.best_gt[i][1],
            duplicate=i in dups,
        )
        for i, o in enumerate(evaluation.parse.valid_objects)
    )
    gts = tuple(
        GtObject(desc=g.desc, geom_type=g.geom_type, bins=tuple(g.bins), pred=gt_to_pred.get(j))
        for j, g in enumerate(evaluation.gt.objects)
    )
    images = sample.get("images") or []
    return SamplePrediction(
        index=index,
        sample_id=int(sample["sample_id"]),
        dataset=str(sample.get("dataset", "")),
        base_idx=int(sample.get("base_idx", index)),
        image=str(images[0]) if images else None,
        width=int(sample["width"]),
        height=int(sample["height"]),
        preds=preds,
        gts=gts,
        counts=dict(evaluation.counts),
        finish_reason=str(choice.finish_reason),
        text=choice.text,
    )
