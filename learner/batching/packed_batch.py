"""Prepared micro-batches: one packed padding-free row, or right-padded rows (docs/ALGORITHM.md#packed-rows,
§14.4–14.6).

Both layouts give :func:`learner.stage2.losses.step_loss_sums` the same thing: ``labels [B, T]`` and
coord slots as ``(batch index, absolute position, bin, is_prefix)`` and the false-positive tokens penalized by
unlikelihood as ``(batch index, absolute position, emitted id)``; a slot or FP token at ``p`` reads the logits
at ``p - 1``, which §14.6 keeps inside its own segment.

Packed rows carry ``position_ids`` restarting at 0 in every segment plus ``cu_seqlens`` / ``max_seqlen``
(int32, flash-attention varlen convention) and NO attention mask: transformers then isolates the
segments itself (flash-attention varlen from the position restarts; sdpa/eager get a block-diagonal
causal mask built from the same restarts — checked by ``tests/integration/test_packed_equivalence.py``).
Models with multi-axis rotary positions (Qwen-VL, M-RoPE) get ``position_ids`` of shape ``[4, B, T]``:
row 0 is the text position above (restarting per packed segment, which is what transformers reads to isolate
packed segments), rows 1–3 the segment's own M-RoPE positions (t, h, w) — the prompt's, computed by the
model's rope-index function at encoding time (`learner.data.prompt_encoding`), continued over the answer by
:func:`segment_rope_positions`. So a packed segment sees the positions it would see alone. Vision tensors
(``pixel_values``, ``image_grid_thw``) are concatenated in segment order, which is the order the model
consumes images in (placeholders left to right).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.stage2.targets.segment import Segment

__all__ = ["PackedBatch", "pack_segments", "pad_segments", "segment_rope_positions"]

IGNORE_INDEX = -100


@dataclass(frozen=True)
class PackedBatch:
    """One prepared micro-batch (§14.4).

    Attributes:
        input_ids: ``[B, T]`` int64.
        labels: ``[B, T]`` int64, -100 where unsupervised.
        position_ids: ``[B, T]`` int64, packed: restarting at 0 per segment; ``[4, B, T]`` for M-RoPE models
            (row 0 as above, rows 1–3 the per-segment M-RoPE positions).
        attention_mask: ``[B, T]`` (1 = token, 0 = padding) for padded rows; None when packed.
        cu_seqlens: packed only: ``[k + 1]`` int32 segment boundaries ``[0, L1, L1+L2, ..., ΣL]``.
        max_seqlen: longest segment.
        coord_batch_idx: ``[K]`` row of each coord slot (0 when packed).
        coord_pos: ``[K]`` absolute position of each coord slot in its row.
        coord_bins: ``[K]`` target bin.
        coord_is_prefix: ``[K]`` bool.
        meta: segment metas as dicts (packed: concatenation order; padded: one per row).
        mm_inputs: multimodal tensors concatenated along dim 0 in segment order.
        packed: True for the single padding-free row.
        fp_batch_idx: ``[F]`` row of each false-positive token penalized by unlikelihood (§12.5).
        fp_pos: ``[F]`` its absolute position in its row.
        fp_ids: ``[F]`` the id the model emitted there (``input_ids[row, pos]``).
    """

    input_ids: torch.Tensor
    labels: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    cu_seqlens: torch.Tensor | None
    max_seqlen: int
    coord_batch_idx: torch.Tensor
    coord_pos: torch.Tensor
    coord_bins: torch.Tensor
    coord_is_prefix: torch.Tensor
    meta: list[dict[str, Any]]
    mm_inputs: dict[str, Any] = field(default_factory=dict)
    packed: bool = False
    fp_batch_idx: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    fp_pos: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))
    fp_ids: torch.Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.long))

    @property
    def n_ce(self) -> int:
        """Supervised CE tokens (labels at positions ≥ 1; position 0 has no predecessor)."""
        return int((self.labels[:, 1:] != IGNORE_INDEX).sum())

    @property
    def n_coord(self) -> int:
        """Supervised coord slots."""
        return int(self.coord_pos.numel())

    @property
    def n_fp(self) -> int:
        """False-positive tokens penalized by unlikelihood."""
        return int(self.fp_pos.numel())

    @property
    def num_tokens(self) -> int:
        """Real (non-padding) tokens."""
        if self.attention_mask is None:
            return int(self.input_ids.numel())
        return int(self.attention_mask.sum())

    def model_inputs(self, *, flash_varlen_kwargs: bool = False) -> dict[str, Any]:
        """Keyword arguments for the model's forward (labels are never passed, §13.1).

        ``use_cache=False`` is always set: transformers only detects packed sequences (and builds the
        block-diagonal mask) when there is no KV-cache object, and ``Qwen2Config.use_cache`` defaults to
        True, which would silently let segments attend to each other.

        Args:
            flash_varlen_kwargs: also pass ``cu_seq_lens_q/k`` and ``max_length_q/k`` (packed rows with
                ``attn_implementation="flash_attention_2"``; saves transformers recomputing them).
        """
        out: dict[str, Any] = {
            "input_ids": self.input_ids,
            "position_ids": self.position_ids,
            "use_cache": False,
        }
        if self.attention_mask is not None:
            out["attention_mask"] = self.attention_mask
        if flash_varlen_kwargs and self.packed and self.cu_seqlens is not None:
            out |= {
                "cu_seq_lens_q": self.cu_seqlens,
                "cu_seq_lens_k": self.cu_seqlens,
                "max_length_q": self.max_seqlen,
                "max_length_k": self.max_seqlen,
            }
        out.update(self.mm_inputs)
        return out

    def to(self, device: torch.device | str, non_blocking: bool = False) -> PackedBatch:
        """Copy with every tensor moved to ``device`` (meta untouched). ``non_blocking`` from a pinned batch
        (`pin_memory`) queues the copies on the current stream and returns at once."""
        return self._map(lambda x: x.to(device, non_blocking=non_blocking))

    def pin_memory(self) -> PackedBatch:
        """Copy in page-locked host memory (tensors already pinned are kept), so that ``to(cuda,
        non_blocking=True)`` neither blocks the host nor waits for the GPU's queue. CUDA hosts only."""
        return self._map(lambda x: x if x.is_pinned() else x.pin_memory())

    def _map(self, fn: Any) -> PackedBatch:
        def mv(x: Any) -> Any:
            return fn(x) if isinstance(x, torch.Tensor) else x

        return PackedBatch(
            input_ids=mv(self.input_ids),
            labels=mv(self.labels),
            position_ids=mv(self.position_ids),
            attention_mask=mv(self.attention_mask),
            cu_seqlens=mv(self.cu_seqlens),
            max_seqlen=self.max_seqlen,
            coord_batch_idx=mv(self.coord_batch_idx),
            coord_pos=mv(self.coord_pos),
            coord_bins=mv(self.coord_bins),
            coord_is_prefix=mv(self.coord_is_prefix),
            meta=self.meta,
            mm_inputs={k: mv(v) for k, v in self.mm_inputs.items()},
            packed=self.packed,
            fp_batch_idx=mv(self.fp_batch_idx),
            fp_pos=mv(self.fp_pos),
            fp_ids=mv(self.fp_ids),
        )


def _check_segment(seg: Segment, index: int) -> None:
    """§14.6 invariants of one segment (internal errors → raise)."""
    m = seg.meta
    length = len(seg.input_ids)
    if length <= 0 or m.encoded_len != length or len(seg.labels) != length:
        raise ValueError(
            f"segment {index} (sample_id={m.sample_id}): encoded_len {m.encoded_len}, {length} ids and "
            f"{len(seg.labels)} labels must be equal and > 0"
        )
    if tuple(seg.input_ids[: m.prompt_len]) != tuple(m.prompt_ids):
        raise ValueError(
            f"segment {index} (sample_id={m.sample_id}): the row's first prompt_len={m.prompt_len} ids "
            "differ from meta.prompt_ids; segment and meta are out of sync (internal error)"
        )
    if not (len(seg.coord_pos) == len(seg.coord_bins) == len(seg.coord_is_prefix)):
        raise ValueError(
            f"segment {index} (sample_id={m.sample_id}): coord_pos/bins/is_prefix lengths differ"
        )
    first_label = next((p for p, v in enumerate(seg.labels) if v != IGNORE_INDEX), None)
    first_sup = min([p for p in (first_label, *seg.coord_pos) if p is not None], default=None)
    if first_sup is not None and first_sup < max(m.prompt_len, 1):
        raise ValueError(
            f"segment {index} (sample_id={m.sample_id}): supervised position {first_sup} precedes "
            f"prompt_len={m.prompt_len}; its logit would come from another segment"
        )
    if seg.coord_pos and max(seg.coord_pos) >= length:
        raise ValueError(f"segment {index} (sample_id={m.sample_id}): coord position beyond the segment")
    if seg.fp_pos and not (max(m.prompt_len, 1) <= min(seg.fp_pos) and max(seg.fp_pos) < length):
        raise ValueError(
            f"segment {index} (sample_id={m.sample_id}): a false-positive position lies outside the segment's"
            f" answer [{m.prompt_len}, {length}); its logit would come from another segment"
        )


def segment_rope_positions(prompt_positions: Sequence[Sequence[int]], length: int) -> list[list[int]]:
    """3-row M-RoPE positions of a segment of ``length`` tokens whose first tokens are the prompt.

    Text after the prompt advances the three rows together from ``max(prompt positions) + 1`` (Qwen-VL's
    rope index for text that follows an image; equal to its result on the whole segment).
    """
    prompt_len = len(prompt_positions[0])
    start = max(max(row) for row in prompt_positions) + 1 if prompt_len else 0
    tail = list(range(start, start + length - prompt_len))
    return [list(row) + tail for row in prompt_positions]


def _rope_rows(seg: Segment) -> list[list[int]]:
    """The segment's 3-row positions; a prompt without M-RoPE positions counts as text (all rows equal)."""
    length = len(seg.input_ids)
    if seg.rope_positions is None:
        return [list(range(length))] * 3
    if any(len(row) != seg.meta.prompt_len for row in seg.rope_positions) or len(seg.rope_positions) != 3:
        raise ValueError(
            f"segment sample_id={seg.meta.sample_id}: rope_positions must be 3 rows of prompt_len="
            f"{seg.meta.prompt_len} positions (internal error)"
        )
    return segment_rope_positions(seg.rope_positions, length)


def _concat_mm(segments: Sequence[Segment], pin_memory: bool = False) -> dict[str, Any]:
    """The segments' multimodal tensors concatenated per key; ``pin_memory``: written straight into
    page-locked memory (the image patches are the bulk of a batch: no second copy to pin them)."""
    keys: list[str] = []
    for seg in segments:
        keys += [k for k in seg.mm_inputs if k not in keys]
    out: dict[str, Any] = {}
    for key in keys:
        parts = [torch.as_tensor(seg.mm_inputs[key]) for seg in segments if key in seg.mm_inputs]
        buffer = None
        if pin_memory:
            shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
            buffer = torch.empty(shape, dtype=parts[0].dtype, pin_memory=True)
        out[key] = torch.cat(parts, dim=0, out=buffer)
    return out


def _assemble(
    segments: Sequence[Segment],
    coords: tuple[list[int], list[int], list[int], list[bool]],
    fps: tuple[list[int], list[int], list[int]],
    *,
    pin_memory: bool,
    **layout: Any,
) -> PackedBatch:
    """The batch of `segments` in a layout (`pack_segments`, `pad_segments`): the coords `(batch row,
    position, bin, is_prefix)` and the false-positive tokens `(batch row, position, emitted id)` as tensors,
    the segments' meta and multimodal inputs, pinned if asked."""
    rows, pos, bins, is_prefix = coords
    fp_rows, fp_pos, fp_ids = fps
    batch = PackedBatch(
        **layout,
        coord_batch_idx=torch.tensor(rows, dtype=torch.long),
        coord_pos=torch.tensor(pos, dtype=torch.long),
        coord_bins=torch.tensor(bins, dtype=torch.long),
        coord_is_prefix=torch.tensor(is_prefix, dtype=torch.bool),
        meta=[seg.meta.as_dict() for seg in segments],
        mm_inputs=_concat_mm(segments, pin_memory),
        fp_batch_idx=torch.tensor(fp_rows, dtype=torch.long),
        fp_pos=torch.tensor(fp_pos, dtype=torch.long),
        fp_ids=torch.tensor(fp_ids, dtype=torch.long),
    )
    return batch.pin_memory() if pin_memory else batch


def pack_segments(segments: Sequence[Segment], *, pin_memory: bool = False) -> PackedBatch:
    """Concatenate segments (insertion order) into one padding-free row ``[1, ΣL]`` (§14.4–14.6).

    Packed labels are the concatenation of the per-segment labels; coord positions are shifted by the
    lengths of the preceding segments, and so are false-positive positions; bins and ``is_prefix`` are
    preserved; batch index 0.
    ``pin_memory`` (CUDA hosts): the batch in page-locked memory (`PackedBatch.pin_memory`).

    Raises:
        ValueError: no segment, or a violated §14.6 invariant (e.g. a segment whose ids do not start
            with its ``meta.prompt_ids``).
    """
    if not segments:
        raise ValueError("pack_segments needs at least one segment; an empty micro-step uses zero_loss")
    ids: list[int] = []
    labels: list[int] = []
    positions: list[int] = []
    bounds = [0]
    c_pos: list[int] = []
    c_bins: list[int] = []
    c_pref: list[bool] = []
    f_pos: list[int] = []
    f_ids: list[int] = []
    for index, seg in enumerate(segments):
        _check_segment(seg, index)
        offset = bounds[-1]
        length = len(seg.input_ids)
        ids += seg.input_ids
        labels += seg.labels
        positions += range(length)
        c_pos += [offset + p for p in seg.coord_pos]
        c_bins += seg.coord_bins
        c_pref += seg.coord_is_prefix
        f_pos += [offset + p for p in seg.fp_pos]
        f_ids += [seg.input_ids[p] for p in seg.fp_pos]
        bounds.append(offset + length)
    if bounds[-1] != len(ids):
        raise AssertionError(f"packed offsets end at {bounds[-1]} != row length {len(ids)}")
    position_ids = torch.tensor([positions], dtype=torch.long)
    if any(seg.rope_positions is not None for seg in segments):
        rope = [sum((_rope_rows(seg)[axis] for seg in segments), []) for axis in range(3)]
        position_ids = torch.cat([position_ids[None], torch.tensor(rope, dtype=torch.long)[:, None]], dim=0)
    return _assemble(
        segments,
        ([0] * len(c_pos), c_pos, c_bins, c_pref),
        ([0] * len(f_pos), f_pos, f_ids),
        pin_memory=pin_memory,
        input_ids=torch.tensor([ids], dtype=torch.long),
        labels=torch.tensor([labels], dtype=torch.long),
        position_ids=position_ids,
        attention_mask=None,
        cu_seqlens=torch.tensor(bounds, dtype=torch.int32),
        max_seqlen=max(len(s.input_ids) for s in segments),
        packed=True,
    )


def pad_segments(segments: Sequence[Segment], pad_id: int, *, pin_memory: bool = False) -> PackedBatch:
    """Right-padded rows, one segment per row (packing off, §14.4): ``len(meta) == B``.

    Padding has label -100 and attention mask 0; ``position_ids`` is ``arange(T)`` per row.
    ``pin_memory``: as in `pack_segments`.

    Raises:
        ValueError: no segment, or a violated segment invariant.
    """
    if not segments:
        raise ValueError("pad_segments needs at least one segment; an empty micro-step uses zero_loss")
    width = max(len(s.input_ids) for s in segments)
    batch = len(segments)
    input_ids = torch.full((batch, width), pad_id, dtype=torch.long)
    labels = torch.full((batch, width), IGNORE_INDEX, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    rows: list[int] = []
    c_pos: list[int] = []
    c_bins: list[int] = []
    c_pref: list[bool] = []
    f_rows: list[int] = []
    f_pos: list[int] = []
    f_ids: list[int] = []
    for r, seg in enumerate(segments):
        _check_segment(seg, r)
        length = len(seg.input_ids)
        input_ids[r, :length] = torch.tensor(seg.input_ids, dtype=torch.long)
        labels[r, :length] = torch.tensor(seg.labels, dtype=torch.long)
        attention_mask[r, :length] = 1
        rows += [r] * len(seg.coord_pos)
        c_pos += seg.coord_pos
        c_bins += seg.coord_bins
        c_pref += seg.coord_is_prefix
        f_rows += [r] * len(seg.fp_pos)
        f_pos += seg.fp_pos
        f_ids += [seg.input_ids[p] for p in seg.fp_pos]
    position_ids = torch.arange(width, dtype=torch.long).unsqueeze(0).expand(batch, width).contiguous()
    if any(seg.rope_positions is not None for seg in segments):
        # Padding keeps position 0 on every row (never attended, never read by a loss).
        rope = torch.zeros((3, batch, width), dtype=torch.long)
        for r, seg in enumerate(segments):
            rope[:, r, : len(seg.input_ids)] = torch.tensor(_rope_rows(seg), dtype=torch.long)
        position_ids = torch.cat([position_ids[None], rope], dim=0)
    return _assemble(
        segments,
        (rows, c_pos, c_bins, c_pref),
        (f_rows, f_pos, f_ids),
        pin_memory=pin_memory,
        input_ids=input_ids,
        labels=labels,
        position_ids=position_ids,
        attention_mask=attention_mask,
        cu_seqlens=None,
        max_seqlen=width,
        packed=False,
    )
