"""docs/ALGORITHM.md#worked-example end to end: token sequence → parse → match → Y_train → labels → loss,
exact values.

The logits are all zero (a uniform policy), so every term has a closed form: CE per supervised token is
ln V; per coord slot softCE = ln 1000, gate = ln V − ln 1000, and W1 depends only on the slot's target bin
(computed here with an independent numpy transcription of §13.2). The loss modules must reproduce them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from learner.batching.packed_batch import pad_segments
from learner.stage2.losses import CoordLossConfig, micro_loss, step_loss_sums
from tests.unit.learner.worked_example import COORDS, GT_RAW, ROLLOUT_IDS, TOKENIZER, run_pipeline

PRE_BINS = [100, 80, 300, 620]
TAIL_BINS = [520, 400, 760, 640, 400, 650, 900, 650, 900, 950, 400, 950]


def _w1_uniform(t: int, sigma: float = 2.0) -> float:
    k = np.arange(1000, dtype=np.float64)
    q = np.exp(-0.5 * ((k - t) / sigma) ** 2)
    q /= q.sum()
    cdf_p = np.cumsum(np.full(1000, 1e-3))
    return float(np.abs(cdf_p - np.cumsum(q)).sum() / 999)


def test_worked_example_loss_exact():
    pipe = run_pipeline(ROLLOUT_IDS, GT_RAW)
    seg = pipe.segment
    # §21.5 bookkeeping, as the loss sees it.
    assert seg.encoded_len == 459
    assert sum(1 for label in seg.labels if label != -100) == 57
    assert list(seg.coord_pos) == [318, 321, 324, 327, *range(406, 416, 3), *range(433, 455, 3)]
    assert list(seg.coord_bins) == PRE_BINS + TAIL_BINS
    assert list(seg.coord_is_prefix) == [True] * 4 + [False] * 12

    vocab = len(TOKENIZER)
    batch = pad_segments([seg], pad_id=0)
    logits = torch.zeros(1, seg.encoded_len, vocab, requires_grad=True)
    sums = step_loss_sums(
        logits,
        batch,
        coord_ids=torch.tensor(COORDS.ids),
        coord_cfg=CoordLossConfig(),
        eos_id=TOKENIZER.id_of("<|im_end|>"),
    )

    assert sums.n_ce == 57 and sums.n_coord == 16
    assert float(sums.s_ce.detach()) == pytest.approx(57 * math.log(vocab), rel=1e-6)
    expected_slots = [
        math.log(1000) + _w1_uniform(t) + (math.log(vocab) - math.log(1000)) for t in PRE_BINS + TAIL_BINS
    ]
    assert float(sums.s_coord.detach()) == pytest.approx(sum(expected_slots), rel=1e-5)
    assert float(sums.s_coord_prefix) == pytest.approx(sum(expected_slots[:4]), rel=1e-5)
    assert sums.n_ce_eos == 1  # the end-of-turn position 457

    loss = micro_loss(sums, 57, 16, world_size=1, normalization="token_weighted", gas=1)
    assert float(loss.detach()) == pytest.approx(math.log(vocab) + sum(expected_slots) / 16, rel=1e-5)
    loss.backward()
    # The coord loss at position p reads the logits at p − 1 (§21.5: "position 318 reads the logits at 317").
    assert logits.grad[0, 317].abs().sum() > 0 and logits.grad[0, 318].abs().sum() == 0
