"""Teacher-forced encoding checks and label building (docs/ALGORITHM.md#teacher-forced-encoding, §12).

Positions: ``build_labels`` works on ONE segment ``prompt + Y_train + turn suffix`` with absolute
positions (0 = first prompt token). Its inputs ``prefix_coord_pos`` / ``prefix_ce_pos`` are
assistant-local (0 = first Y_train token) and ``tail_ignore_pos`` is tail-relative (0 = first appended
token), as stored in the segment meta (§14.4), so packing can rebuild labels from a packed row (§14.6).

Rules (§12.1): a coord token never gets CE; tail structure tokens get CE unless listed in
``tail_ignore_pos``; tail coord tokens are supervised with their own bin; prefix coord slots with the §9
target; the end-of-turn position ``prompt_len + train_len`` gets CE; everything else is -100. False-positive
tokens penalized by unlikelihood (§12.5, ``prefix_fp_pos``, assistant-local; :func:`fp_positions`) are prefix
coord tokens that are neither labelled nor coord slots.

Stage-1 segments (:func:`build_answer_segment`, plain SFT of the whole answer) are the one exception: every
answer token gets CE, coordinate tokens included, and there are no coord slots.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NamedTuple

from learner.stage2.coords import CoordVocab
from learner.stage2.targets.segment import Segment, SegmentMeta

if TYPE_CHECKING:
    from learner.data.prompt_encoding import EncodedPrompt
    from learner.stage2.targets.y_train import YTrain

__all__ = [
    "IGNORE_INDEX",
    "MITIGATIONS",
    "Labels",
    "PromptMismatch",
    "SegmentTooLongError",
    "build_answer_segment",
    "build_labels",
    "build_segment",
    "check_prompt_alignment",
    "check_segment_length",
    "encode_segment",
    "fp_positions",
    "segment_too_long_message",
]

logger = logging.getLogger(__name__)

IGNORE_INDEX = -100

MITIGATIONS = (
    "Mitigations: raise global_max_length (and the engine max_model_len); lower max_new_tokens; "
    "enable repeat_terminate or lower max_object_keys; filter or split images with very many objects; "
    "lower the image pixel budget."
)
"""The exact §14.2 mitigation text."""


class SegmentTooLongError(ValueError):
    """A teacher-forced segment is longer than ``packing_length`` (§11.5, §14.2); never truncated."""


def segment_too_long_message(encoded_len: int, packing_length: int, sample_id: int | str) -> str:
    """The §14.2 message: length, cap, sample id and the mitigation list."""
    return (
        f"segment of {encoded_len} tokens exceeds packing_length {packing_length} "
        f"(sample_id={sample_id}). {MITIGATIONS}"
    )


def check_segment_length(encoded_len: int, packing_length: int, sample_id: int | str) -> None:
    """Raise :class:`SegmentTooLongError` when ``encoded_len > packing_length`` (§11.5)."""
    if encoded_len > packing_length:
        raise SegmentTooLongError(segment_too_long_message(encoded_len, packing_length, sample_id))


@dataclass(frozen=True)
class PromptMismatch:
    """Teacher-forced prompt ids differ from the rollout's prompt ids (§11.3).

    Attributes:
        len_tf: length of the teacher-forced prompt.
        len_rollout: length of the rollout prompt.
        first_diff: first differing position (``min(len_tf, len_rollout)`` when one is a prefix).
    """

    len_tf: int
    len_rollout: int
    first_diff: int


def check_prompt_alignment(
    prompt_ids_tf: Sequence[int], prompt_ids_rollout: Sequence[int]
) -> PromptMismatch | None:
    """Compare prompts token for token (§11.3); None when identical."""
    a, b = list(prompt_ids_tf), list(prompt_ids_rollout)
    if a == b:
        return None
    n = min(len(a), len(b))
    first = next((i for i in range(n) if a[i] != b[i]), n)
    return PromptMismatch(len_tf=len(a), len_rollout=len(b), first_diff=first)


class Labels(NamedTuple):
    """Output of :func:`build_labels` (§12.4): the spec's 4-tuple with names.

    Attributes:
        labels: per position, -100 or the CE target id (= ``input_ids[p]``).
        coord_pos: absolute coord-supervised positions, prefix slots first (slot order), then tail.
        coord_bins: target bin per ``coord_pos`` entry.
        coord_is_prefix: True for prefix slots.

    The false-positive tokens of §12.5 are no label: :func:`fp_positions` places them.
    """

    labels: list[int]
    coord_pos: list[int]
    coord_bins: list[int]
    coord_is_prefix: list[bool]

    def segment(self, ids: Sequence[int], meta: SegmentMeta, **carried: Any) -> Segment:
        """The `Segment` of `ids` with these labels and `meta`; `carried`: its `mm_inputs`,
        `rope_positions` and `fp_pos`, if any."""
        return Segment(
            input_ids=tuple(ids),
            labels=tuple(self.labels),
            coord_pos=tuple(self.coord_pos),
            coord_bins=tuple(self.coord_bins),
            coord_is_prefix=tuple(self.coord_is_prefix),
            meta=meta,
            **carried,
        )


def _as_int_list(ids: Any) -> list[int]:
    # Tensors / arrays → Python ints; sequences are assumed to hold ints already (hot path: no per-item cast).
    return ids.tolist() if hasattr(ids, "tolist") else list(ids)


def build_labels(
    input_ids: Sequence[int],
    prompt_len: int,
    prefix_len: int,
    train_len: int,
    prefix_coord_pos: Sequence[int],
    prefix_coord_target_bins: Sequence[int],
    tail_ignore_pos: Sequence[int],
    prefix_ce_pos: Sequence[int],
    coord_vocab: CoordVocab,
) -> Labels:
    """Labels and coord supervision of one segment (§12.1, §12.4, span check §11.6).

    Args:
        input_ids: the segment's ids (list, tuple or 1-D tensor).
        prompt_len: prompt tokens (> 0).
        prefix_len: rollout-prefix tokens of Y_train.
        train_len: ``len(Y_train_ids)``; the end-of-turn token sits at ``prompt_len + train_len``.
        prefix_coord_pos: assistant-local positions of TP coord slots (each < ``prefix_len``).
        prefix_coord_target_bins: target bin per slot, 0..999.
        tail_ignore_pos: tail-relative positions without CE (desc values).
        prefix_ce_pos: assistant-local prefix positions with CE (``prefix_structure_ce``).
        coord_vocab: coord-token lookup.

    Returns:
        :class:`Labels` (unpacks as ``labels, coord_pos, coord_bins, coord_is_prefix``).

    Raises:
        ValueError: an internal invariant is violated (positions out of their region, a prefix slot
            not on a coord token, bad bin, inconsistent lengths).
    """
    ids = _as_int_list(input_ids)
    n = len(ids)
    eot_pos = prompt_len + train_len
    if not (0 < prompt_len and 0 <= prefix_len <= train_len and eot_pos < n):
        raise ValueError(
            f"build_labels: inconsistent lengths prompt_len={prompt_len} prefix_len={prefix_len} "
            f"train_len={train_len} encoded_len={n}; need 0 < prompt_len, prefix_len <= train_len and "
            "prompt_len + train_len < encoded_len"
        )
    if len(prefix_coord_pos) != len(prefix_coord_target_bins):
        raise ValueError(
            f"build_labels: {len(prefix_coord_pos)} prefix coord positions vs "
            f"{len(prefix_coord_target_bins)} target bins"
        )
    is_coord = coord_vocab.is_coord
    labels = [IGNORE_INDEX] * n
    coord_pos: list[int] = []
    coord_bins: list[int] = []
    for p, t in zip(prefix_coord_pos, prefix_coord_target_bins, strict=True):
        q = prompt_len + p
        if not (0 <= p < prefix_len) or not is_coord(ids[q]):
            raise ValueError(
                f"build_labels: prefix coord slot {p} (absolute {q}) is outside the prefix "
                f"[0, {prefix_len}) or not a coord token; the targets and the Y_train ids disagree"
            )
        if not (0 <= t <= 999):
            raise ValueError(f"build_labels: prefix target bin {t} at slot {p} outside 0..999")
        coord_pos.append(q)
        coord_bins.append(int(t))
    n_prefix = len(coord_pos)
    for p in prefix_ce_pos:
        if not (0 <= p < prefix_len):
            raise ValueError(f"build_labels: prefix CE position {p} outside the prefix [0, {prefix_len})")
        q = prompt_len + p
        if not is_coord(ids[q]):
            labels[q] = ids[q]
    tail_start = prompt_len + prefix_len
    ignore = set(tail_ignore_pos)
    if ignore and not (min(ignore) >= 0 and max(ignore) < train_len - prefix_len):
        raise ValueError(
            f"build_labels: tail_ignore_pos outside the tail [0, {train_len - prefix_len}): "
            f"min {min(ignore)}, max {max(ignore)}"
        )
    for q in range(tail_start, eot_pos):
        tid = ids[q]
        if is_coord(tid):
            coord_pos.append(q)
            coord_bins.append(coord_vocab.bin_of(tid))
        elif q - tail_start not in ignore:
            labels[q] = tid
    labels[eot_pos] = ids[eot_pos]
    return Labels(labels, coord_pos, coord_bins, [True] * n_prefix + [False] * (len(coord_pos) - n_prefix))


def fp_positions(
    input_ids: Sequence[int],
    prompt_len: int,
    prefix_len: int,
    prefix_fp_pos: Sequence[int],
    labels: Labels,
    coord_vocab: CoordVocab,
) -> tuple[int, ...]:
    """Absolute positions of one segment's false-positive tokens penalized by unlikelihood (§12.5).

    Like ``prefix_coord_pos``, ``prefix_fp_pos`` is assistant-local in the segment meta, so a packed row
    places them again at the segment's offset (§14.6).

    Args:
        input_ids: the segment's ids.
        prompt_len: prompt tokens.
        prefix_len: rollout-prefix tokens of Y_train.
        prefix_fp_pos: assistant-local positions (``YTrain.prefix_fp_pos``).
        labels: the segment's :func:`build_labels` (no FP token may be labelled or a coord slot).
        coord_vocab: coord-token lookup.

    Raises:
        ValueError: a position outside the prefix, not on a coord token, or supervised already.
    """
    ids = _as_int_list(input_ids)
    slots = set(labels.coord_pos)
    out = tuple(prompt_len + p for p in prefix_fp_pos)
    for p, q in zip(prefix_fp_pos, out, strict=True):
        if (
            not (0 <= p < prefix_len)
            or not coord_vocab.is_coord(ids[q])
            or q in slots
            or labels.labels[q] != IGNORE_INDEX
        ):
            raise ValueError(
                f"false-positive position {p} (absolute {q}) is outside the prefix [0, {prefix_len}), not a"
                " coord token, or supervised already; the FP tokens and the Y_train ids disagree"
            )
    return out


def _check_spans(lab: Labels, prompt_len: int, train_len: int) -> None:
    """§11.6: every supervised position lies in ``[prompt_len, prompt_len + train_len]``."""
    sup = [p for p, v in enumerate(lab.labels) if v != IGNORE_INDEX] + lab.coord_pos
    if sup and (min(sup) < prompt_len or max(sup) > prompt_len + train_len):
        raise ValueError(
            f"supervised positions span [{min(sup)}, {max(sup)}] outside "
            f"[{prompt_len}, {prompt_len + train_len}] (prompt_len={prompt_len}, train_len={train_len})"
        )


def build_segment(
    prompt_ids: Sequence[int],
    y_train: YTrain,
    eot_id: int,
    newline_id: int,
    coord_vocab: CoordVocab,
    *,
    sample_id: int,
    base_idx: int,
    rollout_step: int,
    mm_inputs: dict[str, Any] | None = None,
    rope_positions: tuple[tuple[int, ...], ...] | None = None,
) -> Segment:
    """Teacher-forced segment ``prompt + Y_train + [eot, newline]`` with labels (§11.2, §11.4, §12).

    Args:
        prompt_ids: the (already alignment-checked) prompt ids.
        y_train: output of :func:`learner.stage2.targets.y_train.build_y_train`.
        eot_id: end-of-turn id (``<|im_end|>``).
        newline_id: id of the ``"\\n"`` the template places after it.
        coord_vocab: coord-token lookup.
        sample_id: §1.5 sample id.
        base_idx: dataset row index.
        rollout_step: global step of the policy that produced the rollout.
        mm_inputs: multimodal prompt tensors, carried untouched.
        rope_positions: the prompt's 3-row M-RoPE positions (Qwen-VL), carried untouched.

    Raises:
        ValueError: violated §11.4 assertion or label invariant (internal error).
    """
    prompt = _as_int_list(prompt_ids)
    ids = prompt + list(y_train.ids) + [int(eot_id), int(newline_id)]
    prompt_len, train_len = len(prompt), len(y_train.ids)
    if prompt_len <= 0 or ids[prompt_len + train_len] != eot_id or len(ids) <= prompt_len + train_len:
        raise ValueError(f"sample {sample_id}: §11.4 assertion failed (prompt_len={prompt_len})")
    lab = build_labels(
        ids,
        prompt_len,
        y_train.prefix_len,
        train_len,
        y_train.prefix_coord_pos,
        y_train.prefix_coord_target_bins,
        y_train.tail_ignore_pos,
        y_train.prefix_ce_pos,
        coord_vocab,
    )
    _check_spans(lab, prompt_len, train_len)
    fp_pos = fp_positions(ids, prompt_len, y_train.prefix_len, y_train.prefix_fp_pos, lab, coord_vocab)
    meta = SegmentMeta(
        sample_id=int(sample_id),
        base_idx=int(base_idx),
        encoded_len=len(ids),
        prompt_len=prompt_len,
        prompt_ids=tuple(prompt),
        prefix_len=y_train.prefix_len,
        train_len=train_len,
        prefix_coord_pos=tuple(y_train.prefix_coord_pos),
        prefix_coord_target_bins=tuple(y_train.prefix_coord_target_bins),
        tail_ignore_pos=tuple(y_train.tail_ignore_pos),
        prefix_ce_pos=tuple(y_train.prefix_ce_pos),
        rollout_step=int(rollout_step),
        prefix_fp_pos=tuple(y_train.prefix_fp_pos),
        counters=dict(y_train.counters),
    )
    return lab.segment(
        ids, meta, mm_inputs=dict(mm_inputs or {}), rope_positions=rope_positions, fp_pos=fp_pos
    )


def build_answer_segment(
    prompt: EncodedPrompt,
    answer_ids: Sequence[int],
    eot_id: int,
    newline_id: int,
    *,
    sample_id: int,
    base_idx: int,
) -> Segment:
    """Stage-1 segment ``prompt + answer + [eot, newline]``: plain next-token SFT of a whole answer.

    Every answer token and the end of turn get CE, coordinate tokens included (a stage-1 checkpoint learns
    them as ordinary tokens; §12.1's coord slots are a rollout-matching target), so a loss over this segment
    is the mean token cross-entropy over ``answer + [eot]``. The newline after the end of turn is context
    only, as in :func:`build_segment`. The meta reads as an empty rollout prefix: ``prefix_len`` 0,
    ``train_len = len(answer_ids)``, no coord slots, ``rollout_step`` 0.

    Args:
        prompt: the encoded prompt (ids with images expanded; its vision tensors and M-RoPE positions are
            carried untouched).
        answer_ids: the answer's ids without the end of turn (e.g.
            :func:`learner.stage2.targets.y_train.answer_ids`).
        eot_id: end-of-turn id (``<|im_end|>``).
        newline_id: id of the ``"\\n"`` the template places after it.
        sample_id: §1.5 sample id.
        base_idx: dataset row index.

    Raises:
        ValueError: an empty prompt or answer.
    """
    prompt_ids, answer = list(prompt.ids), _as_int_list(answer_ids)
    if not prompt_ids or not answer:
        raise ValueError(
            f"sample {sample_id}: a stage-1 segment needs a prompt and an answer, got {len(prompt_ids)}"
            f" prompt and {len(answer)} answer ids"
        )
    supervised = [*answer, int(eot_id)]
    ids = prompt_ids + supervised + [int(newline_id)]
    meta = SegmentMeta(
        sample_id=int(sample_id),
        base_idx=int(base_idx),
        encoded_len=len(ids),
        prompt_len=len(prompt_ids),
        prompt_ids=tuple(prompt_ids),
        prefix_len=0,
        train_len=len(answer),
        prefix_coord_pos=(),
        prefix_coord_target_bins=(),
        tail_ignore_pos=(),
        prefix_ce_pos=(),
        rollout_step=0,
    )
    labels = Labels([IGNORE_INDEX] * len(prompt_ids) + supervised + [IGNORE_INDEX], [], [], [])
    return labels.segment(ids, meta, mm_inputs=dict(prompt.mm_inputs), rope_positions=prompt.rope_positions)


def encode_segment(
    prompt_ids_tf: Sequence[int],
    prompt_ids_rollout: Sequence[int],
    y_train: YTrain,
    eot_id: int,
    newline_id: int,
    coord_vocab: CoordVocab,
    *,
    sample_id: int,
    base_idx: int,
    rollout_step: int,
    packing_length: int,
    on_prompt_mismatch: Literal["drop", "raise"] = "drop",
    oversize_policy: Literal["drop", "raise"] = "raise",
    mm_inputs: dict[str, Any] | None = None,
    rope_positions: tuple[tuple[int, ...], ...] | None = None,
) -> tuple[Segment | None, dict[str, float]]:
    """§11 with its policies: prompt alignment, segment build, oversize check.

    Returns:
        ``(segment, counters)``; segment is None when the sample is dropped, and ``counters`` then holds
        ``prompt_mismatch_dropped`` or ``oversize_dropped`` = 1.

    Raises:
        ValueError: prompt mismatch with ``on_prompt_mismatch="raise"``.
        SegmentTooLongError: oversize with ``oversize_policy="raise"``.
    """
    mismatch = check_prompt_alignment(prompt_ids_tf, prompt_ids_rollout)
    if mismatch is not None:
        msg = (
            f"sample_id={sample_id}: teacher-forced prompt ({mismatch.len_tf} tokens) differs from the "
            f"rollout prompt ({mismatch.len_rollout} tokens) at position {mismatch.first_diff}; usual "
            "cause: the engine's image processor resized differently"
        )
        if on_prompt_mismatch == "raise":
            raise ValueError(msg + " (stage2.encode.on_prompt_mismatch=raise)")
        logger.warning("%s; sample dropped", msg)
        return None, {"prompt_mismatch_dropped": 1.0}
    seg = build_segment(
        prompt_ids_tf,
        y_train,
        eot_id,
        newline_id,
        coord_vocab,
        sample_id=sample_id,
        base_idx=base_idx,
        rollout_step=rollout_step,
        mm_inputs=mm_inputs,
        rope_positions=rope_positions,
    )
    if seg.encoded_len > packing_length:
        if oversize_policy == "raise":
            check_segment_length(seg.encoded_len, packing_length, sample_id)
        logger.warning(
            "sample_id=%s: segment of %d tokens > packing_length %d; dropped (oversize_policy=drop)",
            sample_id,
            seg.encoded_len,
            packing_length,
        )
        return None, {"oversize_dropped": 1.0}
    return seg, {"prompt_mismatch_dropped": 0.0, "oversize_dropped": 0.0}
