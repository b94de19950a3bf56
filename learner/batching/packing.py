"""Post-rollout packing: knobs, segment selection and the carry buffer (docs/ALGORITHM.md#packing §14.1–14.3).

Only teacher-forced segments are packed, never rollouts. Per micro-step the trainer inserts the
micro-batch's segments into the rank-local :class:`CarryBuffer`, takes one selection (always holding the
oldest segment, never worse than FIFO) and concatenates it with
:func:`learner.batching.packed_batch.pack_segments` into one padding-free row. Leftovers wait for later
micro-steps; at the end of training they are discarded (``drop_last`` MUST be true).

Selection uses ``binpacking.to_constant_volume`` for the ``constant_volume`` step of §14.3: binpacking
2.x sorts items by decreasing size with ties in input (= insertion) order and puts each item into the
least-loaded bin it fits, ties to the lowest bin number — exactly the spec's rule (the unit tests check
it against a direct transcription of the spec on random inputs, plus the §20.9 cases).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import binpacking
from pydantic import Field, field_validator

from learner.batching.packed_batch import PackedBatch, pack_segments, pad_segments
from learner.stage2.targets.labels import SegmentTooLongError, segment_too_long_message
from learner.stage2.targets.segment import Segment
from shared_schemas.config import ConfigSection

__all__ = [
    "CarryBuffer",
    "PackStats",
    "PackedBatch",
    "PackingBufferOverflowError",
    "PackingConfig",
    "SegmentTooLongError",
    "best_bin",
    "next_packed_batch",
    "pack_segments",
    "pad_segments",
    "select_segments",
    "staleness_bound",
]

logger = logging.getLogger(__name__)

LEN_EMA_DECAY = 0.9
"""Decay of ``packing/avg_segment_len_ema`` per inserted segment (recent ~10 segments dominate)."""


class PackingConfig(ConfigSection):
    """Post-rollout packing knobs, YAML section ``stage2.packing`` (§14.1)."""

    enabled: bool = False
    """Pack teacher-forced segments (rollouts are never packed)."""
    packing_length: int | None = Field(default=None, ge=1)
    """Hard cap on tokens per packed row; null = ``global_max_length`` (resolved by the learner config)."""
    packing_buffer: int = Field(default=512, ge=1)
    """Hard cap on segments waiting in the carry buffer."""
    min_fill_ratio: float = Field(default=0.65, ge=0.0, le=1.0)
    """Packs filled below this ratio are counted in ``packing/underfilled_packs`` (telemetry only)."""
    drop_last: bool = True
    """Leftover segments at the end of training are discarded; MUST be true."""

    @field_validator("drop_last")
    @classmethod
    def _drop_last_must_be_true(cls, value: bool) -> bool:
        if not value:
            raise ValueError(
                "stage2.packing.drop_last=false is not supported: leftover segments are discarded at the "
                "end of training, never flushed; set stage2.packing.drop_last: true (or remove the key)"
            )
        return value


class PackingBufferOverflowError(RuntimeError):
    """Inserting a micro-batch would exceed ``stage2.packing.packing_buffer`` segments (§14.2)."""


def best_bin(bins: Iterable[Sequence[int]], lens: Sequence[int]) -> list[int]:
    """The bin of §14.3: largest total, then fewest items, then smallest sorted index tuple.

    Args:
        bins: bins of segment indices.
        lens: segment lengths indexed by those indices.

    Returns:
        The chosen bin's indices, ascending.
    """
    keyed = [(-sum(lens[i] for i in b), len(b), tuple(sorted(b))) for b in bins]
    return list(min(keyed)[2])


def select_segments(lens: Sequence[int], cap: int) -> list[int]:
    """Indices of the segments to pack now (§14.3): never worse than FIFO, deterministic.

    Args:
        lens: segment lengths in insertion order (``lens[0]`` is the oldest).
        cap: ``packing_length``.

    Returns:
        Ascending indices, always containing 0, with total length ≤ ``cap``; the FIFO choice unless
        the least-loaded-fit candidate is strictly fuller.

    Raises:
        ValueError: empty ``lens`` or ``lens[0] > cap`` (the carry buffer rejects such segments first).
    """
    if not lens:
        raise ValueError("select_segments needs at least one segment; an empty buffer is an empty micro-step")
    if lens[0] > cap:
        raise ValueError(
            f"oldest segment has {lens[0]} tokens > packing_length {cap}; it can never be packed"
        )
    fifo, total_f = [0], lens[0]
    for i in range(1, len(lens)):
        if total_f + lens[i] <= cap:
            fifo.append(i)
            total_f += lens[i]
    rem = cap - lens[0]
    if rem <= 0:
        return fifo
    items = {i: lens[i] for i in range(1, len(lens)) if 0 < lens[i] <= rem}
    if not items:
        return fifo
    bins = binpacking.to_constant_volume(items, rem)
    cand = sorted([0, *best_bin((list(b) for b in bins), lens)])
    total_c = sum(lens[i] for i in cand)
    return cand if total_c > total_f else fifo


@dataclass(frozen=True)
class PackStats:
    """Telemetry of one selection (feeds ``packing/*`` of §19).

    Attributes:
        fill: selected tokens / packing_length.
        total_len: selected tokens.
        n_segments: selected segments.
        buffer_after: segments left in the buffer after the selection.
        underfilled: ``fill < min_fill_ratio``.
        staleness: per selected segment, ``global_step - rollout_step`` (optimizer steps).
        avg_segment_len_ema: EMA of inserted segment lengths.
    """

    fill: float
    total_len: int
    n_segments: int
    buffer_after: int
    underfilled: bool
    staleness: tuple[int, ...]
    avg_segment_len_ema: float

    def metric_values(self) -> dict[str, float]:
        """Per-pack sums under the names :mod:`learner.metrics` aggregates."""
        return {
            "packing/packs": 1.0,
            "packing/sum_fill": self.fill,
            "packing/sum_selected_total_len": float(self.total_len),
            "packing/sum_segments": float(self.n_segments),
            "packing/underfilled_packs": float(self.underfilled),
            "packing/sum_staleness": float(sum(self.staleness)),
            "packing/count_staleness": float(len(self.staleness)),
            "packing/segment_staleness_max": float(max(self.staleness, default=0)),
            "packing/post_rollout_buffer": float(self.buffer_after),
            "packing/avg_segment_len_ema": self.avg_segment_len_ema,
        }


class CarryBuffer:
    """Rank-local FIFO of teacher-forced segments waiting to be packed (§14.2).

    Invariants: every buffered segment has ``encoded_len <= packing_length``; at most
    ``packing_buffer`` segments are held; a failed :meth:`insert` leaves the buffer unchanged. Not
    checkpointed: it starts empty after resume.
    """

    def __init__(self, packing_length: int, packing_buffer: int, min_fill_ratio: float = 0.65) -> None:
        if packing_length < 1 or packing_buffer < 1:
            raise ValueError(
                f"CarryBuffer needs packing_length >= 1 and packing_buffer >= 1, got {packing_length} "
                f"and {packing_buffer}"
            )
        self.packing_length = packing_length
        self.packing_buffer = packing_buffer
        self.min_fill_ratio = min_fill_ratio
        self._segments: list[Segment] = []
        self._len_ema: float | None = None
        self._warned_underfill = False

    @classmethod
    def from_config(cls, cfg: PackingConfig, global_max_length: int) -> CarryBuffer:
        """Buffer for ``cfg``; ``packing_length`` defaults to ``global_max_length``."""
        cap = cfg.packing_length if cfg.packing_length is not None else global_max_length
        return cls(cap, cfg.packing_buffer, cfg.min_fill_ratio)

    def __len__(self) -> int:
        return len(self._segments)

    @property
    def lengths(self) -> list[int]:
        """Encoded lengths in insertion order."""
        return [s.meta.encoded_len for s in self._segments]

    @property
    def avg_segment_len_ema(self) -> float:
        """EMA of inserted segment lengths (0 before the first insert)."""
        return self._len_ema if self._len_ema is not None else 0.0

    def insert(self, segments: Sequence[Segment]) -> None:
        """Append a micro-batch's segments in order, all or nothing.

        Raises:
            SegmentTooLongError: a segment exceeds ``packing_length`` (message contains
                ``Mitigations:``); nothing is inserted.
            PackingBufferOverflowError: the buffer would hold more than ``packing_buffer`` segments;
                nothing is inserted.
        """
        for seg in segments:
            if seg.meta.encoded_len > self.packing_length:
                raise SegmentTooLongError(
                    segment_too_long_message(seg.meta.encoded_len, self.packing_length, seg.meta.sample_id)
                )
        if len(self._segments) + len(segments) > self.packing_buffer:
            raise PackingBufferOverflowError(
                f"carry buffer holds {len(self._segments)} segments and {len(segments)} more would exceed "
                f"stage2.packing.packing_buffer={self.packing_buffer}; raise packing_buffer or lower the "
                "per-device batch size (per_device_train_batch_size)"
            )
        for seg in segments:
            length = seg.meta.encoded_len
            if self._len_ema is None:
                self._len_ema = float(length)
            else:
                self._len_ema = LEN_EMA_DECAY * self._len_ema + (1.0 - LEN_EMA_DECAY) * length
        self._segments.extend(segments)

    def take(self, global_step: int) -> tuple[list[Segment], PackStats | None]:
        """Remove and return one selection (§14.3) in insertion order, with its telemetry.

        Args:
            global_step: the optimizer step that will train on the pack (for staleness).

        Returns:
            ``([], None)`` when the buffer is empty (an empty micro-step, §14.7), else the selected
            segments (ascending insertion order) and their :class:`PackStats`.
        """
        if not self._segments:
            return [], None
        chosen = select_segments(self.lengths, self.packing_length)
        chosen_set = set(chosen)
        selected = [self._segments[i] for i in chosen]
        self._segments = [s for i, s in enumerate(self._segments) if i not in chosen_set]
        total = sum(s.meta.encoded_len for s in selected)
        fill = total / self.packing_length
        if fill < self.min_fill_ratio and not self._warned_underfill:
            # Once per buffer: short packs are normal at a window's end; the count is in the metrics.
            self._warned_underfill = True
            logger.warning(
                "packed row filled %.3f < stage2.packing.min_fill_ratio %.3f (counted in "
                "packing/underfilled_packs; this warning is shown once)",
                fill,
                self.min_fill_ratio,
            )
        stats = PackStats(
            fill=fill,
            total_len=total,
            n_segments=len(selected),
            buffer_after=len(self._segments),
            underfilled=fill < self.min_fill_ratio,
            staleness=tuple(global_step - s.meta.rollout_step for s in selected),
            avg_segment_len_ema=self.avg_segment_len_ema,
        )
        return selected, stats

    def clear(self) -> int:
        """Drop every buffered segment (``drop_last``); returns how many were dropped."""
        n = len(self._segments)
        self._segments = []
        return n


def staleness_bound(m_steps: int, packing_buffer: int, gas: int) -> int:
    """Upper bound of §15.4 on segment staleness: ``m_steps · ceil(packing_buffer / gas) − 1``."""
    return m_steps * math.ceil(packing_buffer / gas) - 1


def next_packed_batch(
    buffer: CarryBuffer, segments: Sequence[Segment], *, global_step: int
) -> tuple[PackedBatch | None, PackStats | None]:
    """One micro-step of §14.2: insert the micro-batch's segments, select, pack.

    Returns:
        ``(None, None)`` for an empty micro-step (empty buffer, §14.7), else the packed row and its stats.

    Raises:
        SegmentTooLongError, PackingBufferOverflowError: see :meth:`CarryBuffer.insert`.
    """
    buffer.insert(segments)
    selected, stats = buffer.take(global_step)
    if not selected:
        return None, None
    return pack_segments(selected), stats
