"""One sample's teacher-forced encoding (docs/ALGORITHM.md#vocabulary "segment", §11, §12.4, §14.4).

A :class:`Segment` is atomic for packing: ``input_ids = prompt_ids + Y_train_ids + turn_suffix_ids``.
All positions stored here are ABSOLUTE within the segment (0 = first prompt token), except the
fields of :class:`SegmentMeta` that the spec defines as assistant-local (``prefix_coord_pos``) or
tail-relative (``tail_ignore_pos``), which are kept in their spec form so that packing can call
:func:`learner.stage2.targets.labels.build_labels` again on a packed row (§14.6).

Token-id sequences are plain ``tuple[int, ...]`` (the algorithm modules are torch-free); packing turns them
into tensors.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

__all__ = ["Segment", "SegmentMeta"]


@dataclass(frozen=True)
class SegmentMeta:
    """Per-segment meta of §14.4.

    Attributes:
        sample_id: ``(dataset_namespace << 32) | base_idx`` (§1.5).
        base_idx: row index within its dataset.
        encoded_len: ``len(input_ids)`` of the segment (> prompt_len + train_len).
        prompt_len: number of prompt tokens (> 0).
        prompt_ids: the prompt token ids (checked against the packed row, §14.6).
        prefix_len: number of rollout prefix tokens in Y_train.
        train_len: ``len(Y_train_ids)`` (prefix + appended tail).
        prefix_coord_pos: assistant-local indices (0 = first Y_train token) of supervised prefix coord
            slots, in slot order.
        prefix_coord_target_bins: target bin (0..999) per entry of ``prefix_coord_pos``.
        tail_ignore_pos: tail-relative indices (0 = first appended token) masked from CE (desc values).
        prefix_ce_pos: assistant-local indices of prefix tokens that get CE (``prefix_structure_ce``).
        rollout_step: global step of the policy that produced the rollout.
        prefix_fp_pos: assistant-local indices of the false-positive tokens penalized by unlikelihood
            (§12.5; empty when the loss is off).
        counters: per-sample counters (names without the ``rollout/`` prefix), summed by metrics.
    """

    sample_id: int
    base_idx: int
    encoded_len: int
    prompt_len: int
    prompt_ids: tuple[int, ...]
    prefix_len: int
    train_len: int
    prefix_coord_pos: tuple[int, ...]
    prefix_coord_target_bins: tuple[int, ...]
    tail_ignore_pos: tuple[int, ...]
    prefix_ce_pos: tuple[int, ...]
    rollout_step: int
    prefix_fp_pos: tuple[int, ...] = ()
    counters: dict[str, float] = field(default_factory=dict)

    def as_dict(self, *, with_token_ids: bool = True) -> dict[str, Any]:
        """Plain dict form; ``with_token_ids=False`` drops id lists for logging (§14.4)."""
        d = asdict(self)
        if not with_token_ids:
            d.pop("prompt_ids")
        return d


@dataclass(frozen=True)
class Segment:
    """One sample's teacher-forced encoding with its labels (§11, §12.4).

    Invariants (checked by :func:`learner.stage2.targets.labels.build_segment`):
    ``len(labels) == len(input_ids) == meta.encoded_len``; ``coord_pos``, ``coord_bins`` and
    ``coord_is_prefix`` have equal length, prefix slots first; every supervised position ``p`` (CE or
    coord) satisfies ``meta.prompt_len <= p <= meta.prompt_len + meta.train_len``.

    Attributes:
        input_ids: ``prompt_ids + Y_train_ids + turn_suffix_ids``.
        labels: CE labels, ``-100`` where unsupervised, else ``input_ids[p]``.
        coord_pos: absolute positions of supervised coord slots (the loss reads logits at ``p - 1``).
        coord_bins: target bin per coord slot.
        coord_is_prefix: True for rollout-prefix slots (§9 targets), False for tail slots.
        meta: :class:`SegmentMeta`.
        mm_inputs: multimodal tensors of the prompt (``pixel_values``, ``image_grid_thw``, ...), opaque
            here; empty for text prompts.
        rope_positions: ``[3][prompt_len]`` M-RoPE positions (rows t, h, w) of the PROMPT for models with
            multi-axis rotary positions (Qwen-VL), else None; packing extends them over the answer.
        fp_pos: absolute positions of false-positive tokens penalized by unlikelihood (§12.5): the loss reads
            the logits at ``p - 1`` and lowers the probability of ``input_ids[p]``.
    """

    input_ids: tuple[int, ...]
    labels: tuple[int, ...]
    coord_pos: tuple[int, ...]
    coord_bins: tuple[int, ...]
    coord_is_prefix: tuple[bool, ...]
    meta: SegmentMeta
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    rope_positions: tuple[tuple[int, ...], ...] | None = None
    fp_pos: tuple[int, ...] = ()

    @property
    def encoded_len(self) -> int:
        """Number of tokens of the segment."""
        return len(self.input_ids)
