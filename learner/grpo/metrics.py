"""GRPO step metrics (docs/ALGORITHM.md#grpo-metrics) as pure functions, and the log-interval accumulator.

Step-level values (rewards, advantages, completion lengths, dynamic sampling) are computed from the whole
generation batch, identically on every rank. Micro-batch values (KL, clip ratio, importance ratio) are
per rank: :class:`MetricWindow` keeps sums and counts so the trainer can all-reduce them before averaging.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from learner.grpo.rollouts import Group

__all__ = [
    "MetricWindow",
    "advantage_metrics",
    "completion_metrics",
    "record_importance_ratio",
    "record_tis",
    "reward_metrics",
]


def _mean(values: Sequence[float]) -> float:
    return float(sum(values) / len(values)) if values else 0.0


def _std(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mean = _mean(values)
    return math.sqrt(sum((v - mean) ** 2 for v in values) / (len(values) - 1))


def reward_metrics(groups: Sequence[Group], first_round: Sequence[float]) -> dict[str, float]:
    """``reward/<name>/mean`` (raw values) for every configured reward, ``reward/total_mean`` and
    ``reward/total_std`` over the trained batch, and ``reward/first_round_total_mean`` over the regular round
    (before dynamic sampling picks groups: the unbiased view of the policy, used for reward curves)."""
    totals = [r for g in groups for r in g.rewards]
    out = {"reward/total_mean": _mean(totals), "reward/total_std": _std(totals)}
    names = list(groups[0].per_reward) if groups else []
    for name in names:
        out[f"reward/{name}/mean"] = _mean([v for g in groups for v in g.per_reward[name]])
    out["reward/first_round_total_mean"] = _mean(list(first_round))
    return out


def advantage_metrics(advantages: torch.Tensor) -> dict[str, float]:
    """``advantages/{mean,std,abs_max}`` (unbiased std)."""
    adv = advantages.detach().double()
    return {
        "advantages/mean": float(adv.mean()) if adv.numel() else 0.0,
        "advantages/std": float(adv.std()) if adv.numel() > 1 else 0.0,
        "advantages/abs_max": float(adv.abs().max()) if adv.numel() else 0.0,
    }


def completion_metrics(groups: Sequence[Group]) -> dict[str, float]:
    """``completions/{mean_length,max_length,truncated_ratio}`` in tokens over the trained batch."""
    lengths = [len(c.token_ids) for g in groups for c in g.completions]
    truncated = [c.truncated for g in groups for c in g.completions]
    return {
        "completions/mean_length": _mean(lengths),
        "completions/max_length": float(max(lengths, default=0)),
        "completions/truncated_ratio": _mean([float(t) for t in truncated]),
    }


class MetricWindow:
    """Metrics of the optimizer steps since the last log.

    ``add_step`` records one step's step-level metrics (averaged over the steps of the window);
    ``add_sum`` accumulates ``(sum, count)`` of per-rank micro-batch values (averaged as Σsum/Σcount after
    the trainer's all-reduce); ``add_max`` keeps a maximum (times: a step lasts as long as its slowest rank).
    """

    def __init__(self) -> None:
        self.steps: list[dict[str, float]] = []
        self.sums: dict[str, list[float]] = {}
        self.maxima: dict[str, float] = {}

    def add_step(self, metrics: Mapping[str, float]) -> None:
        self.steps.append(dict(metrics))

    def add_sum(self, key: str, total: float, count: float = 1.0) -> None:
        acc = self.sums.setdefault(key, [0.0, 0.0])
        acc[0] += float(total)
        acc[1] += float(count)

    def add_max(self, key: str, value: float) -> None:
        self.maxima[key] = max(self.maxima.get(key, float("-inf")), float(value))

    def reduce_vector(self) -> tuple[list[str], list[float], list[str], list[float]]:
        """``(sum_keys, [sum, count, ...], max_keys, [max, ...])`` in sorted key order (the same on every rank
        as long as every rank recorded the same keys)."""
        sum_keys = sorted(self.sums)
        max_keys = sorted(self.maxima)
        flat = [v for k in sum_keys for v in self.sums[k]]
        return sum_keys, flat, max_keys, [self.maxima[k] for k in max_keys]

    def finalize(
        self, reduced_sums: Iterable[float] | None = None, reduced_maxima: Iterable[float] | None = None
    ) -> dict[str, float]:
        """The window's metrics, then resets. ``reduced_*`` replace the local vectors (after all-reduce)."""
        sum_keys, flat, max_keys, maxima = self.reduce_vector()
        flat = list(reduced_sums) if reduced_sums is not None else flat
        maxima = list(reduced_maxima) if reduced_maxima is not None else maxima
        out: dict[str, float] = {}
        keys = sorted({k for step in self.steps for k in step})
        for key in keys:
            values = [step[key] for step in self.steps if key in step]
            out[key] = _mean(values)
        for i, key in enumerate(sum_keys):
            total, count = flat[2 * i], flat[2 * i + 1]
            out[key] = total / count if count else 0.0
        out.update(dict(zip(max_keys, maxima, strict=True)))
        self.steps, self.sums, self.maxima = [], {}, {}
        return out


def record_importance_ratio(
    window: MetricWindow, logps: torch.Tensor, inputs: Mapping[str, Any], mask: torch.Tensor
) -> None:
    """The rollout-vs-learner mismatch: ``exp(log π_learner − log π_server)`` per token over tokens with
    server log-probs (1 = no mismatch), and the absolute log-prob difference (mean, max)."""
    server_mask = inputs["server_logprobs_mask"] * mask
    count = float(server_mask.sum())
    diff = (logps - inputs["server_logprobs"]) * server_mask
    window.add_sum("sampling/importance_ratio_mean", float((torch.exp(diff) * server_mask).sum()), count)
    window.add_sum("sampling/logp_abs_diff_mean", float(diff.abs().sum()), count)
    window.add_max("sampling/logp_abs_diff_max", float(diff.abs().max()) if count else 0.0)


def record_tis(window: MetricWindow, weights: torch.Tensor, mask: torch.Tensor, cap: float) -> None:
    """Truncated importance-sampling weights over completion tokens: their mean, the fraction at the cap."""
    tokens = mask.to(weights.dtype)
    count = float(tokens.sum())
    window.add_sum("sampling/tis_weight_mean", float((weights * tokens).sum()), count)
    window.add_sum(
        "sampling/tis_capped_frac", float(((weights >= cap).to(weights.dtype) * tokens).sum()), count
    )
