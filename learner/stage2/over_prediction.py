"""A one-time warning when rollout-matching makes the model over-predict (docs/RUNBOOK.md §4).

With the spec's `stage2.targets.unmatched_prefix: keep`, false positives stay in the teacher-forced prefix
and the stop is only supervised after them; a checkpoint that over-predicts then learns to stop later and
over-predicts more, and held-out F1 falls (measured on the image demo). The run cannot tell the user's
intent, so it does not switch anything: it says, once, what the logged counts show and which knob fixes it.
"""

from __future__ import annotations

from collections.abc import Mapping

__all__ = ["OverPredictionAlarm"]


class OverPredictionAlarm:
    """Fires once when `rollout/pred_per_sample` exceeds `ratio` × `rollout/gt_per_sample` on `steps`
    consecutive logged training steps while `unmatched_prefix` is `keep`.

    Steps without rollouts (plain-GT warm-up, buffered M-steps) neither count nor reset the streak.
    Replayed on the metrics.jsonl of the runs behind the `unmatched_prefix` figures (ratio 1.3, 3 steps): it
    fires at step 13 of the image demo's rollout-matching-from-step-0 run with `keep` (313 predicted objects
    for 149 GT at step 10) and at step 184 of `make demo` with `keep` + `canonical_seam` (F1 0.61 → 0.48),
    and never on the text demo (which under-predicts; `keep` is right there) nor on the `drop` runs.
    """

    def __init__(self, unmatched_prefix: str, *, ratio: float = 1.3, steps: int = 3) -> None:
        self.enabled = unmatched_prefix == "keep"
        self.ratio = ratio
        self.steps = steps
        self._streak = 0
        self.fired = False

    def observe(self, logs: Mapping[str, float]) -> str | None:
        """Feeds one training log record; returns the warning text the first time the condition holds."""
        if not self.enabled or self.fired:
            return None
        pred, gt = logs.get("rollout/pred_per_sample"), logs.get("rollout/gt_per_sample")
        if pred is None or not gt:
            return None
        self._streak = self._streak + 1 if pred > self.ratio * gt else 0
        if self._streak < self.steps:
            return None
        self.fired = True
        return (
            f"rollout-matching is making the model over-predict: rollout/pred_per_sample {pred:.2f} against"
            f" rollout/gt_per_sample {gt:.2f} (above {self.ratio:g}x for {self.steps} logged steps in a row)."
            " With stage2.targets.unmatched_prefix: keep (the spec) false positives stay in the"
            " teacher-forced prefix and the model is taught to stop only after them; set stage2.targets:"
            " {unmatched_prefix: reorder} (or drop), or train more plain-GT steps first"
            " (stage2.sft_warmup_steps) — docs/RUNBOOK.md, 'The model over-predicts during rollout-matching'"
        )
