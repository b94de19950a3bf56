"""Toy segments for packing / loss / buffer tests: explicit token ids, labels from ``build_labels``.

Toy vocabulary (``VOCAB_SIZE`` = 1100): ids 0..99 are text tokens, ``EOT`` = 5 the end-of-turn token,
``NEWLINE`` = 6, ``PAD`` = 0, and ids 100..1099 are the coordinate tokens ``<|coord_0|>``..``<|coord_999|>``
(bin ``k`` has id ``100 + k``).
"""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from learner.stage2.coords import CoordVocab
from learner.stage2.targets.labels import build_labels, fp_positions
from learner.stage2.targets.segment import Segment, SegmentMeta

COORD_BASE = 100
VOCAB_SIZE = 1100
EOT = 5
NEWLINE = 6
PAD = 0
VOCAB = CoordVocab.from_ids(range(COORD_BASE, COORD_BASE + 1000))
COORD_IDS = torch.arange(COORD_BASE, COORD_BASE + 1000)


def coord(k: int) -> int:
    """Token id of bin ``k``."""
    return COORD_BASE + k


def make_segment(
    prompt: Sequence[int],
    prefix: Sequence[int],
    tail: Sequence[int],
    *,
    prefix_targets: dict[int, int] | None = None,
    tail_ignore: Sequence[int] = (),
    prefix_ce: Sequence[int] = (),
    prefix_fp: Sequence[int] = (),
    sample_id: int = 0,
    rollout_step: int = 0,
    meta_prompt_ids: Sequence[int] | None = None,
) -> Segment:
    """Segment ``prompt + prefix + tail + [EOT, NEWLINE]`` with labels from ``build_labels``.

    Args:
        prompt: prompt ids (text ids, non-empty).
        prefix: rollout-prefix ids.
        tail: appended ids.
        prefix_targets: assistant-local prefix coord slot -> target bin.
        tail_ignore: tail-relative positions masked from CE.
        prefix_ce: assistant-local prefix positions with CE.
        prefix_fp: assistant-local prefix positions of false-positive tokens penalized by unlikelihood.
        sample_id: sample id (base_idx is the same).
        rollout_step: global step of the generating policy.
        meta_prompt_ids: override ``meta.prompt_ids`` (to build an inconsistent segment).
    """
    prefix_targets = dict(sorted((prefix_targets or {}).items()))
    ids = [*prompt, *prefix, *tail, EOT, NEWLINE]
    prompt_len, prefix_len, train_len = len(prompt), len(prefix), len(prefix) + len(tail)
    lab = build_labels(
        ids,
        prompt_len,
        prefix_len,
        train_len,
        list(prefix_targets),
        list(prefix_targets.values()),
        list(tail_ignore),
        list(prefix_ce),
        VOCAB,
    )
    meta = SegmentMeta(
        sample_id=sample_id,
        base_idx=sample_id,
        encoded_len=len(ids),
        prompt_len=prompt_len,
        prompt_ids=tuple(meta_prompt_ids if meta_prompt_ids is not None else prompt),
        prefix_len=prefix_len,
        train_len=train_len,
        prefix_coord_pos=tuple(prefix_targets),
        prefix_coord_target_bins=tuple(prefix_targets.values()),
        tail_ignore_pos=tuple(tail_ignore),
        prefix_ce_pos=tuple(prefix_ce),
        rollout_step=rollout_step,
        prefix_fp_pos=tuple(prefix_fp),
    )
    return lab.segment(ids, meta, fp_pos=fp_positions(ids, prompt_len, prefix_len, prefix_fp, lab, VOCAB))


def random_segment(
    rng: random.Random, *, sample_id: int = 0, rollout_step: int = 0, max_part: int = 8
) -> Segment:
    """A random, valid segment: text/coord mix in prefix and tail, random targets and masks."""

    def part(n: int) -> list[int]:
        return [coord(rng.randrange(1000)) if rng.random() < 0.3 else rng.randrange(7, 100) for _ in range(n)]

    prompt = [rng.randrange(7, 100) for _ in range(rng.randint(1, max_part))]
    prefix, tail = part(rng.randint(0, max_part)), part(rng.randint(0, max_part))
    prefix_coords = [i for i, t in enumerate(prefix) if t >= COORD_BASE]
    slots = sorted(rng.sample(prefix_coords, rng.randint(0, len(prefix_coords))))
    targets = {i: rng.randrange(1000) for i in slots}
    tail_text = [i for i, t in enumerate(tail) if t < COORD_BASE]
    ignore = sorted(rng.sample(tail_text, rng.randint(0, len(tail_text))))
    prefix_ce = sorted(rng.sample(range(len(prefix)), rng.randint(0, len(prefix))))
    return make_segment(
        prompt,
        prefix,
        tail,
        prefix_targets=targets,
        tail_ignore=ignore,
        prefix_ce=prefix_ce,
        sample_id=sample_id,
        rollout_step=rollout_step,
    )


def sized_segment(length: int, *, sample_id: int = 0, rollout_step: int = 0) -> Segment:
    """A segment of exactly ``length`` (>= 3) tokens: 1 prompt token, text tail, EOT, NEWLINE."""
    if length < 3:
        raise ValueError(f"sized_segment needs length >= 3, got {length}")
    return make_segment([7], [], [8] * (length - 3), sample_id=sample_id, rollout_step=rollout_step)
