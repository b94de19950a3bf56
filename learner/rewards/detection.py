"""Detection rewards of GRPO (issue 23 item 4): a completion scored against its record's ground-truth objects
with the stage-2 machinery of rollout-matching SFT.

One :class:`DetectionSample` per completion: the token-aligned strict parser
(:func:`learner.stage2.parse.parser.parse_rollout`, on the sampled token ids, or on ``encode(text)`` when only
the text is known), the GT extraction of §7 (:func:`learner.stage2.gt.extract_gt`: malformed GT objects are
left out) and the Hungarian matching of §8 with the maskIoU gate (:func:`learner.stage2.matching.match.match`,
``stage2.matching``). Predictions are the parser's VALID objects, as in the held-out ``eval_rollout_f1``;
``desc`` plays no part in matching (§8). The rewards are pure ``(DetectionSample) -> float``:

- ``detection.f1``: ``2·matched / (pred + gt)``, the F1 at the matching gate;
- ``detection.maskiou``: mean maskIoU of the matched pairs (0 without a match);
- ``detection.format``: 1 iff the completion (after the stop marker) is exactly one closed JSON object whose
  every key is an ``object_N`` entry that passes the §6.7 checks (``{}`` included), with nothing but
  whitespace before the ``{`` and after the top-level ``}``;
- ``detection.precision`` / ``detection.recall``: ``matched / pred`` and ``matched / gt`` (logged; weighted by
  the ``detection_dedup`` preset);
- ``detection.no_duplicates``: ``1 − duplicates / pred``, a duplicate being an unmatched prediction whose
  best-IoU GT object is matched to another one (``learner.stage2.matching.breakdown``, the evaluator's count);
  1.0 without predictions;
- ``detection.count``: ``1 − min(1, |pred − gt| / gt)``, how close the number of predictions is to the number
  of objects (weighted by the ``detection_count`` preset);
- ``detection.f1_iou50``: the F1 of a one-to-one matching at maskIoU 0.5 (the evaluator's ``f1_iou50``):
  a box counts only if it is tight (weighted by the ``detection_iou50`` preset in place of ``detection.f1``).

Why the last three can be weighted: with the ``detection`` preset, sampled completions that list more objects
match more of them, so GRPO doubled the duplicates on the image demo (29 → 61 on 256 held-out images,
pred ÷ GT 1.01 → 1.19; bench/RESULTS.md), as VLM-R1 saw with an mAP reward. ``detection_dedup`` stopped
that, but its precision term also pays for leaving out an object the policy is unsure of (pred ÷ GT fell to
0.73 on the image demo, recall −0.07); ``detection_count`` prices the count from both sides instead, so that
only duplicates and misplaced boxes are pushed out, not real objects. With the count right, what GRPO still
lost to plain SFT on the demo images was box tightness (F1 at maskIoU 0.5 0.15–0.17 against 0.20): a match at
the gate (maskIoU 0.3) earns the full F1 term, so ``detection_iou50`` scores F1 at 0.5 instead.

Every ratio with a zero denominator (no prediction and no GT object) is the format value: an image with
nothing to find is answered perfectly by a well-formed ``{}`` and by nothing else. Rows of another task (no
``task_mode: detection``) score 0.0 everywhere, as the summary rewards do on non-summary rows.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from learner.stage2.coords import CoordVocab
from learner.stage2.gt import extract_gt
from learner.stage2.matching.breakdown import IOU_THRESHOLDS, detection_breakdown
from learner.stage2.matching.match import MatchingConfig, match
from learner.stage2.parse.detok import encode_text
from learner.stage2.parse.parser import DEFAULT_STOP_MARKERS, ParseResult, parse_rollout

__all__ = [
    "DETECTION_TASK",
    "DetectionSample",
    "DetectionScorer",
    "count_reward",
    "detection_samples",
    "f1_iou50_reward",
    "f1_reward",
    "format_reward",
    "is_detection_row",
    "maskiou_reward",
    "no_duplicates_reward",
    "precision_reward",
    "recall_reward",
    "well_formed",
]

IOU50 = IOU_THRESHOLDS[0]
"""The maskIoU of ``detection.f1_iou50``'s matching: the evaluator's ``*_iou50`` threshold (0.5)."""

DETECTION_TASK = "detection"
"""``task_mode`` of a detection reward row (``learner.grpo.data`` sets it for stage-2 records)."""


@dataclass(frozen=True)
class DetectionSample:
    """One completion parsed and matched against its row's GT.

    Attributes:
        is_detection: the row is a detection row (else every detection reward is 0.0).
        n_pred: valid predicted objects.
        n_gt: well-formed GT objects.
        matched: matched pairs (maskIoU ≥ ``stage2.matching.maskiou_gate``).
        iou_sum: sum of the matched pairs' maskIoU.
        well_formed: the ``detection.format`` condition (module docstring).
        duplicates: unmatched predictions whose best-IoU GT object is matched to another prediction.
        matched_iou50: pairs of a one-to-one matching at maskIoU 0.5 (the evaluator's ``matched_iou50``).
    """

    is_detection: bool
    n_pred: int = 0
    n_gt: int = 0
    matched: int = 0
    iou_sum: float = 0.0
    well_formed: bool = False
    duplicates: int = 0
    matched_iou50: int = 0

    def rate(self, numerator: float, denominator: float) -> float:
        """``numerator / denominator``; with a zero denominator the format value (nothing to find, nothing
        predicted: right iff well-formed). Non-detection rows: 0.0."""
        if not self.is_detection:
            return 0.0
        if denominator > 0:
            return numerator / denominator
        return 1.0 if self.well_formed and self.n_pred == 0 and self.n_gt == 0 else 0.0


def well_formed(parse: ParseResult) -> bool:
    """The ``detection.format`` condition on a parse (module docstring)."""
    if parse.fallback or not parse.top_closed or parse.dropped_invalid:
        return False
    if len(parse.object_keys) != len(parse.all_objects):  # a key that is not an object_N entry with an object
        return False
    try:
        value = json.loads(parse.text)  # surrounding whitespace only, nothing after the top-level close
    except (ValueError, RecursionError):
        return False
    return isinstance(value, dict)


@dataclass(frozen=True)
class DetectionScorer:
    """Turns completions into :class:`DetectionSample` s with the policy's tokenizer and the stage-2 knobs.

    Attributes:
        tokenizer: the policy tokenizer (the server's: completion ids are in its vocabulary).
        coord_vocab: its coordinate ids.
        matching: ``stage2.matching`` (the maskIoU gate sets what counts as matched).
        stop_markers: ``stage2.parse.stop_markers``.
    """

    tokenizer: Any = field(repr=False)
    coord_vocab: CoordVocab = field(repr=False)
    matching: MatchingConfig = field(default_factory=MatchingConfig)
    stop_markers: tuple[str, ...] = DEFAULT_STOP_MARKERS

    @classmethod
    def from_tokenizer(
        cls,
        tokenizer: Any,
        *,
        matching: MatchingConfig | None = None,
        stop_markers: Sequence[str] = DEFAULT_STOP_MARKERS,
    ) -> DetectionScorer:
        """A scorer for ``tokenizer``.

        Raises:
            CoordVocabError: the tokenizer lacks the 1000 coordinate tokens.
        """
        return cls(
            tokenizer=tokenizer,
            coord_vocab=CoordVocab.from_tokenizer(tokenizer),
            matching=matching or MatchingConfig(),
            stop_markers=tuple(stop_markers),
        )

    def sample(
        self, row: Mapping[str, Any], text: str, token_ids: Sequence[int] | None = None
    ) -> DetectionSample:
        """Parses and matches one completion against ``row["objects"]`` (``task_mode: detection`` rows).

        Args:
            row: the prompt's reward row (``task_mode``, ``objects``, optional ``sample_id`` for log lines).
            text: the decoded completion; read only when ``token_ids`` is None (then the tokenizer
                encodes it).
            token_ids: the sampled ids (may end with the end-of-turn id): what the parser is defined on.
        """
        if not is_detection_row(row):
            return DetectionSample(is_detection=False)
        ids = list(token_ids) if token_ids is not None else encode_text(self.tokenizer, text)
        parse = parse_rollout(ids, self.tokenizer, self.coord_vocab, self.stop_markers)
        gts = extract_gt(row.get("objects") or [], int(row.get("sample_id", 0)))
        preds = [(o.geom_type, o.bins) for o in parse.valid_objects]
        gt_geoms = [(g.geom_type, g.bins) for g in gts.objects]
        result = match(preds, gt_geoms, self.matching)
        breakdown = detection_breakdown(preds, gt_geoms, self.matching, gate=result, thresholds=(IOU50,))
        return DetectionSample(
            is_detection=True,
            n_pred=len(preds),
            n_gt=len(gts.objects),
            matched=len(result.pairs),
            iou_sum=result.iou_sum,
            well_formed=well_formed(parse),
            duplicates=len(breakdown.duplicates),
            matched_iou50=len(breakdown.at[IOU50].pairs),
        )


def is_detection_row(row: Mapping[str, Any]) -> bool:
    """Whether a reward row is a detection row (``task_mode: detection``)."""
    return row.get("task_mode") == DETECTION_TASK


def detection_samples(
    texts: Sequence[str],
    rows: Sequence[Mapping[str, Any]],
    token_ids: Sequence[Sequence[int] | None],
    scorer: DetectionScorer | None,
) -> list[DetectionSample]:
    """One :class:`DetectionSample` per completion; rows of other tasks need no scorer (they score 0.0).

    Raises:
        ValueError: a detection row and no ``scorer``.
    """
    out = []
    for text, row, ids in zip(texts, rows, token_ids, strict=True):
        if not is_detection_row(row):
            out.append(DetectionSample(is_detection=False))
        elif scorer is None:
            raise ValueError(
                "detection rewards on a detection row need the policy tokenizer: pass "
                "detection=DetectionScorer.from_tokenizer(tokenizer)"
            )
        else:
            out.append(scorer.sample(row, text, ids))
    return out


def f1_reward(sample: DetectionSample) -> float:
    """``detection.f1``: ``2·matched / (pred + gt)``."""
    return sample.rate(2 * sample.matched, sample.n_pred + sample.n_gt)


def f1_iou50_reward(sample: DetectionSample) -> float:
    """``detection.f1_iou50``: ``2·matched_iou50 / (pred + gt)``, the F1 of tight boxes only."""
    return sample.rate(2 * sample.matched_iou50, sample.n_pred + sample.n_gt)


def maskiou_reward(sample: DetectionSample) -> float:
    """``detection.maskiou``: mean maskIoU of the matched pairs; 0.0 when nothing matched."""
    return sample.rate(sample.iou_sum, sample.matched)


def format_reward(sample: DetectionSample) -> float:
    """``detection.format``: 1.0 iff the completion is one closed, fully valid answer (module docstring)."""
    return float(sample.is_detection and sample.well_formed)


def precision_reward(sample: DetectionSample) -> float:
    """``detection.precision``: ``matched / pred`` (logged by the preset, weight 0)."""
    return sample.rate(sample.matched, sample.n_pred)


def recall_reward(sample: DetectionSample) -> float:
    """``detection.recall``: ``matched / gt`` (logged by the preset, weight 0)."""
    return sample.rate(sample.matched, sample.n_gt)


def no_duplicates_reward(sample: DetectionSample) -> float:
    """``detection.no_duplicates``: ``1 − duplicates / pred``; 1.0 without predictions (F1 and recall price
    an empty answer). Non-detection rows: 0.0."""
    if not sample.is_detection:
        return 0.0
    return 1.0 - sample.duplicates / sample.n_pred if sample.n_pred else 1.0


def count_reward(sample: DetectionSample) -> float:
    """``detection.count``: ``1 − min(1, |pred − gt| / gt)``; 1.0 at the right count, 0.0 at none predicted or
    twice too many. No GT object: the format value (a well-formed ``{}``). Non-detection rows: 0.0."""
    if not sample.is_detection:
        return 0.0
    if sample.n_gt == 0:
        return sample.rate(0, 0)
    return 1.0 - min(1.0, abs(sample.n_pred - sample.n_gt) / sample.n_gt)
