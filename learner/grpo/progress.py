"""A tqdm bar for GRPO runs: loss, mean reward, the step-time split (generate / reward / fwd-bwd / sync)."""

from __future__ import annotations

from typing import Any

from learner.trainers.callbacks import LiveProgressCallback

__all__ = ["GrpoProgressCallback"]


class GrpoProgressCallback(LiveProgressCallback):
    """``LiveProgressCallback`` whose postfix shows the GRPO metrics of §7 (replaces HF's progress bar)."""

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not logs or "loss" not in logs:
            return
        self.postfix["loss"] = f"{logs['loss']:.3f}"
        if "reward/first_round_total_mean" in logs:
            self.postfix["reward"] = f"{logs['reward/first_round_total_mean']:.2f}"
        split = [
            logs.get(f"time/{k}") for k in ("generate_s", "reward_s", "forward_backward_s", "weight_sync_s")
        ]
        if all(v is not None for v in split):
            self.postfix["gen/rew/fb/sync s"] = "/".join(f"{v:.2f}" for v in split)
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=True)
