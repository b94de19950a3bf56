"""Losses of rollout-matching SFT (docs/ALGORITHM.md#losses).

Everything here works on logits the model already produced (labels are never passed to the model) and
returns SUMS with their COUNTS, so the trainer can normalize over the whole optimizer step and all DP
ranks (§13.3, token-weighted). No ``torch.distributed`` here: reduced counts come in as arguments.

Conventions: a label / coord slot at position ``p`` is predicted by the logits at ``p - 1`` (causal
shift, §13.1); coordinate bins are 0..999 and ``coord_ids[k]`` is the vocabulary id of bin ``k``. Losses are
in nats.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

import torch
import torch.nn.functional as F
from pydantic import Field

from learner.stage2.targets.false_positives import FpObjects, FpTokens
from shared_schemas.config import ConfigSection

__all__ = [
    "CoordLossConfig",
    "CoordTerms",
    "CeSums",
    "LossConfig",
    "LossInputs",
    "LossSums",
    "StepCounts",
    "ce_sum",
    "coord_loss_terms",
    "fp_unlikelihood_terms",
    "gaussian_targets",
    "micro_loss",
    "read_columns",
    "sanitize_logits",
    "step_loss_sums",
    "zero_loss",
]

IGNORE_INDEX = -100
LOGIT_BOUND = 1e4  # §13.2 sanitize: +inf -> 1e4, -inf -> -1e4, then clamp to [-1e4, 1e4]
FP_UNLIKELIHOOD_EPS = 1e-6
"""§13.5: ``1 - p`` is clamped at this, so one FP token costs at most ``-ln 1e-6`` ≈ 13.8 nats."""


class CoordLossConfig(ConfigSection):
    """Coordinate-loss knobs, YAML section ``stage2.coord_loss`` (§13.2)."""

    target_sigma: float = Field(default=2.0, gt=0)
    """Std-dev (in bins) of the Gaussian soft target around the target bin."""
    target_truncate: int | None = Field(default=None, ge=0)
    """Zero the target beyond this many bins from the center (null: no truncation, 0: one-hot)."""
    temperature: float = Field(default=1.0, gt=0)
    """Logits are divided by this before the softmax."""
    soft_ce_weight: float = Field(default=1.0, ge=0)
    """Weight of the soft cross-entropy against the Gaussian target."""
    w1_weight: float = Field(default=1.0, ge=0)
    """Weight of the 1-D Wasserstein distance between the coord distribution and the target."""
    gate_weight: float = Field(default=1.0, ge=0)
    """Weight of the gate term -log P(any coord token); 0 skips its computation."""


class LossConfig(ConfigSection):
    """Loss switches, YAML section ``stage2.loss`` (§12.3, §13.3, §13.5)."""

    normalization: Literal["token_weighted", "micro_mean"] = "token_weighted"
    """token_weighted: each supervised token of a step weighs the same; micro_mean: per-micro mean / gas."""
    fn_desc_ce: bool = False
    """Give CE to the desc-value tokens of appended (FN) objects."""
    prefix_structure_ce: bool = False
    """Give CE to the structure tokens of matched (TP) entries in the rollout prefix."""
    compact_logits: bool = True
    """Ask the model for logits only at the positions the losses read (``logits_to_keep`` = the read
    columns): the LM head, its logits and their gradient cost ``B·K·V`` instead of ``B·T·V`` (K = read
    positions; the prompt, image tokens included, is never read). Same losses and gradients; false asks
    for every position (models whose forward has no ``logits_to_keep``)."""
    segment_attention: bool = True
    """Teacher-forced forwards of ``sdpa`` models attend per packed segment with no mask
    (``learner.kernels.attention``): on CUDA in bf16/fp16 one varlen flash call per row (the kernel:
    ``model.varlen_kernel``; language model and vision tower), else one causal SDPA call per segment.
    Attention costs Σ Lᵢ² instead of T² per packed row and no T×T mask is built. Same outputs as transformers'
    ``sdpa`` with its block-diagonal mask; false uses the latter."""
    fp_unlikelihood_weight: float = Field(default=0.0, ge=0.0)
    """Weight of the unlikelihood loss on false positives (§13.5): the step objective gains
    ``w · S_fp / N_fp``, ``S_fp = Σ -log(1 - p(emitted token))`` over the penalized tokens of the unmatched
    predictions in the kept prefix. 0 (default): off, nothing recorded, behaviour unchanged. Needs
    ``stage2.targets.unmatched_prefix: keep`` (the FP tokens must be in the teacher-forced answer)."""
    fp_unlikelihood_tokens: FpTokens = "coords"
    """Which tokens of a false-positive object are penalized: ``coords`` every coordinate token,
    ``first_coord`` only its first (where the model commits to the object's place; the later ones follow
    from it)."""
    fp_unlikelihood_objects: FpObjects = "all"
    """Which false positives are penalized: ``all`` every unmatched prediction; ``duplicates`` only those
    whose best-overlapping GT object another prediction already matched (the evaluator's ``duplicates``,
    `learner.stage2.matching.breakdown`) — a repeat no correct answer holds, where ``all`` also penalizes
    near misses and teaches the model to emit less."""


def sanitize_logits(logits: torch.Tensor) -> torch.Tensor:
    """Float32 logits with NaN -> 0, +inf -> 1e4, -inf -> -1e4, then clamped to [-1e4, 1e4] (§13.2)."""
    x = logits.float()
    x = torch.nan_to_num(x, nan=0.0, posinf=LOGIT_BOUND, neginf=-LOGIT_BOUND)
    return x.clamp(-LOGIT_BOUND, LOGIT_BOUND)


def gaussian_targets(
    bins: torch.Tensor, sigma: float, truncate: int | None, num_bins: int = 1000
) -> torch.Tensor:
    """Soft coordinate targets ``q`` of §13.2, one row per target bin.

    ``q_k ∝ exp(-0.5 ((k - t) / sigma)^2)``, zero where ``|k - t| > truncate`` (when set), rows sum to 1.
    ``truncate = 0`` gives a one-hot row.

    Args:
        bins: integer target bins ``[K]`` in ``[0, num_bins)``.
        sigma: Gaussian std-dev in bins (> 0).
        truncate: support half-width in bins, or None for the full range.
        num_bins: size of the coordinate grid.

    Returns:
        float32 tensor ``[K, num_bins]`` on ``bins.device``.
    """
    k = torch.arange(num_bins, device=bins.device, dtype=torch.float32)
    dist = k.unsqueeze(0) - bins.to(torch.float32).unsqueeze(1)
    q = torch.exp(-0.5 * (dist / sigma) ** 2)
    if truncate is not None:
        q = torch.where(dist.abs() <= truncate, q, torch.zeros_like(q))
    return q / q.sum(dim=-1, keepdim=True)


class CoordTerms(NamedTuple):
    """Per-slot coordinate loss terms (all float32 ``[K]``).

    ``total`` is the weighted sum ℓ with non-finite entries replaced by 0; ``nonfinite`` marks them.
    """

    softce: torch.Tensor
    w1: torch.Tensor
    gate: torch.Tensor
    total: torch.Tensor
    nonfinite: torch.Tensor


def _coord_terms_raw(
    z: torch.Tensor, target_bins: torch.Tensor, coord_ids: torch.Tensor, cfg: CoordLossConfig
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    num_bins = coord_ids.numel()
    z_c = z.index_select(-1, coord_ids)
    log_p = torch.log_softmax(z_c, dim=-1)
    q = gaussian_targets(target_bins, cfg.target_sigma, cfg.target_truncate, num_bins)
    softce = -(q * log_p).sum(dim=-1)
    cdf_gap = torch.cumsum(log_p.exp(), dim=-1) - torch.cumsum(q, dim=-1)
    # Divided by (num_bins - 1) so that moving all mass across the full range costs exactly 1.
    w1 = cdf_gap.abs().sum(dim=-1) / (num_bins - 1)
    if cfg.gate_weight != 0:
        gate = (torch.logsumexp(z, dim=-1) - torch.logsumexp(z_c, dim=-1)).clamp(min=0.0)
    else:
        gate = torch.zeros_like(softce)
    total = cfg.soft_ce_weight * softce + cfg.w1_weight * w1 + cfg.gate_weight * gate
    return softce, w1, gate, total


def coord_loss_terms(
    logits_rows: torch.Tensor,
    target_bins: torch.Tensor,
    coord_ids: torch.Tensor,
    cfg: CoordLossConfig,
) -> CoordTerms:
    """Distributional coordinate loss of §13.2 for K supervised slots.

    Args:
        logits_rows: ``[K, V]`` logits that PREDICT the slots (i.e. read at ``p - 1``), any float dtype.
        target_bins: ``[K]`` integer target bins.
        coord_ids: ``[num_bins]`` vocabulary ids of the coord tokens in bin order.
        cfg: loss knobs.

    Returns:
        :class:`CoordTerms` per slot. A slot whose ℓ is not finite contributes 0 (and no gradient);
        ``nonfinite`` marks it so the caller can count ``loss/coord_nonfinite``.
    """
    coord_ids = coord_ids.to(device=logits_rows.device, dtype=torch.long)
    target_bins = target_bins.to(device=logits_rows.device)
    z = sanitize_logits(logits_rows) / cfg.temperature
    softce, w1, gate, total = _coord_terms_raw(z, target_bins, coord_ids, cfg)
    nonfinite = ~torch.isfinite(total)
    if bool(nonfinite.any()):
        # Recompute with the offending rows replaced by constants: masking ℓ alone would still let
        # inf/NaN reach the gradient through 0 * inf in the backward of the masked branch.
        z = torch.where(nonfinite.unsqueeze(-1), torch.zeros_like(z).detach(), z)
        softce, w1, gate, total = _coord_terms_raw(z, target_bins, coord_ids, cfg)
        zero = torch.zeros_like(total)
        softce, w1, gate, total = (torch.where(nonfinite, zero, t) for t in (softce, w1, gate, total))
    return CoordTerms(softce=softce, w1=w1, gate=gate, total=total, nonfinite=nonfinite)


class CeSums(NamedTuple):
    """Shifted CE sums of one micro-batch (§13.1): ``total`` keeps the graph, eos part is detached."""

    total: torch.Tensor
    count: int
    eos_total: torch.Tensor
    eos_count: int


def read_columns(
    labels: torch.Tensor, coord_pos: torch.Tensor, fp_pos: torch.Tensor | None = None
) -> torch.Tensor:
    """Positions whose logits the losses read: ``t - 1`` for every labelled ``t`` in any row, ``p - 1``
    for every coord slot at ``p`` and for every penalized false-positive token at ``p``.

    Args:
        labels: ``[B, T]``, -100 where unsupervised.
        coord_pos: ``[K]`` absolute slot positions (all ≥ 1).
        fp_pos: ``[F]`` absolute positions of penalized false-positive tokens (all ≥ 1), or None.

    Returns:
        ``[K']`` int64, sorted and unique, on ``labels``' device: the ``logits_to_keep`` index of a compact
        forward (one set for all rows of a padded batch).
    """
    labelled = (labels[:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().squeeze(1)
    read = [labelled, coord_pos.to(labels.device, torch.long) - 1]
    if fp_pos is not None:
        read.append(fp_pos.to(labels.device, torch.long) - 1)
    return torch.unique(torch.cat(read))


def _predicted_labels(labels: torch.Tensor, columns: torch.Tensor | None) -> tuple[torch.Tensor, slice]:
    """The label each logits column predicts, and the slice of logits columns that predict one."""
    if columns is None:
        return labels[:, 1:], slice(None, -1)
    return labels[:, columns + 1], slice(None)


def ce_sum(
    logits: torch.Tensor, labels: torch.Tensor, eos_id: int | None = None, columns: torch.Tensor | None = None
) -> CeSums:
    """Sum of ``cross_entropy(logits at t-1, labels[:, t])`` over every ``labels[:, t] != -100``.

    Only the supervised rows are gathered and upcast to float32, so memory stays ``O(n_ce · V)``.

    Args:
        logits: ``[B, T, V]``, or ``[B, K, V]`` at ``columns`` (a compact forward).
        labels: ``[B, T]`` with -100 where unsupervised. ``labels[:, 0]`` is never used (nothing
            predicts it); segments start with prompt tokens, so it is -100 anyway.
        eos_id: end-of-turn id; positions whose label equals it form the ``loss/ce_eos`` part.
        columns: ``[K]`` positions of the logits (:func:`read_columns`); None = every position.

    Returns:
        :class:`CeSums` (sum with graph, count, eos sum detached, eos count).
    """
    predicted, predicting = _predicted_labels(labels, columns)
    mask = predicted != IGNORE_INDEX
    rows = logits[:, predicting][mask].float()
    targets = predicted[mask]
    per_token = F.cross_entropy(rows, targets, reduction="none")
    total = per_token.sum()
    if eos_id is None:
        return CeSums(total, int(targets.numel()), total.detach() * 0.0, 0)
    eos_mask = targets == eos_id
    return CeSums(total, int(targets.numel()), per_token.detach()[eos_mask].sum(), int(eos_mask.sum()))


def fp_unlikelihood_terms(logits_rows: torch.Tensor, emitted_ids: torch.Tensor) -> torch.Tensor:
    """Unlikelihood of the tokens a model emitted where it should not have (§13.5), one per position.

    ``ul = -log(1 - p)`` with ``p`` the full-vocabulary softmax probability of the emitted token, computed in
    float32 from the log-probability as ``-log1p(-exp(log p))``, with ``log p`` clamped at
    ``log(1 - FP_UNLIKELIHOOD_EPS)`` so that ``1 - p ≥ 1e-6`` (no infinity, no NaN gradient; a token already
    that certain gets no gradient). Its gradient on the emitted token's logit is ``p > 0``: descent lowers p.

    Args:
        logits_rows: ``[F, V]`` logits that PREDICT the penalized tokens (read at ``p - 1``), any float dtype;
            sanitized as §13.2.
        emitted_ids: ``[F]`` vocabulary ids the model emitted at those positions.

    Returns:
        float32 ``[F]``, every entry in ``[0, -ln 1e-6]``.
    """
    log_p = torch.log_softmax(sanitize_logits(logits_rows), dim=-1)
    emitted = log_p.gather(-1, emitted_ids.to(log_p.device, torch.long).unsqueeze(-1)).squeeze(-1)
    return -torch.log1p(-torch.exp(emitted.clamp(max=math.log1p(-FP_UNLIKELIHOOD_EPS))))


class StepCounts(NamedTuple):
    """Supervision counts of a whole optimizer step, summed over its micro-steps and every DP rank (§13.3):
    CE tokens, coordinate slots and penalized false-positive tokens."""

    n_ce: int
    n_coord: int
    n_fp: int = 0


class LossInputs(Protocol):
    """What :func:`step_loss_sums` reads from a prepared micro-batch (packed or padded)."""

    labels: torch.Tensor  # [B, T]
    coord_batch_idx: torch.Tensor  # [K]
    coord_pos: torch.Tensor  # [K], positions of the slots (logits read at pos - 1)
    coord_bins: torch.Tensor  # [K]
    coord_is_prefix: torch.Tensor  # [K] bool
    fp_batch_idx: torch.Tensor  # [F]
    fp_pos: torch.Tensor  # [F], positions of penalized false-positive tokens (logits read at pos - 1)
    fp_ids: torch.Tensor  # [F], the ids emitted there


@dataclass
class LossSums:
    """Sum-form losses of one micro-step with their counts (§13.1–13.3).

    ``s_ce``, ``s_coord`` and ``s_fp`` carry the autograd graph; every other tensor is detached (logging
    only).
    ``s_fp`` / ``n_fp``: the false-positive unlikelihood (§13.5), unweighted.
    """

    s_ce: torch.Tensor
    n_ce: int
    s_coord: torch.Tensor
    n_coord: int
    s_ce_eos: torch.Tensor
    n_ce_eos: int
    s_coord_prefix: torch.Tensor
    n_coord_prefix: int
    s_coord_tail: torch.Tensor
    n_coord_tail: int
    s_coord_softce: torch.Tensor
    s_coord_w1: torch.Tensor
    s_coord_gate: torch.Tensor
    coord_nonfinite: int
    s_fp: torch.Tensor
    n_fp: int

    def metric_sums(self, fp_weight: float = 0.0) -> dict[str, float]:
        """Detached sums and counts under the names :mod:`learner.metrics` aggregates; ``fp_weight``
        (``stage2.loss.fp_unlikelihood_weight``) weighs the unlikelihood's share of ``loss/total``."""
        s_fp = float(self.s_fp.detach())
        return {
            "loss/sum_ce": float(self.s_ce.detach()),
            "loss/count_ce": float(self.n_ce),
            "loss/sum_ce_eos": float(self.s_ce_eos),
            "loss/count_ce_eos": float(self.n_ce_eos),
            "loss/sum_coord": float(self.s_coord.detach()),
            "loss/count_coord": float(self.n_coord),
            "loss/sum_coord_prefix": float(self.s_coord_prefix),
            "loss/count_coord_prefix": float(self.n_coord_prefix),
            "loss/sum_coord_tail": float(self.s_coord_tail),
            "loss/count_coord_tail": float(self.n_coord_tail),
            "loss/sum_coord_softce": float(self.s_coord_softce),
            "loss/sum_coord_w1": float(self.s_coord_w1),
            "loss/sum_coord_gate": float(self.s_coord_gate),
            "loss/coord_nonfinite": float(self.coord_nonfinite),
            "loss/sum_fp_unlikelihood": s_fp,
            "loss/sum_fp_unlikelihood_weighted": fp_weight * s_fp,
            "loss/count_fp_unlikelihood": float(self.n_fp),
        }


def step_loss_sums(
    logits: torch.Tensor,
    batch: LossInputs,
    *,
    coord_ids: torch.Tensor,
    coord_cfg: CoordLossConfig,
    eos_id: int | None,
    columns: torch.Tensor | None = None,
) -> LossSums:
    """CE, coordinate-loss and false-positive unlikelihood sums of one micro-batch (§13.1, §13.2, §13.5).

    Works identically on a packed row (``B == 1``) and on right-padded rows: all positions are
    absolute in the ``[B, T]`` layout, and §14.6 guarantees ``p - 1`` lies in the slot's segment.
    A batch without false-positive tokens (the loss off, or none in its rollouts) gives ``s_fp = 0``.
    A compact forward (logits at ``columns`` only) gives the same sums as a full one.

    Args:
        logits: ``[B, T, V]`` model output (any float dtype), or ``[B, K, V]`` at ``columns``.
        batch: labels and coord slots (see :class:`LossInputs`).
        coord_ids: ``[1000]`` coord token ids in bin order.
        coord_cfg: coordinate-loss knobs.
        eos_id: end-of-turn id for the ``loss/ce_eos`` split (None: no split).
        columns: ``[K]`` positions of compact logits (:func:`read_columns` of this batch); None = all.

    Returns:
        :class:`LossSums`.
    """
    device = logits.device
    columns = columns.to(device) if columns is not None else None
    ce = ce_sum(logits, batch.labels.to(device), eos_id, columns)
    pos = batch.coord_pos.to(device)
    k = int(pos.numel())
    if k:
        read_at = pos - 1 if columns is None else torch.searchsorted(columns, pos - 1)
        rows = logits[batch.coord_batch_idx.to(device), read_at]
        terms = coord_loss_terms(rows, batch.coord_bins.to(device), coord_ids, coord_cfg)
        s_coord = terms.total.sum()
        is_prefix = batch.coord_is_prefix.to(device=device, dtype=torch.bool)
        detached = terms.total.detach()
        n_prefix = int(is_prefix.sum())
        s_prefix, s_tail = detached[is_prefix].sum(), detached[~is_prefix].sum()
        softce, w1, gate = (t.detach().sum() for t in (terms.softce, terms.w1, terms.gate))
        nonfinite = int(terms.nonfinite.sum())
    else:
        # Keep the graph connected to the logits so backward works even without coord slots.
        s_coord = logits.sum() * 0.0
        n_prefix = 0
        s_prefix = s_tail = softce = w1 = gate = s_coord.detach()
        nonfinite = 0
    fp_pos = batch.fp_pos.to(device)
    n_fp = int(fp_pos.numel())
    if n_fp:
        read_at = fp_pos - 1 if columns is None else torch.searchsorted(columns, fp_pos - 1)
        rows = logits[batch.fp_batch_idx.to(device), read_at]
        s_fp = fp_unlikelihood_terms(rows, batch.fp_ids.to(device)).sum()
    else:
        s_fp = s_coord.detach() * 0.0
    return LossSums(
        s_ce=ce.total,
        n_ce=ce.count,
        s_coord=s_coord,
        n_coord=k,
        s_ce_eos=ce.eos_total,
        n_ce_eos=ce.eos_count,
        s_coord_prefix=s_prefix,
        n_coord_prefix=n_prefix,
        s_coord_tail=s_tail,
        n_coord_tail=k - n_prefix,
        s_coord_softce=softce,
        s_coord_w1=w1,
        s_coord_gate=gate,
        coord_nonfinite=nonfinite,
        s_fp=s_fp,
        n_fp=n_fp,
    )


def micro_loss(
    sums: LossSums,
    n_ce_total: int,
    n_coord_total: int,
    world_size: int,
    normalization: Literal["token_weighted", "micro_mean"],
    gas: int,
    *,
    n_fp_total: int = 0,
    fp_weight: float = 0.0,
) -> torch.Tensor:
    """The loss to call ``backward`` on for one micro-step (§13.3, §13.5).

    token_weighted: ``world_size · (S_ce_m / max(N_ce, 1) + S_coord_m / max(N_coord, 1))`` where
    ``N_*`` are summed over all micro-steps of the optimizer step AND all DP ranks; the factor cancels
    the DP gradient average, so the accumulated gradient equals the gradient of
    ``L_step = ΣS_ce / max(N_ce, 1) + ΣS_coord / max(N_coord, 1)``. Pass ``world_size=1`` when
    gradients are summed rather than averaged over ranks.

    micro_mean: ``(S_ce_m / max(n_ce_m, 1) + S_coord_m / max(n_coord_m, 1)) / gas`` (the step totals are
    ignored).

    With ``fp_weight`` > 0 both add the false-positive unlikelihood the same way: ``w · S_fp_m / N_fp``
    (token_weighted, inside the world-size factor) or ``w · S_fp_m / n_fp_m / gas`` (micro_mean); a step or
    micro-step without false-positive tokens adds nothing (never a division by zero).

    Args:
        sums: this micro-step's sums.
        n_ce_total: step-global N_ce (all micro-steps, all ranks).
        n_coord_total: step-global N_coord.
        world_size: number of DP ranks averaging gradients.
        normalization: ``stage2.loss.normalization``.
        gas: gradient-accumulation steps of the optimizer step (micro_mean only).
        n_fp_total: step-global N_fp (token_weighted).
        fp_weight: ``stage2.loss.fp_unlikelihood_weight``.

    Raises:
        ValueError: unknown normalization, or a non-positive world_size / gas.
    """
    if world_size < 1 or gas < 1:
        raise ValueError(f"micro_loss needs world_size >= 1 and gas >= 1, got {world_size} and {gas}")
    if normalization == "token_weighted":
        loss = sums.s_ce / max(n_ce_total, 1) + sums.s_coord / max(n_coord_total, 1)
        if fp_weight > 0 and n_fp_total > 0:
            loss = loss + fp_weight * sums.s_fp / n_fp_total
        return world_size * loss
    if normalization == "micro_mean":
        loss = sums.s_ce / max(sums.n_ce, 1) + sums.s_coord / max(sums.n_coord, 1)
        if fp_weight > 0 and sums.n_fp > 0:
            loss = loss + fp_weight * sums.s_fp / sums.n_fp
        return loss / gas
    raise ValueError(
        f"stage2.loss.normalization={normalization!r} is not supported; use token_weighted or micro_mean"
    )


def zero_loss(model: torch.nn.Module) -> torch.Tensor:
    """``0 · Σ p.sum()`` over trainable parameters, for an empty micro-step (§14.7).

    Its backward produces zero gradients on every trainable parameter, so DP gradient reduction stays
    aligned with ranks that had data.

    Raises:
        ValueError: the model has no trainable parameter.
    """
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError(
            "zero_loss: the model has no parameter with requires_grad=True; nothing to keep DP in step with"
        )
    total = params[0].sum().float()
    for p in params[1:]:
        total = total + p.sum().float().to(total.device)
    return total * 0.0
