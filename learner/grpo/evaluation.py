"""Held-out evaluation of a GRPO run with the rollout-matching evaluator (docs/GRPO.md "Held-out evaluation").

The samples, the requests, the parser, the matcher and the metrics are those of the rollout-matching trainer
and of ``python -m learner.evaluate``: ``data.eval`` loaded by ``learner.trainers.build.load_samples`` and cut
to ``data.max_eval_samples``, then ``StepPlanner.evaluate`` → ``learner.stage2.pipeline.evaluate_rollout`` →
``eval_metrics`` (``eval_rollout_f1`` at the matching gate, precision, recall, F1 at maskIoU 0.5 / 0.75,
duplicates, predicted ÷ GT, ...). Nothing here scores a rollout.

Decoding: ``rollout.decoding`` (which a GRPO run fills from ``grpo.*``: ``max_completion_length``,
``repetition_penalty``, ...) with the ``stage2.eval`` overrides; the temperature is
``stage2.eval.temperature`` when set, else 0 (greedy), never GRPO's sampling temperature. So a GRPO run
evaluates exactly like a rollout-matching run whose ``rollout.decoding`` has the same ``max_new_tokens`` and
``repetition_penalty``.

Invariant: request ``i`` of the held-out list has index ``i`` and the seed ``request_seed(training.seed, 0, 0,
i)`` (``StepPlanner.evaluate``), whatever the step; the GRPO trainer syncs its weights to the rollout source
before calling :meth:`HeldOutEval.evaluate`.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from learner.config import RunConfig
from learner.rollout.base import RolloutSource
from learner.stage2.pipeline import eval_metrics
from learner.trainers.build import load_samples, sample_context
from learner.trainers.planner import StepPlanner

__all__ = ["HeldOutEval", "build_heldout_eval"]

GREEDY = 0.0
"""Evaluation temperature when ``stage2.eval.temperature`` is unset (GRPO's ``rollout.decoding`` samples)."""


@dataclass
class HeldOutEval:
    """The held-out samples and the planner that evaluates them (module docstring).

    Attributes:
        planner: a ``StepPlanner`` on the run's rollout source (rank 0's view: rank 0, world 1).
        samples: the held-out sample dicts (``load_samples`` of ``data.eval``, ``data.max_eval_samples``).
        max_new_tokens: ``stage2.eval.max_new_tokens`` (None: ``rollout.decoding.max_new_tokens``).
        temperature: ``stage2.eval.temperature``, else 0.
    """

    planner: StepPlanner
    samples: Sequence[dict[str, Any]]
    max_new_tokens: int | None
    temperature: float

    def evaluate(self, prefix: str = "eval") -> dict[str, float]:
        """Rolls out every held-out sample in one call and returns the ``{prefix}_rollout_*`` metrics."""
        started = time.perf_counter()
        sums = self.planner.evaluate(
            self.samples,
            batch_size=max(len(self.samples), 1),
            max_new_tokens=self.max_new_tokens,
            temperature=self.temperature,
        )
        runtime = time.perf_counter() - started
        return eval_metrics(sums, n_samples=len(self.samples), runtime_s=runtime, prefix=prefix)


def build_heldout_eval(
    cfg: RunConfig, source: RolloutSource, tokenizer: Any, encoder: Any
) -> HeldOutEval | None:
    """The run's held-out evaluation, or None when ``data.eval`` lists no file.

    Args:
        cfg: the run's learner ``RunConfig`` (``data``, ``prompts``, ``stage2``, ``rollout.decoding``,
            ``training.seed``: the held-out requests' seeds).
        source: the rollout source the run trains with (server client or colocated engine).
        tokenizer: the policy tokenizer.
        encoder: the run's ``PromptEncoder`` (a colocated HF engine encodes the held-out images with it).
    """
    if not cfg.data.eval:
        return None
    samples = load_samples(cfg.data.eval, cfg)[: cfg.data.max_eval_samples]
    eval_cfg = cfg.stage2.eval
    ctx = sample_context(cfg, tokenizer, encoder)
    planner = StepPlanner.from_config(cfg, source, ctx, batch_size=max(len(samples), 1))
    temperature = eval_cfg.temperature if eval_cfg.temperature is not None else GREEDY
    return HeldOutEval(planner, samples, eval_cfg.max_new_tokens, temperature)
