"""Torch-facing datasets of the learner: JSONL records → sample dicts, and the rollout-buffer repeat order.

The rollout buffer (docs/ALGORITHM.md#rollout-buffer §15.2) replays every window of `gas` micro-batches
`m_steps` times. HF `Trainer` owns the dataloader (we never override its builders), so the repetition is baked
into the dataset's index order instead and the trainer samples sequentially: `RepeatedWindowDataset` lists the
base samples in the repeated order and tags each with `(window_id, repetition)`. With `W` learner ranks,
accelerate hands global batch `k` to rank `k % W`, so one rank's window of `gas` batches is a block of
`W · gas · per_device_batch_size` consecutive samples; blocks are repeated whole, a trailing partial block
once. Shuffling happens once, with `training.seed`, before the repetition — resume therefore replays the exact
same order and HF's batch skipping continues with no sample skipped or repeated.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

from torch.utils.data import Dataset

__all__ = ["RepeatedWindowDataset", "SampleListDataset", "repeat_order"]


class SampleListDataset(Dataset):
    """A list of sample dicts (docs/ALGORITHM.md#records §1.5) as a map-style dataset."""

    def __init__(self, samples: Sequence[dict[str, Any]]) -> None:
        self.samples = list(samples)

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.samples[index]


def repeat_order(n: int, block: int, m_steps: int) -> list[tuple[int, int, int]]:
    """Repeated index order: `(base_index, window_id, repetition)` per position.

    Full blocks of `block` indices are listed `m_steps` times in a row; a trailing partial block once.
    Length: `(n // block) · block · m_steps + n % block` — the §15.2 formula with samples for batches.
    """
    if block < 1 or m_steps < 1:
        raise ValueError(f"repeat_order needs block >= 1 and m_steps >= 1, got {block} and {m_steps}")
    order: list[tuple[int, int, int]] = []
    full = n // block
    for window in range(full):
        for rep in range(m_steps):
            order.extend((i, window, rep) for i in range(window * block, (window + 1) * block))
    order.extend((i, full, 0) for i in range(full * block, n))
    return order


class RepeatedWindowDataset(Dataset):
    """Base samples in shuffled, window-repeated order; each item carries `_window_id` and `_repetition`.

    Args:
        base: the training samples.
        block: samples per window for ONE optimizer step over all ranks
            (`per_device_batch_size · gas · world_size`).
        m_steps: passes per window (1 = no repetition).
        seed: shuffle seed (None keeps the file order).
    """

    def __init__(self, base: Sequence[dict[str, Any]], *, block: int, m_steps: int, seed: int | None) -> None:
        self.base = list(base)
        perm = list(range(len(self.base)))
        if seed is not None:
            random.Random(seed).shuffle(perm)
        self._order = [(perm[i], w, r) for i, w, r in repeat_order(len(perm), block, m_steps)]

    def __len__(self) -> int:
        return len(self._order)

    def __getitem__(self, index: int) -> dict[str, Any]:
        base_index, window, rep = self._order[index]
        return {**self.base[base_index], "_window_id": window, "_repetition": rep}
