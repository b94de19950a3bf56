"""Y_train (docs/ALGORITHM.md#y-train; §8.3, §10, §12.2, §12.3; §9's coordinate targets: `prefix_coords`).

``build_y_train`` turns one sample's parse + match into the teacher-forcing target
``Y_train_ids = prefix_token_ids + encode(append_text)``, plus everything the labels need:

- TP pairs = matched pairs whose §9 targets were built; a failed pair is "excluded from supervision"
  and its GT joins the FN list (§8.3);
- ``prefix_coord_pos`` (assistant-local token indices of the TP predictions' coord slots, ascending)
  with ``prefix_coord_target_bins``;
- ``tail_ignore_pos`` (tail-relative indices of tokens overlapping a desc value, §12.2);
- ``prefix_ce_pos`` (assistant-local indices, only with ``prefix_structure_ce``, §12.3);
- ``prefix_fp_pos`` (assistant-local indices of FP tokens penalized by unlikelihood, only with
  ``fp_unlikelihood_weight`` > 0, §12.5);
- per-sample counters named like the ``rollout/`` metrics of §19 (without the prefix).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Literal

from pydantic import Field, field_validator

from learner.stage2.coords import CoordVocab
from learner.stage2.format import serialize_entry, serialize_objects
from learner.stage2.gt import GTObject
from learner.stage2.matching.match import MatchResult
from learner.stage2.parse.detok import token_pieces
from learner.stage2.parse.encode_cache import encode_segmented
from learner.stage2.targets.false_positives import FpTokens, fp_penalized_positions
from learner.stage2.targets.prefix_coords import prefix_coord_targets_batch
from learner.stage2.targets.spans import desc_overlapping_tokens, find_desc_value_spans, prefix_ce_positions
from shared_schemas.config import ConfigSection

if TYPE_CHECKING:
    from learner.stage2.parse.parser import ParseResult

__all__ = [
    "TargetsConfig",
    "YTrain",
    "build_y_train",
    "find_desc_value_spans",
    "matching_rates",
    "answer_ids",
    "prune_unmatched",
    "serialize_append",
]


class TargetsConfig(ConfigSection):
    """``stage2.targets.*`` knobs (§9)."""

    ot_cost: Literal["l1", "l2"] = "l2"
    """Point distance of the OT cost."""
    ot_epsilon: float = Field(default=10.0, gt=0.0)
    """Entropic regularization in norm1000 units (10 ≈ hard nearest assignment)."""
    ot_iters: int = Field(default=30, ge=1)
    """Sinkhorn iterations."""
    canonical_seam: bool = True
    """On by default (beyond the spec: a rollout equal to its GT is then teacher-forced on the very tokens
    plain SFT trains, and the end of turn follows the token the model itself emits). Off (the spec, §10
    "Token seam"): `Y_train = prefix_ids + encode(append_text)`, where the cut may have split a merged token
    (`]}}` → re-encoded `]}`) and the appended `}` becomes a separate token, a path stage-1 never produced,
    whose end-of-turn the model then mispredicts (`loss/ce_eos` 4.4 against ~0 on plain GT). On: the tokens
    the cut re-encoded are encoded TOGETHER with the appended text (`Y_train = kept rollout ids +
    encode(re-encoded text + append_text)`): every token the cut left alone stays, the seam is canonical (with
    nothing to append it gives back the rollout's own tokens), and the re-encoded tokens count as tail.
    Measured: docs/ALGORITHM.md §10."""
    opening: Literal["split", "merged"] = "split"
    """Token path of plain-GT answers (empty rollout, `drop`, `reorder`): `split`, `{` alone then `"object_1…`
    (what vlm_pretrain.py and sft warm-up train); `merged`, the text in one piece (`{"` one token), what a
    stage-1 that tokenized whole answers opens with. Use the checkpoint's: the other path moves it through
    answers that parse to nothing (docs/RUNBOOK.md "Rollout-matching collapses to empty answers")."""
    unmatched_prefix: Literal["keep", "drop", "reorder"] = "keep"
    """What the teacher-forced answer keeps of the rollout.

    `keep` (the spec, §8.3): the rollout prefix as generated; false-positive and invalid objects stay in it,
    unsupervised. The only stop a sample supervises comes AFTER every object the model emitted plus the
    appended FNs, so an over-predicting model is taught to stop late, predicts more, and so on.

    `drop`: the matched objects only, in the model's order with its own descs and coordinates (renumbered
    `object_1..K`, in the plain-GT token path; coordinate targets as §9), then the FNs and the close: the stop
    is supervised after as many objects as the GT holds. A rollout that opens with `{` and has no FP or
    invalid object is used as is.

    `reorder`: the ground truth in the model's order — the GT objects the model matched, in the order it
    emitted them, the missed ones placed by the order the matches follow (`reorder_orders`), every token
    supervised as in plain SFT. Only the ORDER comes from the rollout: plain SFT of a set in arbitrary
    order must learn an order it cannot predict; here the model keeps its own. Matches in the GT's order,
    misses or not, give plain SFT's `Y_train`, labels and loss (`learner.stage2.targets.order`).

    `rollout/` metrics describe the generated rollout in every mode. Measured: bench/RESULTS.md."""
    reorder_orders: list[Literal["listed", "sorted"]] = Field(
        default_factory=lambda: ["listed"], min_length=1
    )
    """`reorder`: the orders that place the missed GT objects among the model's matches (the one they agree
    with best; a followed order comes back whole; `learner.stage2.targets.order`). `listed`: as the record
    lists the GT; `sorted`: by `(y, x)` anchor — for a stage-1 trained on sorted answers and fine-tuned on GT
    listed otherwise, whose rollouts keep the sorted order."""

    @field_validator("reorder_orders")
    @classmethod
    def _distinct_orders(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError(f"stage2.targets.reorder_orders {value} names an order twice")
        return value


# --------------------------------------------------------------------------------------------------
# §10 append fragment


def serialize_append(fn_objects: Sequence[GTObject], start_index: int, prefix_text: str) -> str:
    """The appended fragment of §10: FN entries numbered from ``start_index``, then ``}``.

    Args:
        fn_objects: FN objects in GT order.
        start_index: number of the first appended key (``max_object_index_in_prefix + 1``).
        prefix_text: decoded prefix; its last non-whitespace char decides the leading separator.

    Raises:
        ValueError: the prefix does not end with ``{``, ``,`` or ``}`` (parser invariant 6.9), or ends
            with ``,`` while there is nothing to append.
    """
    stripped = prefix_text.rstrip()
    last = stripped[-1] if stripped else ""
    if last not in ("{", ",", "}"):
        raise ValueError(
            f"prefix text must end with '{{', ',' or '}}' (parser invariant 6.9), ends with {last!r}"
        )
    if not fn_objects:
        if last == ",":
            raise ValueError("prefix text ends with ',' but there is no FN object to append")
        return "}"
    lead = ", " if last == "}" else ""
    entries = [
        serialize_entry(start_index + j, o.desc, o.geom_type, o.bins) for j, o in enumerate(fn_objects)
    ]
    return lead + ", ".join(entries) + "}"


# --------------------------------------------------------------------------------------------------
# §10 Y_train, §12.2–12.3 masks


@dataclass(frozen=True)
class YTrain:
    """One sample's teacher-forcing target and masks (§10, §12).

    Attributes:
        ids: ``prefix_token_ids + append_ids``.
        prefix_len: number of rollout prefix tokens.
        append_text: the serialized fragment of §10.
        append_ids: its fresh encoding.
        prefix_coord_pos: assistant-local indices of TP coord slots, ascending.
        prefix_coord_target_bins: §9 target bin per slot.
        tail_ignore_pos: tail-relative indices of tokens overlapping a desc value (empty with
            ``fn_desc_ce``).
        prefix_ce_pos: assistant-local indices of prefix tokens with CE (empty unless
            ``prefix_structure_ce``).
        tp: ``(pred_i, gt_j, mask_iou)`` pairs matched for supervision (indices into
            ``parse.valid_objects`` / ``gts``).
        excluded: matched pairs whose targets failed (their GT is FN).
        fp: prediction indices without supervision (unmatched or excluded), ascending.
        fn: GT indices appended, in GT order.
        counters: per-sample counts named like the §19 ``rollout/`` metrics (no prefix).
        prefix_fp_pos: assistant-local indices of the FP tokens penalized by unlikelihood (§12.5), ascending;
            empty unless asked for.
    """

    ids: tuple[int, ...]
    prefix_len: int
    append_text: str
    append_ids: tuple[int, ...]
    prefix_coord_pos: tuple[int, ...]
    prefix_coord_target_bins: tuple[int, ...]
    tail_ignore_pos: tuple[int, ...]
    prefix_ce_pos: tuple[int, ...]
    tp: tuple[tuple[int, int, float], ...]
    excluded: tuple[tuple[int, int, float], ...]
    fp: tuple[int, ...]
    fn: tuple[int, ...]
    counters: dict[str, float] = field(default_factory=dict)
    prefix_fp_pos: tuple[int, ...] = ()

    @property
    def train_len(self) -> int:
        """``len(ids)``."""
        return len(self.ids)


def build_y_train(
    parse: ParseResult,
    gts: Sequence[GTObject],
    match: MatchResult,
    tokenizer: Any,
    coord_vocab: CoordVocab,
    cfg: TargetsConfig,
    *,
    fn_desc_ce: bool = False,
    prefix_structure_ce: bool = False,
    fp_unlikelihood_tokens: FpTokens | None = None,
    fp_preds: Sequence[int] | None = None,
) -> YTrain:
    """Build Y_train and its masks for one sample (§8.3, §9, §10, §12.2, §12.3).

    Args:
        parse: the sample's :class:`ParseResult`.
        gts: well-formed GT objects in GT order (the list given to :func:`match`).
        match: result of matching ``parse.valid_objects`` to ``gts``.
        tokenizer: encodes the append text (``encode(text, add_special_tokens=False)``).
        coord_vocab: coord-token lookup.
        cfg: §9 OT knobs.
        fn_desc_ce: ``stage2.loss.fn_desc_ce`` (tail desc values get CE).
        prefix_structure_ce: ``stage2.loss.prefix_structure_ce``.
        fp_unlikelihood_tokens: which tokens of the unmatched predictions to record for the unlikelihood
            loss (``stage2.loss.fp_unlikelihood_tokens``); None records none (the loss is off).
        fp_preds: the unmatched predictions (indices into ``parse.valid_objects``) to penalize; None: every
            one (``match.fp``; ``stage2.loss.fp_unlikelihood_objects: all``).

    Raises:
        ValueError: the appended coord ids disagree with the serialized coordinates (tokenizer
            misconfigured), or the prefix violates parser invariant 6.9.
    """
    preds = parse.valid_objects
    tp, excluded, coord_pos, coord_bins = _supervised_pairs(preds, gts, match, cfg)
    tp_gt = {j for _, j, _ in tp}
    fn = [j for j in range(len(gts)) if j not in tp_gt]
    append_text = serialize_append(
        [gts[j] for j in fn], parse.max_object_index_in_prefix + 1, parse.prefix_text
    )
    prefix_ids = list(parse.prefix_token_ids)
    seam = _cut_edited_from(parse) if cfg.canonical_seam else len(prefix_ids)
    if cfg.opening == "merged" and parse.prefix_text.strip() == "{":  # nothing kept: the answer in one piece
        seam = 0
    if coord_pos and coord_pos[-1] >= seam:  # never: a cut falls after an object, not inside a coord token
        seam = len(prefix_ids)
    seam_text = "".join(parse.prefix_pieces.pieces[seam:]) if seam < len(prefix_ids) else ""
    append_ids = _encode_tail(
        seam_text + append_text, [b for j in fn for b in gts[j].bins], tokenizer, coord_vocab
    )
    prefix_ids = prefix_ids[:seam]
    if fn_desc_ce:
        tail_ignore: list[int] = []
    else:
        tail_ignore = desc_overlapping_tokens(token_pieces(append_ids, tokenizer).pieces)
    tp_preds = [i for i, _, _ in tp]
    prefix_ce = prefix_ce_positions(parse, tp_preds, coord_vocab) if prefix_structure_ce else []
    prefix_ce = [p for p in prefix_ce if p < seam]  # the seam's tokens are tail now (supervised there)
    penalized = match.fp if fp_preds is None else fp_preds
    fp_pos = (
        fp_penalized_positions(parse, penalized, fp_unlikelihood_tokens, seam)
        if fp_unlikelihood_tokens is not None
        else []
    )
    max_valid = max((o.index for o in preds), default=0)
    counters = {
        "gt_objects": float(len(gts)),
        "valid_pred_objects": float(len(preds)),
        "matched": float(len(match.pairs)),
        "matched_for_supervision": float(len(tp)),
        "excluded_from_supervision": float(len(excluded)),
        "fp": float(len(preds) - len(tp)),
        "fn": float(len(fn)),
        "fn_appended": float(len(fn)),
        "gating_rejections": float(match.gating_rejections),
        "candidate_pairs": float(match.candidate_pairs),
        "matched_maskiou_sum": float(match.iou_sum),
        "matched_maskiou_count": float(match.iou_count),
        "prefix_coord_targets_total": float(len(coord_pos)),
        "fn_start_bumped": float(bool(fn) and parse.max_object_index_in_prefix > max_valid),
        "sample_valid_pred": float(len(preds) > 0),
        "sample_any_match": float(len(tp) > 0),
        "prefix_len": float(len(prefix_ids)),
        "append_len": float(len(append_ids)),
        "train_len": float(len(prefix_ids) + len(append_ids)),
        "tail_ignored_tokens": float(len(tail_ignore)),
    }
    return YTrain(
        ids=tuple(prefix_ids + append_ids),
        prefix_len=len(prefix_ids),
        append_text=append_text,
        append_ids=tuple(append_ids),
        prefix_coord_pos=tuple(coord_pos),
        prefix_coord_target_bins=tuple(coord_bins),
        tail_ignore_pos=tuple(tail_ignore),
        prefix_ce_pos=tuple(prefix_ce),
        tp=tuple(tp),
        excluded=tuple(excluded),
        fp=tuple(sorted(set(range(len(preds))) - set(tp_preds))),
        fn=tuple(fn),
        counters=counters,
        prefix_fp_pos=tuple(fp_pos),
    )


def _supervised_pairs(
    preds: Sequence[Any], gts: Sequence[GTObject], match: MatchResult, cfg: TargetsConfig
) -> tuple[list[tuple[int, int, float]], list[tuple[int, int, float]], list[int], list[int]]:
    """Split matched pairs into TP (targets built) and excluded (§8.3); TP coord slots and targets.

    Slots come out ascending because ``match.pairs`` is sorted by prediction (appearance order).
    """
    pairs = [
        ((preds[i].geom_type, preds[i].bins), (gts[j].geom_type, gts[j].bins)) for i, j, _ in match.pairs
    ]
    targets = prefix_coord_targets_batch(pairs, cfg)
    tp: list[tuple[int, int, float]] = []
    excluded: list[tuple[int, int, float]] = []
    coord_pos: list[int] = []
    coord_bins: list[int] = []
    for (i, j, iou), tgt in zip(match.pairs, targets, strict=True):
        slots = preds[i].coord_token_indices
        if tgt is None or len(tgt) != len(slots):
            excluded.append((i, j, iou))
            continue
        tp.append((i, j, iou))
        coord_pos.extend(map(int, slots))
        coord_bins.extend(tgt)
    return tp, excluded, coord_pos, coord_bins


def _cut_edited_from(parse: ParseResult) -> int:
    """Index of the first prefix token the cut re-encoded (`len(prefix)` when the cut kept every token)."""
    prefix, rollout = parse.prefix_token_ids, parse.response_token_ids
    n = 0
    limit = min(len(prefix), len(rollout))
    while n < limit and prefix[n] == rollout[n]:
        n += 1
    return n if not parse.fallback else len(prefix)


def _encode_tail(
    append_text: str, want_bins: list[int], tokenizer: Any, coord_vocab: CoordVocab
) -> list[int]:
    """Fresh encoding of the appended fragment, checked coordinate by coordinate (§10)."""
    append_ids = encode_segmented(tokenizer, append_text)
    id_to_bin = coord_vocab.id_to_bin
    got = [id_to_bin[t] for t in append_ids if t in id_to_bin]
    if got != want_bins:
        raise ValueError(
            f"appended ids hold {len(got)} coord tokens (first bins {got[:8]}) but {len(want_bins)} "
            f"coordinates (first bins {want_bins[:8]}) were serialized; every '<|coord_k|>' must encode "
            "to its single coord id (check the tokenizer's added tokens)"
        )
    return append_ids


def answer_ids(
    objects: Sequence[Any], tokenizer: Any, coord_vocab: CoordVocab, opening: str = "split"
) -> list[int]:
    """A whole answer in the token path of the plain-GT targets: ``encode("{")`` (the §6.4 fallback prefix an
    empty rollout gets), then the entries and the close encoded as one appended fragment (§10); with
    ``opening="merged"`` (``stage2.targets.opening``) the whole text as one fragment. Stage-1 warm-up steps
    train exactly this path (Y_train of an empty rollout); docs/ALGORITHM.md §10 says why paths must agree."""
    text = serialize_objects(objects)  # type: ignore[arg-type]  # desc, geom_type, bins
    bins = [b for o in objects for b in o.bins]
    if opening == "merged":
        return _encode_tail(text, bins, tokenizer, coord_vocab)
    return encode_segmented(tokenizer, "{") + _encode_tail(text[1:], bins, tokenizer, coord_vocab)


def prune_unmatched(
    parse: ParseResult, match: MatchResult, tokenizer: Any, coord_vocab: CoordVocab, opening: str = "split"
) -> tuple[list[int], MatchResult] | None:
    """The rollout with its unmatched objects removed (`stage2.targets.unmatched_prefix: drop`) and `match`
    renumbered onto it, or None when there is nothing to remove (every object the model started is valid and
    matched, and the answer opens with its ``{``).

    The kept objects are the matched predictions in the model's order, with its descs and bins, renumbered
    `object_1..K` and serialized canonically (§4) inside a closed top-level object, in the token path of the
    plain-GT targets (:func:`answer_ids`): the caller parses these ids like any rollout, so the cut, the FN
    append and the coordinate targets are the spec's. Text the model wrote before the opening ``{`` is
    dropped too. Kept object `k` is prediction `pairs[k]` of `match` (pairs are sorted by prediction index),
    so the assignment is carried over rather than solved again; the gating counters stay those of the
    generated rollout.
    """
    opens_answer = parse.first_open_brace is not None and not parse.text[: parse.first_open_brace].strip()
    if len(match.pairs) == len(parse.all_objects) and not parse.fallback and opens_answer:
        return None
    kept = [parse.valid_objects[i] for i, _, _ in match.pairs]
    ids = answer_ids(kept, tokenizer, coord_vocab, opening)
    renumbered = replace(match, pairs=tuple((k, j, iou) for k, (_, j, iou) in enumerate(match.pairs)), fp=())
    return ids, renumbered


def _ratio(num: float, den: float) -> float:
    return num / den if den > 0 else 0.0


def matching_rates(counts: Mapping[str, float]) -> dict[str, float]:
    """§19 matching rates from (globally summed) :attr:`YTrain.counters`.

    Returns:
        ``precision`` (= matched_for_supervision / valid_pred_objects), ``recall`` (/ gt_objects),
        ``f1``, ``gating_rejection_rate`` (/ candidate_pairs), ``excluded_rate`` (/ matched),
        ``matched_maskiou_mean``, ``tail_ignore_frac`` (/ append_len); 0 on an empty denominator.
    """
    tp = counts.get("matched_for_supervision", 0.0)
    precision = _ratio(tp, counts.get("valid_pred_objects", 0.0))
    recall = _ratio(tp, counts.get("gt_objects", 0.0))
    return {
        "precision": precision,
        "recall": recall,
        "f1": _ratio(2 * precision * recall, precision + recall),
        "gating_rejection_rate": _ratio(
            counts.get("gating_rejections", 0.0), counts.get("candidate_pairs", 0.0)
        ),
        "excluded_rate": _ratio(counts.get("excluded_from_supervision", 0.0), counts.get("matched", 0.0)),
        "matched_maskiou_mean": _ratio(
            counts.get("matched_maskiou_sum", 0.0), counts.get("matched_maskiou_count", 0.0)
        ),
        "tail_ignore_frac": _ratio(counts.get("tail_ignored_tokens", 0.0), counts.get("append_len", 0.0)),
    }
