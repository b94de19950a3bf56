"""Rollout-matching SFT on HF `Trainer` (docs/ALGORITHM.md#training-step, docs/ARCHITECTURE.md#weight-sync).

Extension points used, and why:
- `get_batch_samples` — HF fetches the whole accumulation window here before the first forward; that is
  exactly where §13.3 needs the step planned (all rollouts, all packs, the step-global `(N_ce, N_coord)`)
  before any backward. We read the raw micro-batches from HF's epoch iterator as `super()` would (through a
  `WindowLookahead`, so that `rollout.async` can request the next window's rollouts ahead), then plan (E-step)
  or replay the rollout buffer's cache (M-step) and return prepared micro-batches.
- `compute_loss` — one forward per prepared micro-batch, sum-form CE + coordinate losses, token-weighted
  normalisation; `loss_is_scaled_for_ga = True` because the loss is already normalised for the window.
- `evaluate` — rollout-only evaluation (no teacher forcing, no loss), reporting `eval_rollout_*`.
- `training_step` — calls `super()` and only times it (`time/backward_s`).
- `log` — merges the step's rollout/loss/packing/time metrics, then `super().log`.

The data order (shuffle + rollout-buffer repetition) lives in `RepeatedWindowDataset`; the trainer samples
it sequentially, so checkpoint/resume continues with no sample skipped or repeated.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch
from transformers import Trainer

from learner.device_memory import peak_memory_metrics
from learner.flops import FlopModel, peak_tflops, utilization
from learner.kernels import packed_attention
from learner.metrics import StepMetrics
from learner.rollout.colocate.offload import offload_context
from learner.stage2.losses import StepCounts, zero_loss
from learner.stage2.over_prediction import OverPredictionAlarm
from learner.stage2.pipeline import eval_metrics
from learner.stage2.rollout_reuse import RolloutBuffer, TaggedBatch
from learner.stage2.step import micro_step_loss
from learner.trainers.callbacks import OverlapCallback
from learner.trainers.eval_gallery import EvalGallery
from learner.trainers.overlap import RolloutOverlap, Rollouts, WindowLookahead
from learner.trainers.planner import StepPlanner
from learner.weights.sync import WeightSyncPolicy

__all__ = ["RolloutMatchingTrainer"]

logger = logging.getLogger(__name__)


class RolloutMatchingTrainer(Trainer):
    """HF `Trainer` whose micro-batches are planned from fresh (or buffered) rollouts.

    Args:
        planner: builds prepared micro-batches from raw samples (owns the `RolloutSource`).
        weight_sync: the once-per-step sync policy.
        rollout_buffer: E/M-step state machine.
        run_cfg: the validated `RunConfig` (stage2 knobs, eval decoding overrides).
        eval_samples: held-out sample dicts for the rollout-only evaluation.
        gallery: draws the fixed held-out images at every evaluation (`stage2.eval.gallery_images`); None:
            no pictures.
        overlap: where each step's rollouts come from (background or now; `rollout.async`);
            synchronous by default.
        **kwargs: passed to `Trainer` (model, args, train_dataset, data_collator, callbacks, ...).
    """

    loss_is_scaled_for_ga = True

    def __init__(
        self,
        *,
        planner: StepPlanner,
        weight_sync: WeightSyncPolicy,
        rollout_buffer: RolloutBuffer,
        run_cfg: Any,
        eval_samples: list[dict[str, Any]] | None = None,
        overlap: RolloutOverlap | None = None,
        gallery: EvalGallery | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.overlap = overlap or RolloutOverlap(lambda batch: planner.source.infer(batch), endpoints=())
        self.lookahead = WindowLookahead()
        self.add_callback(OverlapCallback(self.overlap))
        self.planner = planner
        self.weight_sync = weight_sync
        self.rollout_buffer = rollout_buffer
        self.run_cfg = run_cfg
        self.eval_samples = eval_samples or []
        self.gallery = gallery if gallery is not None and gallery.enabled else None
        self.coord_ids = torch.tensor(planner.ctx.coord_vocab.ids, dtype=torch.long)
        self._last_forward_s = 0.0
        self._flop_model: FlopModel | None = None
        self._peak_tflops: float | None = None
        self.step_metrics = StepMetrics(reduce_fn=self._reduce_metrics if self.args.world_size > 1 else None)
        self.over_prediction = OverPredictionAlarm(planner.ctx.targets.unmatched_prefix)

    # -- step planning ------------------------------------------------------------------------------
    def get_batch_samples(self, epoch_iterator, num_batches, device):  # noqa: D401 - HF signature
        """Fetch the window's raw micro-batches, then plan or replay the whole optimizer step.

        Order within a step (one code path; `rollout.async` only adds the launch): this step's rollouts (the
        background results requested a step or more ago, or — after this step's lazy §5.6 sync — generated
        now), then, with async on, this step's sync (right after the previous optimizer step) and the next
        window's background request, which waits for its commit; then parse/match/pack and train.
        """
        raws = self.lookahead.next(epoch_iterator, num_batches)
        tagged = [_tag(raw) for raw in raws]
        decision = self.rollout_buffer.begin_step(tagged, training=True)
        step = self.state.global_step
        launch = self._next_launch(epoch_iterator, step, decision)
        rollouts = None
        if not decision.reuse:
            self.planner.new_window()
            rollouts = self._fetch([t.batch for t in tagged], step)
        if launch is not None:
            # The sync of this step (a no-op when this step's own rollouts needed it already), then the next
            # window's request, which the server serves only after that commit.
            self.step_metrics.add_time("time/weight_sync_s", self._sync_now())
            window, target = launch
            batch = self.planner.step_batch(window, target)  # after the sync: adapter mode names the adapter
            if batch is not None:
                self.overlap.launch(batch, target)
        if decision.reuse:
            cached = self.rollout_buffer.reuse(decision, tagged)
            prepared, counts = cached.prepared, StepCounts(cached.n_ce, cached.n_coord, cached.n_fp)
            self.step_metrics.add(cached.metrics())
        else:
            planned = self.planner.build(
                [t.batch for t in tagged], rollouts, global_step=step, metrics=self.step_metrics
            )
            prepared = planned.prepared
            counts = self._all_reduce_counts(StepCounts(planned.n_ce, planned.n_coord, planned.n_fp))
            self.rollout_buffer.store(
                decision, tagged, prepared, counts.n_ce, counts.n_coord, global_step=step, n_fp=counts.n_fp
            )
            self.step_metrics.add({"rollout/buffer_reuse": 0.0})
        for batch in prepared:
            batch["step_counts"] = counts
        self.step_metrics.add({"train/micro_steps": float(len(prepared))})
        return prepared, None

    def _fetch(self, raws: list[list[dict[str, Any]]], step: int) -> Rollouts | None:
        """This step's rollouts (None on a step without requests), inside the colocate offload context."""
        batch = self.planner.step_batch(raws, step)
        if batch is None:
            return None
        offload = self.run_cfg.stage2.offload
        rollout = self.run_cfg.rollout
        # Offload only helps a colocated vLLM engine; hf generates with these very parameters
        # (docs/ALGORITHM.md#offload).
        offload_on = offload.enabled and rollout.mode == "colocate" and rollout.backend == "vllm"
        with offload_context(
            self.model,
            self.optimizer,
            offload_model=offload.model,
            offload_optimizer=offload.optimizer,
            enabled=offload_on,
        ) as report:
            rollouts = self.overlap.fetch(batch, step, sync=self._sync_now)
        self.step_metrics.add_time("time/offload_s", getattr(report, "seconds", 0.0))
        return rollouts

    def _next_launch(self, epoch_iterator, step: int, decision: Any) -> tuple[list[Any], int] | None:
        """`(raw micro-batches, target step)` of the next window that rolls out, when async is on and that
        window is at most `rollout.async.max_staleness` steps ahead (E/M buffer M-steps roll out nothing)."""
        cfg = self.run_cfg.rollout.async_
        if not cfg.enabled or self.overlap.pending_step not in (None, step):  # one request ahead at a time
            return None
        gas = self.args.gradient_accumulation_steps
        for distance in range(1, cfg.max_staleness + 1):
            target = step + distance
            if self.state.max_steps > 0 and target >= self.state.max_steps:
                return None
            window = self.lookahead.peek(epoch_iterator, distance, gas)
            if window is None:
                return None
            tagged = [_tag(raw) for raw in window]
            if target < self.run_cfg.stage2.sft_warmup_steps or self._replays(tagged, decision):
                continue
            return [t.batch for t in tagged], target
        return None

    def _replays(self, tagged: list[TaggedBatch], decision: Any) -> bool:
        """Whether a future window is an M-step of this step's window (§15.3): nothing to roll out."""
        window_ids = {t.window_id for t in tagged}
        return (
            self.rollout_buffer.enabled
            and len(tagged) == self.args.gradient_accumulation_steps
            and window_ids == {decision.window_id}
            and all(t.repetition > 0 for t in tagged)
            and (decision.cache or decision.reuse)
        )

    def _sync_now(self) -> float:
        """The lazy §5.6 sync of this step (no-op if it already ran); records the weight version it made."""
        before = self.weight_sync.last_synced_step
        seconds = self.weight_sync.maybe_sync(self.model, self.state.global_step, self.planner.source)
        if self.weight_sync.last_synced_step != before:
            version = self.weight_sync.version
            if self.args.world_size > 1:  # only the sending rank knows it; every rank checks its own results
                version = int(self._reduce_metrics([float(version)], "max")[0])
            self.overlap.ledger.record(version, self.state.global_step)
        self.step_metrics.add_time("time/weight_sync_agree_s", self.weight_sync.last_agree_s)
        return seconds

    def _reduce_metrics(self, values: list[float], op: str) -> list[float]:
        tensor = torch.tensor(values, dtype=torch.float64, device=self.args.device)
        reduce_op = torch.distributed.ReduceOp.SUM if op == "sum" else torch.distributed.ReduceOp.MAX
        torch.distributed.all_reduce(tensor, op=reduce_op)
        return tensor.tolist()

    def _all_reduce_counts(self, counts: StepCounts) -> StepCounts:
        if self.args.world_size <= 1:
            return counts
        summed = torch.tensor(list(counts), dtype=torch.long, device=self.args.device)
        torch.distributed.all_reduce(summed)
        return StepCounts(*(int(n) for n in summed.tolist()))

    # -- loss ---------------------------------------------------------------------------------------
    def training_step(self, model, inputs, num_items_in_batch=None):
        """HF's step, timed: `time/backward_s` is its wall time minus the forward timed in compute_loss."""
        t0 = time.perf_counter()
        self._last_forward_s = 0.0
        # The whole step (gradient checkpointing re-runs the forward inside the backward) attends per segment.
        with packed_attention(
            model,
            enabled=self.run_cfg.stage2.loss.segment_attention,
            kernel=self.run_cfg.model.varlen_kernel,
        ):
            loss = super().training_step(model, inputs, num_items_in_batch)
        self.step_metrics.add_time(
            "time/backward_s", max(0.0, time.perf_counter() - t0 - self._last_forward_s)
        )
        return loss

    def _prepare_inputs(self, inputs: dict[str, Any]) -> dict[str, Any]:
        # Prepared batches hold a dataclass (not a tensor mapping); moved to the device in compute_loss.
        return inputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """Sum-form CE + coord loss of one prepared micro-batch, normalised for the whole step (§13.3)."""
        loss_cfg = self.run_cfg.stage2.loss
        gas = self.args.gradient_accumulation_steps
        if inputs.get("empty"):
            loss = zero_loss(model)
            return (loss, None) if return_outputs else loss
        t0 = time.perf_counter()
        batch = inputs["batch"].to(self.args.device, non_blocking=True)  # pinned on CUDA (planner)
        step = micro_step_loss(
            model,
            batch,
            coord_ids=self.coord_ids,
            eos_id=self.planner.ctx.eot_id,
            loss_cfg=loss_cfg,
            coord_cfg=self.run_cfg.stage2.coord_loss,
            totals=inputs["step_counts"],
            world_size=self.args.world_size,
            gas=gas,
        )
        self.step_metrics.add(step.sums.metric_sums(loss_cfg.fp_unlikelihood_weight))
        self.step_metrics.add(self._step_flops(model, inputs["batch"], step.columns))
        self._last_forward_s = time.perf_counter() - t0
        self.step_metrics.add_time("time/forward_s", self._last_forward_s)
        return (step.loss, step.outputs) if return_outputs else step.loss

    def _step_flops(
        self, model: torch.nn.Module, batch: Any, columns: torch.Tensor | None
    ) -> dict[str, float]:
        """`perf/*` sums of one micro-batch (`learner.flops`; the parameter split is read at the first step,
        after freezing and adapters)."""
        if self._flop_model is None:
            self._flop_model = FlopModel.from_model(model)
        flops = self._flop_model.batch_step(batch, columns)
        return {
            "perf/tokens": flops.tokens,
            "perf/model_flops": flops.model,
            "perf/attn_flops": flops.attention,
        }

    def _throughput(self, logs: dict[str, float]) -> dict[str, float]:
        """Tokens/s and MFU of the logged step (`learner.flops.utilization`) over its forward + backward."""
        if self._peak_tflops is None and self.args.device.type == "cuda":
            self._peak_tflops = peak_tflops(
                torch.cuda.get_device_name(self.args.device), self.run_cfg.gpu_peak_tflops
            )
        elif self._peak_tflops is None:
            self._peak_tflops = self.run_cfg.gpu_peak_tflops
        seconds = logs.get("time/forward_s", 0.0) + logs.get("time/backward_s", 0.0)
        return (
            utilization(logs, seconds, self.args.world_size, self._peak_tflops)
            if "perf/tokens" in logs
            else {}
        )

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Rollout-only evaluation on the held-out samples (§18): precision / recall / F1 (gate and maskIoU
        thresholds), duplicates, counts; on the run's own held-out list also the gallery of fixed images."""
        samples = list(eval_dataset) if eval_dataset is not None else self.eval_samples
        if not samples:
            return {}
        gallery = self.gallery if eval_dataset is None else None
        if gallery is not None:
            gallery.begin()
        t0 = time.perf_counter()
        self._sync_now()
        eval_cfg = self.run_cfg.stage2.eval
        was_training = self.model.training
        self.model.eval()
        try:
            sums = self.planner.evaluate(
                samples,
                batch_size=max(len(samples), 1),
                max_new_tokens=eval_cfg.max_new_tokens,
                temperature=eval_cfg.temperature,
                on_sample=gallery.on_sample if gallery is not None else None,
            )
        finally:
            self.model.train(was_training)
        runtime = time.perf_counter() - t0
        metrics = eval_metrics(sums, n_samples=len(samples), runtime_s=runtime, prefix=metric_key_prefix)
        if gallery is not None and self.is_world_process_zero():
            gallery.write(self.state.global_step, metrics.get(f"{metric_key_prefix}_rollout_f1"))
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- logging ------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the aggregated per-step metrics to training logs, then defers to HF."""
        if "loss" in logs:
            logs.update(self.step_metrics.finalize())
            logs.update(self._throughput(logs))
            logs.update(peak_memory_metrics(self.args.device))
            warning = self.over_prediction.observe(logs)
            if warning and self.is_world_process_zero():
                logger.warning(warning)
        super().log(logs, start_time)


def _tag(raw: list[dict[str, Any]]) -> TaggedBatch:
    """Rebuilds the repeater tag from the `_window_id` / `_repetition` the dataset put on each sample."""
    tags = {(s.get("_window_id"), s.get("_repetition")) for s in raw}
    if len(tags) != 1:
        raise RuntimeError(
            f"one micro-batch spans several rollout-buffer windows {sorted(tags)}; "
            "per_device_train_batch_size must divide the window (check RepeatedWindowDataset block)"
        )
    window, rep = tags.pop()
    return TaggedBatch(raw, int(window or 0), int(rep or 0))
