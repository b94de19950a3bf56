"""Prefix coordinate targets and Y_train construction (spec/STAGE2.md §8.3, §9, §10, §12.2, §12.3).

``build_y_train`` turns one sample's parse + match into the teacher-forcing target
``Y_train_ids = prefix_token_ids + encode(append_text)``, plus everything the labels need:

- TP pairs = matched pairs whose §9 targets were built; a failed pair is "excluded from supervision"
  and its GT joins the FN list (§8.3);
- ``prefix_coord_pos`` (assistant-local token indices of the TP predictions' coord slots, ascending)
  with ``prefix_coord_target_bins``;
- ``tail_ignore_pos`` (tail-relative indices of tokens overlapping a desc value, §12.2);
- ``prefix_ce_pos`` (assistant-local indices, only with ``prefix_structure_ce``, §12.3);
- per-sample counters named like the ``rollout/`` metrics of §19 (without the prefix).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from learner.stage2.coords import CoordVocab
from learner.stage2.detok import token_pieces
from learner.stage2.format import serialize_entry
from learner.stage2.gt import GTObject
from learner.stage2.match import Geom, MatchResult
from learner.stage2.ot import barycentric_batch

if TYPE_CHECKING:
    from learner.stage2.parse import ParseResult

__all__ = [
    "TargetsConfig",
    "YTrain",
    "build_y_train",
    "find_desc_value_spans",
    "matching_rates",
    "prefix_coord_targets",
    "prefix_coord_targets_batch",
    "serialize_append",
]


class TargetsConfig(BaseModel):
    """``stage2.targets.*`` knobs (§9)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    ot_cost: Literal["l1", "l2"] = "l2"
    """Point distance of the OT cost."""
    ot_epsilon: float = Field(default=10.0, gt=0.0)
    """Entropic regularization in norm1000 units (10 ≈ hard nearest assignment)."""
    ot_iters: int = Field(default=30, ge=1)
    """Sinkhorn iterations."""


# --------------------------------------------------------------------------------------------------
# §9 prefix coordinate targets


def _pts(geom: Geom) -> np.ndarray:
    geom_type, bins = geom
    v = np.asarray(bins, dtype=np.float64)
    if geom_type == "bbox_2d":
        x1, y1, x2, y2 = v
        return np.array([[x1, y1], [x2, y1], [x2, y2], [x1, y2]])
    return v.reshape(-1, 2)


def _to_bins(values: np.ndarray) -> list[int]:
    # np.rint rounds half to even, as §9 requires.
    return [int(k) for k in np.clip(np.rint(values), 0, 999)]


def prefix_coord_targets_batch(
    pairs: Sequence[tuple[Geom, Geom]], cfg: TargetsConfig
) -> list[list[int] | None]:
    """§9 targets for many ``(pred_geom, gt_geom)`` pairs; one Sinkhorn batch for all OT pairs.

    Returns:
        Per pair, one target bin per coord slot of the prediction (bbox: 4; poly: its flat length),
        or None on failure (bad geometry, non-finite value, wrong length).
    """
    out: list[list[int] | None] = [None] * len(pairs)
    ot_idx: list[int] = []
    ot_p: list[np.ndarray] = []
    ot_g: list[np.ndarray] = []
    for k, (pred, gt) in enumerate(pairs):
        try:
            if pred[0] == "bbox_2d" and gt[0] == "bbox_2d":
                tgt = np.asarray(gt[1], dtype=np.float64)
                out[k] = _to_bins(tgt) if tgt.shape == (4,) and np.all(np.isfinite(tgt)) else None
                continue
            p, g = _pts(pred), _pts(gt)
        except (ValueError, TypeError):
            continue  # malformed geometry → excluded from supervision
        if len(p) and len(g) and np.all(np.isfinite(p)) and np.all(np.isfinite(g)):
            ot_idx.append(k)
            ot_p.append(p)
            ot_g.append(g)
    if ot_idx:
        proj = barycentric_batch(ot_p, ot_g, cost=cfg.ot_cost, epsilon=cfg.ot_epsilon, iters=cfg.ot_iters)
        for k, g_hat in zip(ot_idx, proj, strict=True):
            if g_hat is None:
                continue
            if pairs[k][0][0] == "bbox_2d":
                lo, hi = g_hat.min(axis=0), g_hat.max(axis=0)
                out[k] = _to_bins(np.array([lo[0], lo[1], hi[0], hi[1]]))
            else:
                out[k] = _to_bins(g_hat.reshape(-1))
    for k, (pred, _) in enumerate(pairs):
        if out[k] is not None and len(out[k]) != len(pred[1]):
            out[k] = None
    return out


def prefix_coord_targets(pred_geom: Geom, gt_geom: Geom, cfg: TargetsConfig) -> list[int] | None:
    """§9 targets for one matched pair: GT bins for bbox↔bbox, else Sinkhorn barycentric projection.

    Args:
        pred_geom: prediction ``(geom_type, bins)``.
        gt_geom: GT ``(geom_type, bins)``.
        cfg: OT knobs.

    Returns:
        One bin (0..999) per coord slot of the prediction, or None when target building fails.
    """
    return prefix_coord_targets_batch([(pred_geom, gt_geom)], cfg)[0]


# --------------------------------------------------------------------------------------------------
# §10 append fragment, §12.2 desc spans


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


_DESC_OPEN = re.compile(r'"desc"\s*:\s*"')


def find_desc_value_spans(text: str) -> list[tuple[int, int]]:
    """Char spans ``[start, end)`` of desc value contents, quotes excluded (§12.2).

    Every match of ``"desc"\\s*:\\s*"`` opens a value running to the next unescaped ``"`` (or to the
    end of the text when unterminated). Scanning resumes after the value, so text inside a value is
    never taken for a key.
    """
    spans: list[tuple[int, int]] = []
    pos = 0
    n = len(text)
    while True:
        m = _DESC_OPEN.search(text, pos)
        if m is None:
            return spans
        i = m.end()
        while i < n and text[i] != '"':
            i += 2 if text[i] == "\\" else 1
        end = min(i, n)
        spans.append((m.end(), end))
        pos = end + 1


def _char_spans(pieces: Sequence[str]) -> list[tuple[int, int]]:
    """Per-token char range for overlap tests; an empty piece occupies ``[start, start + 1)`` (§6.1)."""
    out = []
    pos = 0
    for p in pieces:
        out.append((pos, pos + max(len(p), 1)))
        pos += len(p)
    return out


def _mask_of(spans: Iterable[tuple[int, int]], n: int) -> np.ndarray:
    m = np.zeros(n + 1, dtype=bool)  # +1: empty pieces at the very end
    for s, e in spans:
        m[s:e] = True
    return m


def _tokens_overlapping(tok_spans: Sequence[tuple[int, int]], mask: np.ndarray) -> list[int]:
    cs = np.concatenate([[0], np.cumsum(mask)])
    hi = len(mask)
    return [k for k, (s, e) in enumerate(tok_spans) if cs[min(e, hi)] - cs[min(s, hi)] > 0]


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

    @property
    def train_len(self) -> int:
        """``len(ids)``."""
        return len(self.ids)


def _prefix_ce_positions(parse: ParseResult, tp_preds: Sequence[int], coord_vocab: CoordVocab) -> list[int]:
    """Prefix token indices eligible for CE under ``prefix_structure_ce`` (§12.3)."""
    text = parse.prefix_text
    n = len(text)
    eligible = np.zeros(n + 1, dtype=bool)
    first = text.find("{")
    if first >= 0:
        eligible[first] = True
    objs = parse.valid_objects
    key_starts = sorted(k.start for k in parse.object_keys)
    tp_set = set(tp_preds)
    for i in sorted(tp_set):
        o = objs[i]
        eligible[o.key_start_char : o.value_span[1]] = True
    # Separators between two TP entries with no other top-level key in between.
    for i in sorted(tp_set):
        end = objs[i].value_span[1]
        nxt = next((s for s in key_starts if s >= end), None)
        if nxt is None:
            continue
        j = next((k for k in tp_set if objs[k].key_start_char == nxt), None)
        if j is not None:
            eligible[end:nxt] = True
    eligible[n] = False
    desc = _mask_of(find_desc_value_spans(text), n)
    ids = list(parse.prefix_token_ids)
    spans = _char_spans(parse.prefix_pieces.pieces)
    cs_ok = np.concatenate([[0], np.cumsum(eligible)])
    cs_desc = np.concatenate([[0], np.cumsum(desc)])
    hi = n + 1
    out = []
    for k, (s, e) in enumerate(spans):
        s, e = min(s, hi), min(e, hi)
        if coord_vocab.is_coord(ids[k]) or e <= s:
            continue
        if cs_ok[e] - cs_ok[s] == e - s and cs_desc[e] == cs_desc[s]:
            out.append(k)
    return out


def _pieces(ids: Sequence[int], tokenizer: Any) -> list[str]:
    return token_pieces(ids, tokenizer).pieces


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

    Raises:
        ValueError: the appended coord ids disagree with the serialized coordinates (tokenizer
            misconfigured), or the prefix violates parser invariant 6.9.
    """
    preds = parse.valid_objects
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
        coord_pos.extend(int(s) for s in slots)
        coord_bins.extend(tgt)
    tp_gt = {j for _, j, _ in tp}
    fn = [j for j in range(len(gts)) if j not in tp_gt]
    start = parse.max_object_index_in_prefix + 1
    append_text = serialize_append([gts[j] for j in fn], start, parse.prefix_text)
    append_ids = [int(t) for t in tokenizer.encode(append_text, add_special_tokens=False)]
    want = [b for j in fn for b in gts[j].bins]
    got = [coord_vocab.bin_of(t) for t in append_ids if coord_vocab.is_coord(t)]
    if got != want:
        raise ValueError(
            f"appended ids hold coord bins {got[:8]}... ({len(got)}) but {len(want)} coordinates were "
            "serialized; every '<|coord_k|>' must encode to its single coord id (check the tokenizer's "
            "added tokens)"
        )
    if fn_desc_ce:
        tail_ignore: list[int] = []
    else:
        pieces = _pieces(append_ids, tokenizer)
        joined = "".join(pieces)
        tail_ignore = _tokens_overlapping(
            _char_spans(pieces), _mask_of(find_desc_value_spans(joined), len(joined))
        )
    tp_preds = [i for i, _, _ in tp]
    prefix_ce = _prefix_ce_positions(parse, tp_preds, coord_vocab) if prefix_structure_ce else []
    prefix_ids = [int(t) for t in parse.prefix_token_ids]
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
    )


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
