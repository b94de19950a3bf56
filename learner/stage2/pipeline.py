"""Per-sample stage-2 pipeline: rollout result → parse → GT → match → Y_train → teacher-forced segment.
Also the stage-1 segment of a sample (`stage1_segment`: plain SFT of its whole GT answer).

Pure glue over `parse`, `gt`, `match`, `targets` and `labels` (docs/ALGORITHM.md §6–§12). It never raises on
a bad rollout or a malformed GT object (§0.3): the sample falls back or is dropped and the counters say
why. Counter names are those of `learner.metrics.ROLLOUT_COUNTS`; length observations use the
`learner.metrics.DISTRIBUTIONS` names.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from learner.data.errors import DataRecordError
from learner.data.messages import rollout_messages
from learner.data.prompt_encoding import EncodedPrompt, PromptEncoder
from learner.stage2.coords import CoordVocab
from learner.stage2.gt import GtExtraction, GTObject, extract_gt
from learner.stage2.matching.breakdown import (
    DetectionBreakdown,
    detection_breakdown,
    detection_counts,
    detection_rates,
)
from learner.stage2.matching.match import MatchingConfig, MatchResult, match
from learner.stage2.parse.parser import ParseResult, parse_rollout
from learner.stage2.targets.false_positives import penalized_predictions
from learner.stage2.targets.labels import build_answer_segment, encode_segment
from learner.stage2.targets.order import measure_order, reorder_ground_truth
from learner.stage2.targets.segment import Segment
from learner.stage2.targets.y_train import TargetsConfig, answer_ids, build_y_train, prune_unmatched
from shared_schemas.images import ImageRefError
from shared_schemas.infer import InferResult

__all__ = [
    "RolloutEval",
    "SampleContext",
    "SampleOutcome",
    "eval_metrics",
    "MatchedRollout",
    "evaluate_rollout",
    "followed_order",
    "parse_and_match",
    "prepare_segment",
    "score_rollout",
    "stage1_segment",
]

logger = logging.getLogger(__name__)

# YTrain counters → learner.metrics names; the length counters become distributions instead.
_RENAMED = {
    "sample_valid_pred": "samples_with_valid_pred",
    "sample_any_match": "samples_with_match",
    "append_len": "append_tokens",
}
_LENGTHS = ("prefix_len", "train_len")


@dataclass(frozen=True)
class SampleContext:
    """What every sample of a run shares: tokenizer, prompt encoder, coord ids, prompts, stage-2 knobs."""

    tokenizer: Any
    encoder: PromptEncoder
    coord_vocab: CoordVocab
    system_prompt: str
    stop_markers: tuple[str, ...]
    matching: MatchingConfig
    targets: TargetsConfig
    malformed_policy: str
    fn_desc_ce: bool
    prefix_structure_ce: bool
    packing_length: int
    on_prompt_mismatch: str
    oversize_policy: str
    eot_id: int
    newline_id: int
    fp_unlikelihood_tokens: str | None = None
    """Which tokens of false positives the unlikelihood loss penalizes (`stage2.loss.fp_unlikelihood_tokens`),
    None when it is off (`fp_unlikelihood_weight` 0): nothing is recorded then."""
    fp_unlikelihood_objects: str = "all"
    """Which false positives it penalizes (`stage2.loss.fp_unlikelihood_objects`): all, or the duplicates."""

    def rollout_messages(self, sample: Mapping[str, Any]) -> list[dict[str, Any]]:
        """A sample's §3.3 rollout messages (what the backend receives and teacher forcing re-encodes)."""
        return rollout_messages(sample["messages"], self.system_prompt)

    def encode_prompt(self, sample: Mapping[str, Any]) -> EncodedPrompt:
        """The teacher-forced prompt of a sample (§11.1): its rollout messages through the one encoder
        (text or images), cached for the rollout-buffer window."""
        try:
            return self.encoder.encode(self.rollout_messages(sample), index=int(sample.get("base_idx", 0)))
        except ImageRefError as exc:
            raise DataRecordError(
                None,
                None,
                f"row {sample.get('base_idx')} (0-based) of data set {sample.get('dataset')!r} (the"
                f" JSONL file's stem): {exc.why}; fix or remove that record"
                " (python -m learner.data.convert decodes every image of a data set: docs/DATA.md)",
            ) from exc

    def prompt_ids(self, sample: Mapping[str, Any]) -> list[int]:
        """Teacher-forced prompt ids (images expanded as the engine expands them)."""
        return list(self.encode_prompt(sample).ids)


@dataclass(frozen=True)
class SampleOutcome:
    """Everything one sample contributes to a step: its segment (or None) and its metric values."""

    segment: Segment | None
    counters: dict[str, float]
    lengths: dict[str, float]


MatchedRollout = tuple[ParseResult, GtExtraction, MatchResult, dict[str, float]]
"""A sample's parsed rollout, its GT, their match and the parse counters (:func:`parse_and_match`)."""


def parse_and_match(sample: Mapping[str, Any], result: InferResult, ctx: SampleContext) -> MatchedRollout:
    """Parses a sample's rollout (the first choice) and matches it to the sample's GT (§6, §8)."""
    choice = result.choices[0]
    parse = parse_rollout(choice.token_ids, ctx.tokenizer, ctx.coord_vocab, ctx.stop_markers)
    gts = extract_gt(sample["gt_objects"], int(sample["sample_id"]), ctx.malformed_policy)  # type: ignore[arg-type]
    preds = [(o.geom_type, o.bins) for o in parse.valid_objects]
    result_match = match(preds, [(g.geom_type, g.bins) for g in gts.objects], ctx.matching)
    counters = {
        "samples": 1.0,
        "parse_obj_total": float(parse.obj_total),
        "parse_dropped_invalid": float(parse.dropped_invalid),
        "parse_truncated": float(parse.truncated),
        "parse_fallback": float(parse.fallback),
        "parse_cut_fallback": float(parse.cut_fallback),
        "finish_length": float(choice.finish_reason == "length"),
        "repeat_terminated": float(choice.finish_reason == "repeat_terminate"),
        "gt_malformed": float(gts.n_malformed),
    }
    return parse, gts, result_match, counters


def rollout_counts(parse: ParseResult, result_match: Any, n_gt: int) -> dict[str, float]:
    """The matching counters of the GENERATED rollout (`drop`/`reorder` rewrite the teacher-forced answer;
    `rollout/*` must still say what the model produced)."""
    preds = float(len(parse.valid_objects))
    matched = float(len(result_match.pairs))
    return {
        "valid_pred_objects": preds,
        "matched": matched,
        "matched_for_supervision": matched,
        "fp": preds - matched,
        "fn": float(n_gt) - matched,
        "gating_rejections": float(result_match.gating_rejections),
        "candidate_pairs": float(result_match.candidate_pairs),
        "matched_maskiou_sum": float(result_match.iou_sum),
        "matched_maskiou_count": float(result_match.iou_count),
        "sample_valid_pred": float(preds > 0),
        "sample_any_match": float(matched > 0),
    }


def followed_order(matched: Sequence[MatchedRollout], ctx: SampleContext) -> str | None:
    """The candidate order (`stage2.targets.reorder_orders`) a step's rollouts follow, pooled over its
    samples as `learner.evaluate.order` measures a model (:func:`measure_order`), or None: `reorder` off,
    fewer than two matches in every sample, or no candidate at `REORDER_AGREEMENT`."""
    if ctx.targets.unmatched_prefix != "reorder":
        return None
    emissions = [([j for _, j, _ in m.pairs], gts.objects) for _, gts, m, _ in matched]
    return measure_order(emissions, ctx.targets.reorder_orders).follows


def prepare_segment(
    sample: Mapping[str, Any],
    result: InferResult,
    ctx: SampleContext,
    *,
    rollout_step: int,
    matched: MatchedRollout | None = None,
    followed: str | None = None,
) -> tuple[Segment | None, SampleOutcome]:
    """Builds one sample's teacher-forced segment from its rollout result.

    Args:
        matched: the sample's :func:`parse_and_match` when the caller already has it (None: made here).
        followed: `reorder`: the order the step's rollouts follow (:func:`followed_order`); the sample is
            then taught its GT in that order (`learner.stage2.targets.order`).

    Returns:
        `(segment or None, outcome)`; None when the sample was dropped (prompt mismatch, oversize with
        the drop policy), with the reason counted.

    Raises:
        SegmentTooLongError: oversize with `stage2.encode.oversize_policy: raise` (a configuration problem).
    """
    parse, gts, result_match, counters = matched or parse_and_match(sample, result, ctx)
    counters = dict(counters)
    generated = rollout_counts(parse, result_match, len(gts.objects))
    rewritten = False
    gt_objects = gts.objects
    if ctx.targets.unmatched_prefix == "drop":
        pruned = prune_unmatched(parse, result_match, ctx.tokenizer, ctx.coord_vocab, ctx.targets.opening)
        if pruned is not None:  # teacher-force the matched objects only; the counters stay the rollout's
            pruned_ids, result_match = pruned
            parse = parse_rollout(pruned_ids, ctx.tokenizer, ctx.coord_vocab, ctx.stop_markers)
            rewritten = True
    elif ctx.targets.unmatched_prefix == "reorder" and result.choices[0].token_ids:
        # The ground truth in the model's order, as a plain-GT target (an empty rollout's Y_train).
        gt_objects = reorder_ground_truth(result_match, gts.objects, ctx.targets.reorder_orders, followed)
        counters["reorder_moved"] = float(
            any(a is not b for a, b in zip(gt_objects, gts.objects, strict=True))
        )
        parse = parse_rollout([], ctx.tokenizer, ctx.coord_vocab, ctx.stop_markers)
        result_match = match([], [(g.geom_type, g.bins) for g in gt_objects], ctx.matching)
        rewritten = True
    y_train = build_y_train(
        parse,
        gt_objects,
        result_match,
        ctx.tokenizer,
        ctx.coord_vocab,
        ctx.targets,
        fn_desc_ce=ctx.fn_desc_ce,
        prefix_structure_ce=ctx.prefix_structure_ce,
        fp_unlikelihood_tokens=ctx.fp_unlikelihood_tokens,  # type: ignore[arg-type]
        fp_preds=_penalized_fps(ctx, parse, gt_objects, result_match),
    )
    lengths = {
        "rollout/prompt_len": float(len(result.prompt_token_ids)),
        "rollout/rollout_len": float(len(result.choices[0].token_ids)),
        "rollout/gen_new_tokens": float(len(result.choices[0].token_ids)),
    }
    if rewritten:  # the rollout/ metrics describe what the model generated, not the rewritten answer
        y_train.counters.update(generated)
    for key, value in y_train.counters.items():
        if key in _LENGTHS:
            lengths[f"rollout/{key}"] = value
        else:
            counters[_RENAMED.get(key, key)] = counters.get(_RENAMED.get(key, key), 0.0) + value
    lengths["rollout/append_len"] = y_train.counters.get("append_len", 0.0)
    prompt = ctx.encode_prompt(sample)
    segment, drop = encode_segment(
        prompt.ids,
        result.prompt_token_ids,
        y_train,
        ctx.eot_id,
        ctx.newline_id,
        ctx.coord_vocab,
        sample_id=int(sample["sample_id"]),
        base_idx=int(sample["base_idx"]),
        rollout_step=rollout_step,
        packing_length=ctx.packing_length,
        on_prompt_mismatch=ctx.on_prompt_mismatch,  # type: ignore[arg-type]
        oversize_policy=ctx.oversize_policy,  # type: ignore[arg-type]
        mm_inputs=prompt.mm_inputs,
        rope_positions=prompt.rope_positions,
    )
    for key, value in drop.items():
        counters[key] = counters.get(key, 0.0) + value
    if segment is not None:
        lengths["rollout/encoded_len"] = float(segment.encoded_len)
    return segment, SampleOutcome(segment, counters, lengths)


def _penalized_fps(
    ctx: SampleContext, parse: ParseResult, gts: Sequence[GTObject], result_match: MatchResult
) -> tuple[int, ...] | None:
    """The false positives the unlikelihood loss penalizes (`stage2.loss.fp_unlikelihood_objects`); None
    for every one (`build_y_train` takes `match.fp`: no geometry is rebuilt per sample) or the loss off."""
    if ctx.fp_unlikelihood_tokens is None or ctx.fp_unlikelihood_objects == "all":
        return None
    return penalized_predictions(
        ctx.fp_unlikelihood_objects,  # type: ignore[arg-type]
        [(o.geom_type, o.bins) for o in parse.valid_objects],
        [(g.geom_type, g.bins) for g in gts],
        result_match,
        ctx.matching.maskiou_gate,
    )


def stage1_segment(sample: Mapping[str, Any], ctx: SampleContext) -> Segment:
    """A sample's stage-1 segment: its teacher-forced prompt (`ctx.encode_prompt`), its GT answer in the
    plain-GT token path (`answer_ids` with `ctx.targets.opening`) and the turn suffix, every answer token and
    the end of turn supervised by CE (`build_answer_segment`).

    The ids are those `prepare_segment` teacher-forces for an empty rollout (stage-1 warm-up), so a stage-1
    checkpoint opens answers the way rollout-matching continues them; the labels are plain SFT's (there the
    opening ``{`` is rollout prefix and coordinates are coord slots).

    Raises:
        learner.stage2.gt.MalformedGTError: a malformed GT object under `stage2.gt.malformed_policy: raise`
            (`skip` leaves it out of the answer).
        DataRecordError: an unreadable image.
    """
    sample_id = int(sample["sample_id"])
    objects = extract_gt(sample["gt_objects"], sample_id, ctx.malformed_policy).objects  # type: ignore[arg-type]
    return build_answer_segment(
        ctx.encode_prompt(sample),
        answer_ids(objects, ctx.tokenizer, ctx.coord_vocab, ctx.targets.opening),
        ctx.eot_id,
        ctx.newline_id,
        sample_id=sample_id,
        base_idx=int(sample["base_idx"]),
    )


@dataclass(frozen=True)
class RolloutEval:
    """One sample's evaluation (§18): what was parsed, the ground truth, the detection breakdown and the
    summable counts (`counts` is what `score_rollout` returns; sum it over samples for `eval_metrics`).

    Attributes:
        parse: the parsed rollout (`parse.valid_objects[i]` is prediction `i` of `detection`).
        gt: the extracted ground truth (`gt.objects[j]` is GT `j` of `detection`).
        detection: gate matching, matchings at the IoU thresholds, duplicates
            (`learner.stage2.matching.breakdown`).
        counts: the sample's counts, every key summable.
    """

    parse: ParseResult
    gt: GtExtraction
    detection: DetectionBreakdown
    counts: dict[str, float]


def evaluate_rollout(sample: Mapping[str, Any], result: InferResult, ctx: SampleContext) -> RolloutEval:
    """Evaluation of one sample (§18): parse + match only, raw matched pairs, no targets; plus the detection
    breakdown (TP at maskIoU 0.5 / 0.75 / 0.95, duplicates) with the same matcher."""
    parse, gts, result_match, counters = parse_and_match(sample, result, ctx)
    preds = [(o.geom_type, o.bins) for o in parse.valid_objects]
    detection = detection_breakdown(
        preds, [(g.geom_type, g.bins) for g in gts.objects], ctx.matching, gate=result_match
    )
    counters.update(
        gt_objects=float(len(gts.objects)),
        valid_pred_objects=float(len(parse.valid_objects)),
        matched=float(len(result_match.pairs)),
        fp=float(len(result_match.fp)),
        fn=float(len(result_match.fn)),
        gating_rejections=float(result_match.gating_rejections),
        matched_maskiou_sum=float(result_match.iou_sum),
        matched_maskiou_count=float(result_match.iou_count),
        samples_with_valid_pred=float(bool(parse.valid_objects)),
        samples_with_match=float(bool(result_match.pairs)),
        **detection_counts(detection),
    )
    return RolloutEval(parse, gts, detection, counters)


def score_rollout(sample: Mapping[str, Any], result: InferResult, ctx: SampleContext) -> dict[str, float]:
    """Evaluation counts of one sample (§18): `evaluate_rollout(...).counts`."""
    return evaluate_rollout(sample, result, ctx).counts


def eval_metrics(
    sums: Mapping[str, float], *, n_samples: int, runtime_s: float, prefix: str = "eval"
) -> dict[str, float]:
    """`eval_rollout_*` keys of §18 from globally summed `score_rollout` counts.

    Besides the counts: the detection rates of `learner.stage2.matching.breakdown.detection_rates` —
    `precision`, `recall`, `f1` at the matching gate (`eval_rollout_f1`), `precision_iouXX` / `recall_iouXX`
    / `f1_iouXX` at maskIoU 0.5, 0.75, 0.95, `duplicates`, `duplicate_rate`, `pred_gt_ratio`,
    `matched_maskiou_mean`, `parse_valid_rate` — each as `<prefix>_rollout_<name>`.
    """

    def ratio(a: float, b: float) -> float:
        return a / max(b, 1.0)

    p = f"{prefix}_rollout_"
    n = float(n_samples)
    return {
        **{f"{p}{name}": value for name, value in detection_rates(sums).items()},
        f"{p}pred_objects": sums.get("valid_pred_objects", 0.0),
        f"{p}gt_objects": sums.get("gt_objects", 0.0),
        f"{p}matched": sums.get("matched", 0.0),
        f"{p}fp": sums.get("fp", 0.0),
        f"{p}fn": sums.get("fn", 0.0),
        f"{p}gating_rejections": sums.get("gating_rejections", 0.0),
        f"{p}parse_dropped_invalid": sums.get("parse_dropped_invalid", 0.0),
        f"{p}parse_truncated_rate": ratio(sums.get("parse_truncated", 0.0), n),
        f"{p}sample_valid_pred_rate": ratio(sums.get("samples_with_valid_pred", 0.0), n),
        f"{p}sample_any_match_rate": ratio(sums.get("samples_with_match", 0.0), n),
        f"{p}gt_malformed": sums.get("gt_malformed", 0.0),
        f"{p}repeat_terminated": sums.get("repeat_terminated", 0.0),
        f"{prefix}_runtime": runtime_s,
        f"{prefix}_samples_per_second": n / runtime_s if runtime_s > 0 else 0.0,
        f"{prefix}_steps_per_second": 1.0 / runtime_s if runtime_s > 0 else 0.0,
    }
