"""Trainer callbacks: metrics JSONL and a live tqdm bar (loss / F1 / step-time split)."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm
from transformers import TrainerCallback

from learner.environment import environment, environment_line

__all__ = ["LiveProgressCallback", "MetricsJsonlCallback", "OverlapCallback"]

logger = logging.getLogger(__name__)


class OverlapCallback(TrainerCallback):
    """Drops the background rollout still outstanding when training ends (`rollout.async`): no step will train
    it, and a resumed run requests that window again with the same seeds."""

    def __init__(self, overlap: Any) -> None:
        self.overlap = overlap

    def on_train_end(self, args, state, control, **kwargs) -> None:
        self.overlap.close()


class MetricsJsonlCallback(TrainerCallback):
    """Appends every log record (train and eval) as one JSON line to `<output_dir>/metrics.jsonl`.

    Each line holds `step`, `epoch`, `wall_s` (since training began) and the logged values; numbers that
    are not finite are written as null so the file stays valid JSON. At the start of training (and of a
    resumed run) one line ``{"step": ..., "environment": {...}}`` records the packages, CPU and GPUs
    (`learner.environment`), and the same goes to the log.
    """

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._t0 = time.perf_counter()

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if not state.is_world_process_zero:
            return
        logger.info(environment_line())
        with self.path.open("a") as fh:
            fh.write(json.dumps({"step": state.global_step, "environment": environment()}) + "\n")

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not state.is_world_process_zero or not logs:
            return
        record: dict[str, Any] = {
            "step": state.global_step,
            "epoch": state.epoch,
            "wall_s": round(time.perf_counter() - self._t0, 3),
        }
        for key, value in logs.items():
            if isinstance(value, float) and not math.isfinite(value):
                value = None
            record[key] = value
        with self.path.open("a") as fh:
            fh.write(json.dumps(record) + "\n")


class LiveProgressCallback(TrainerCallback):
    """A tqdm bar over optimizer steps whose postfix shows loss, last eval F1, the step-time split and the
    learner's tokens/s and MFU.

    Replaces HF's own progress callback (remove `ProgressCallback` when adding this one).
    """

    def __init__(self) -> None:
        self.bar: tqdm | None = None
        self.postfix: dict[str, str] = {}

    def on_train_begin(self, args, state, control, **kwargs) -> None:
        if state.is_world_process_zero:
            self.bar = tqdm(
                total=state.max_steps, desc="train", dynamic_ncols=True, initial=state.global_step
            )

    def on_step_end(self, args, state, control, **kwargs) -> None:
        if self.bar is not None:
            self.bar.update(state.global_step - self.bar.n)

    def on_log(self, args, state, control, logs: dict[str, Any] | None = None, **kwargs) -> None:
        if not logs:
            return
        if "loss" in logs:
            self.postfix["loss"] = f"{logs['loss']:.3f}"
            gen = logs.get("time/rollout_generate_s")
            fwd = logs.get("time/forward_s")
            sync = logs.get("time/weight_sync_s")
            if gen is not None and fwd is not None:
                self.postfix["gen/fwd/sync s"] = f"{gen:.2f}/{fwd:.2f}/{(sync or 0):.2f}"
            if logs.get("rollout/prefetched"):  # rollout.async: the generation ran in the background
                self.postfix["wait s"] = f"{logs.get('time/rollout_wait_s') or 0:.2f}"
                self.postfix["stale"] = f"{logs.get('rollout/staleness_max') or 0:.0f}"
            if "rollout/f1" in logs:
                self.postfix["train_f1"] = f"{logs['rollout/f1']:.2f}"
            if "perf/tokens_per_s" in logs:  # the learner's forward + backward (learner.flops)
                self.postfix["tok/s"] = f"{logs['perf/tokens_per_s']:.0f}"
                if "perf/mfu" in logs:
                    self.postfix["mfu"] = f"{100 * logs['perf/mfu']:.1f}%"
        if "eval_rollout_f1" in logs:
            self.postfix["eval_f1"] = f"{logs['eval_rollout_f1']:.3f}"
        if self.bar is not None:
            self.bar.set_postfix(self.postfix, refresh=True)
        elif "eval_rollout_f1" in logs and state.is_world_process_zero:
            tqdm.write(f"[eval] step {state.global_step}: eval_rollout_f1 = {logs['eval_rollout_f1']:.3f}")

    def on_train_end(self, args, state, control, **kwargs) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None
