"""One GRPO generation step on the rank that talks to the server (docs/ALGORITHM.md#grpo, §3.4, §3.6).

:class:`GroupGenerator` turns the step's prompts into scored groups: one ``/infer/`` call with
``n = num_generations`` per prompt, results grouped by prompt index (checked by request id), total rewards,
then dynamic sampling — zero-variance groups are replaced by groups of new prompts generated with the same
weights, for at most ``max_resample_times`` extra rounds, the rest filled with the last round's
zero-variance groups.

Resample prompts come from :class:`ResamplePool`, a stateless seeded draw over the prompt set keyed by
``(seed, step, round)``. The Trainer's dataloader cannot be asked for extra rows (its length fixes the step
count and the checkpoint position), so a keyed draw is what keeps a resumed run identical.

The class holds no torch and no ``torch.distributed``: the trainer calls it on rank 0 only and broadcasts
the result. The :class:`~learner.rollout.base.RolloutSource` is injected (a fake in the unit tests).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from learner.grpo.data import PromptRow
from learner.grpo.dynamic_sampling import DynamicSampleResult, dynamic_sample
from learner.grpo.rollouts import Group, build_infer_batch, group_results
from learner.rewards.detection import DetectionScorer
from learner.rewards.registry import total_reward
from learner.rewards.summary_schema import SummarySchemas
from learner.rollout.base import RolloutSource
from shared_schemas.infer import RequestConfig

__all__ = ["GroupGenerator", "ResamplePool", "StepRollout"]

logger = logging.getLogger(__name__)


class ResamplePool:
    """Deterministic resample prompts: ``draw(step, round, k)`` picks ``k`` distinct rows (with repeats only
    when ``k`` exceeds the prompt count), keyed by ``(seed, step, round)`` so it never depends on history."""

    def __init__(self, rows: Sequence[PromptRow], seed: int) -> None:
        if not rows:
            raise ValueError("ResamplePool needs at least one prompt row")
        self.rows = list(rows)
        self.seed = seed

    def draw(self, global_step: int, round_index: int, k: int) -> list[PromptRow]:
        rng = random.Random(f"grpo-resample:{self.seed}:{global_step}:{round_index}")
        picked: list[PromptRow] = []
        while len(picked) < k:
            picked.extend(rng.sample(self.rows, min(k - len(picked), len(self.rows))))
        return picked


@dataclass
class StepRollout:
    """What one generation step produced (rank 0), ready to broadcast.

    Attributes:
        groups: exactly ``prompts_per_step`` scored groups; slot ``p`` of the step trains on ``groups[p]``.
        zero_var_groups, resample_rounds, filled_with_zero_var: the §3.4 metrics.
        first_round_rewards: total rewards of the regular round (an unbiased view of the current policy,
            before dynamic sampling selects groups).
        requests: generate requests sent (all rounds); completions = ``requests × G``.
        infer_calls: ``RolloutSource.infer`` calls (one per round).
        generate_s: wall time inside ``infer``.
        reward_s: wall time computing rewards.
        staleness: optimizer steps between the weights that generated it and the step that trains on it
            (`rollout.async`; 0 when generated at the step itself).
    """

    groups: list[Group]
    zero_var_groups: int = 0
    resample_rounds: int = 0
    filled_with_zero_var: int = 0
    first_round_rewards: list[float] = field(default_factory=list)
    requests: int = 0
    infer_calls: int = 0
    generate_s: float = 0.0
    reward_s: float = 0.0
    staleness: int = 0

    def dynamic_sample_metrics(self) -> dict[str, float]:
        return {
            "dynamic_sample/zero_var_groups": float(self.zero_var_groups),
            "dynamic_sample/resample_rounds": float(self.resample_rounds),
            "dynamic_sample/filled_with_zero_var": float(self.filled_with_zero_var),
        }


class GroupGenerator:
    """Generates and scores one step's groups (see the module docstring).

    Args:
        source: where completions come from.
        config: the request config (``n = num_generations``; from ``rollouts.request_config``).
        reward_weights: reward name → weight (§5.3; weight 0 = logged only).
        schemas: domain schemas for ``summary.schema_tree`` (None when not configured).
        seed: ``training.seed`` (per-request seeds, §1).
        resample_pool: where dynamic sampling draws new prompts.
        dynamic_sample: ``grpo.dynamic_sample``.
        max_resample_times: ``grpo.max_resample_times``.
        detection: the detection scorer (policy tokenizer, ``stage2.matching``) when a ``detection.*`` reward
            is configured; it parses the completions' sampled token ids.
    """

    def __init__(
        self,
        *,
        source: RolloutSource,
        config: RequestConfig,
        reward_weights: Mapping[str, float],
        schemas: SummarySchemas | None,
        seed: int,
        resample_pool: ResamplePool,
        dynamic_sample: bool = True,
        max_resample_times: int = 1,
        detection: DetectionScorer | None = None,
    ) -> None:
        if config.n < 2:
            raise ValueError(f"GRPO needs n = num_generations >= 2 completions per prompt, got {config.n}")
        self.source = source
        self.config = config
        self.reward_weights = dict(reward_weights)
        self.schemas = schemas
        self.seed = seed
        self.resample_pool = resample_pool
        self.dynamic_sample = dynamic_sample
        self.max_resample_times = max_resample_times
        self.detection = detection

    def generate_step(self, prompts: Sequence[PromptRow], global_step: int) -> StepRollout:
        """Generates, scores and selects the step's groups (§1, §3.4, §3.6).

        Args:
            prompts: the step's prompts in generation-batch order (prompt index ``p`` = position).
            global_step: the optimizer step (seeds and request ids).

        Returns:
            :class:`StepRollout` with ``len(prompts)`` groups.
        """
        out = StepRollout(groups=[])
        regular = self._round(prompts, global_step, first_index=0, out=out)
        out.first_round_rewards = [r for g in regular for r in g.rewards]
        next_index = len(prompts)

        def resample(num_groups: int, round_index: int) -> list[Group]:
            nonlocal next_index
            rows = self.resample_pool.draw(global_step, round_index, num_groups)
            groups = self._round(rows, global_step, first_index=next_index, out=out)
            next_index += num_groups
            return groups

        result: DynamicSampleResult[Group] = dynamic_sample(
            regular, resample, max_resample_times=self.max_resample_times, enabled=self.dynamic_sample
        )
        out.groups = result.groups
        out.zero_var_groups = result.zero_var_groups
        out.resample_rounds = result.resample_rounds
        out.filled_with_zero_var = result.filled_with_zero_var
        return out

    def _round(
        self, rows: Sequence[PromptRow], global_step: int, *, first_index: int, out: StepRollout
    ) -> list[Group]:
        batch = build_infer_batch(
            rows, global_step=global_step, first_index=first_index, seed=self.seed, config=self.config
        )
        started = time.perf_counter()
        results = self.source.infer(batch)
        out.generate_s += time.perf_counter() - started
        out.infer_calls += 1
        out.requests += len(rows)
        groups = group_results(batch, results, rows, global_step=global_step)
        started = time.perf_counter()
        self.score(groups)
        out.reward_s += time.perf_counter() - started
        return groups

    def score(self, groups: Sequence[Group]) -> None:
        """Fills ``rewards`` and ``per_reward`` of every group (total reward of §3.6)."""
        texts = [c.text for g in groups for c in g.completions]
        token_ids = [c.token_ids for g in groups for c in g.completions]
        reward_rows = [g.row.reward_row for g in groups for _ in g.completions]
        totals, per_reward = total_reward(
            texts,
            reward_rows,
            self.reward_weights,
            schemas=self.schemas,
            token_ids=token_ids,
            detection=self.detection,
        )
        start = 0
        for group in groups:
            stop = start + len(group.completions)
            group.rewards = totals[start:stop]
            group.per_reward = {name: values[start:stop] for name, values in per_reward.items()}
            start = stop
