"""The loss of one micro-step: the policy's forward over a prepared micro-batch and the §13 losses of it.

`micro_step_loss` is the one definition of that step: the trainer's `compute_loss` calls it, and so do the
benches (`bench/bench_packing.py`, `bench/bench_logits.py`) and the tests that compare ways of running it.
The caller runs the backward (under the same `learner.kernels.packed_attention` block as the forward, since
gradient checkpointing re-runs the forward inside it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from learner.kernels import packed_attention
from learner.stage2.losses import (
    CoordLossConfig,
    LossConfig,
    LossSums,
    StepCounts,
    micro_loss,
    read_columns,
    step_loss_sums,
)

__all__ = ["MicroStep", "forward_for_loss", "micro_step_loss"]


@dataclass(frozen=True)
class MicroStep:
    """One micro-step's forward and loss.

    Attributes:
        loss: the loss to call ``backward`` on (§13.3, `losses.micro_loss`).
        sums: the sum-form losses and their counts (`losses.step_loss_sums`).
        outputs: the model's outputs (logits at `columns` only when compact).
        columns: the positions of compact logits (`losses.read_columns`), or None (every position).
    """

    loss: torch.Tensor
    sums: LossSums
    outputs: Any
    columns: torch.Tensor | None


def forward_for_loss(
    model: torch.nn.Module, batch: Any, *, compact: bool, segment_attention: bool = True
) -> tuple[Any, torch.Tensor | None]:
    """The model's forward over a prepared micro-batch, as `step_loss_sums` reads it.

    With `compact` (`stage2.loss.compact_logits`) the model returns logits only at the columns the losses
    read (`read_columns`, passed as `logits_to_keep`); pass the returned columns on to `step_loss_sums`.
    With `segment_attention` (`stage2.loss.segment_attention`) an `sdpa` model attends per packed segment
    without a mask (`learner.kernels.attention`); a packed row then passes its segment bounds.

    Returns:
        `(model outputs, columns or None)`.
    """
    columns = read_columns(batch.labels, batch.coord_pos, batch.fp_pos) if compact else None
    keep = {} if columns is None else {"logits_to_keep": columns}
    with packed_attention(model, enabled=segment_attention):
        return model(**batch.model_inputs(flash_varlen_kwargs=segment_attention), **keep), columns


def micro_step_loss(
    model: torch.nn.Module,
    batch: Any,
    *,
    coord_ids: torch.Tensor,
    eos_id: int | None,
    loss_cfg: LossConfig | None = None,
    coord_cfg: CoordLossConfig | None = None,
    totals: StepCounts | tuple[int, ...] | None = None,
    world_size: int = 1,
    gas: int = 1,
    after_forward: Callable[[], None] | None = None,
) -> MicroStep:
    """Forward and loss of one prepared micro-batch (`PackedBatch`, on the model's device).

    Args:
        model: the policy (possibly wrapped).
        batch: the micro-batch: a packed row or right-padded rows with labels and coord slots.
        coord_ids: `[1000]` coord token ids in bin order (any device).
        eos_id: end-of-turn id for the `loss/ce_eos` split (None: no split).
        loss_cfg: `stage2.loss` (compact logits, segment attention, normalization); None = its defaults.
        coord_cfg: `stage2.coord_loss`; None = its defaults.
        totals: `StepCounts` `(N_ce, N_coord[, N_fp])` of the whole optimizer step, all micro-steps and ranks
            (token-weighted normalization); None = this micro-batch's own counts (a step of one micro-batch).
        world_size: DP ranks averaging gradients.
        gas: gradient-accumulation steps of the optimizer step (`micro_mean` normalization).
        after_forward: called once the forward returned, before the losses (a bench's phase mark).

    Returns:
        The `MicroStep`; call ``backward`` on its `loss`.
    """
    loss_cfg = loss_cfg if loss_cfg is not None else LossConfig()
    outputs, columns = forward_for_loss(
        model, batch, compact=loss_cfg.compact_logits, segment_attention=loss_cfg.segment_attention
    )
    if after_forward is not None:
        after_forward()
    sums = step_loss_sums(
        outputs.logits,
        batch,
        coord_ids=coord_ids.to(outputs.logits.device),
        coord_cfg=coord_cfg if coord_cfg is not None else CoordLossConfig(),
        eos_id=eos_id,
        columns=columns,
    )
    counts = StepCounts(*totals) if totals is not None else StepCounts(sums.n_ce, sums.n_coord, sums.n_fp)
    loss = micro_loss(
        sums,
        counts.n_ce,
        counts.n_coord,
        world_size,
        loss_cfg.normalization,
        gas,
        n_fp_total=counts.n_fp,
        fp_weight=loss_cfg.fp_unlikelihood_weight,
    )
    return MicroStep(loss=loss, sums=sums, outputs=outputs, columns=columns)
