"""GRPO on HF ``Trainer`` with generation on the rollout server (docs/ALGORITHM.md#grpo, §3, §7).

Extension points used, and why:

- ``get_batch_samples`` — HF fetches the whole accumulation window here before the first forward, which is
  where a GRPO step must generate: ``super()`` fetches this rank's completion slots (``GenerationSlots``),
  then the step runs (below) and prepared micro-batches are returned, as many as were fetched.
- ``compute_loss`` — one forward per micro-batch, the §3.2 loss (``grpo_loss``); HF divides by the number of
  micro-batches and DDP averages the ranks, so the step's loss is the mean over all its completions.
- ``log`` — merges the §7 metrics of the steps since the last log (micro-batch values all-reduced), then
  ``super().log``.
- ``evaluate`` — the held-out evaluation of the rollout-matching trainer (``learner.grpo.evaluation``: same
  samples, planner, parser, matcher and ``eval_rollout_*`` metrics), after syncing the current weights; rank 0
  rolls out, every rank gets its metrics.

One optimizer step (``global_step = k``):

1. every rank all-gathers its slot tags, so every rank knows the step's prompts (prompt ``p`` = position in
   the generation batch) — "rank 0 gathers" of §1, done as an all-gather of a few integers per slot;
2. weight sync right before fresh generation: ``WeightSyncPolicy.maybe_sync`` on every rank (only rank 0
   sends full merged weights; all ranks meet at its barrier);
3. rank 0 runs :class:`~learner.grpo.generation.GroupGenerator` (one request per prompt with
   ``n = num_generations``, grouping by request id, rewards, dynamic sampling) and broadcasts the scored
   groups; a failure there is broadcast too, so every rank raises instead of hanging;
4. every rank builds the tensors of its own slots (slot ``(p, j)`` trains on completion ``j`` of group ``p``;
   an image prompt's vision tensors come from the run's prompt encoder, cached for the step, and its M-RoPE
   positions from the row), computes the reference log-probs (no grad) and, with ``kl_in_reward``, the
   per-completion KL, which is all-gathered;
5. every rank computes the advantages over the WHOLE generation batch from the broadcast rewards (group and
   batch statistics are global, §3.1; float64, identical on every rank) and keeps its slots' values.

Rewards are computed on rank 0 for the whole batch (they are cheap string functions, and dynamic sampling
must see every group's rewards before the batch is final); the spec's "every rank scores its own rows" is
equivalent in value.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers import Trainer, TrainerCallback

from learner.data.prompt_encoding import PromptEncoder
from learner.device_memory import peak_memory_metrics
from learner.grpo.advantages import compute_advantages, sequence_kl
from learner.grpo.batch import CompletionRow, collate_rows, completion_logps
from learner.grpo.config.sections import GrpoConfig
from learner.grpo.data import PromptRow
from learner.grpo.evaluation import HeldOutEval
from learner.grpo.generation import GroupGenerator, StepRollout
from learner.grpo.loss import grpo_loss, tis_weights
from learner.grpo.metrics import (
    MetricWindow,
    advantage_metrics,
    completion_metrics,
    record_importance_ratio,
    record_tis,
    reward_metrics,
)
from learner.grpo.overlap import GrpoPrefetch
from learner.grpo.reference import ReferencePolicy, threads_beside_rollout_engine
from learner.grpo.window import SlotTag, assemble_window, slot_tags
from learner.policy import part_param_groups
from learner.rollout.base import RolloutSource
from learner.trainers.callbacks import OverlapCallback
from learner.trainers.overlap import WindowLookahead
from learner.weights.sync import WeightSyncPolicy
from shared_schemas.checkpoints import is_vision_language

__all__ = ["GrpoTrainer"]

logger = logging.getLogger(__name__)


class GrpoTrainer(Trainer):
    """HF ``Trainer`` running GRPO steps (see the module docstring).

    Args:
        grpo: the resolved ``grpo`` knobs (``generation_batch_size`` set).
        prompts: the prompt rows the slot dataset indexes.
        source: the rollout source (used on rank 0).
        weight_sync: the once-per-step sync policy.
        generator: the rank-0 generation step (None on other ranks).
        reference: the KL reference (None when ``beta == 0``).
        deleted_overlong: prompts removed at load time by §3.5 (logged as ``data/deleted_overlong``).
        encoder: the run's prompt encoder (vision tensors of image prompts); None for text-only prompts.
        prefetch: overlapped generation (`rollout.async`); None = every step generates when it starts.
        tis_mode: the resolved `grpo.tis_mode` (`off`, `token` or `sequence`).
        heldout: the held-out evaluation (`data.eval`); None = `evaluate` returns `{}`.
        **kwargs: passed to ``Trainer`` (model, args, train_dataset, data_collator, callbacks, ...).
    """

    loss_is_scaled_for_ga = False

    def __init__(
        self,
        *,
        grpo: GrpoConfig,
        prompts: Sequence[PromptRow],
        source: RolloutSource,
        weight_sync: WeightSyncPolicy,
        generator: GroupGenerator | None,
        reference: ReferencePolicy | None,
        deleted_overlong: int = 0,
        encoder: PromptEncoder | None = None,
        prefetch: GrpoPrefetch | None = None,
        tis_mode: str = "off",
        heldout: HeldOutEval | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        if grpo.generation_batch_size is None:
            raise ValueError(
                "grpo.generation_batch_size must be resolved (validate_grpo_run) before training"
            )
        if grpo.beta > 0 and reference is None:
            raise ValueError(f"grpo.beta {grpo.beta} > 0 needs a reference policy (build_reference)")
        self.grpo = grpo
        self.prompts = list(prompts)
        self.source = source
        self.weight_sync = weight_sync
        self.generator = generator
        self.reference = reference
        self.deleted_overlong = deleted_overlong
        self.encoder = encoder
        self.prefetch = prefetch
        self.tis_mode = tis_mode
        self.heldout = heldout
        self.lookahead = WindowLookahead()
        if prefetch is not None:
            self.add_callback(OverlapCallback(prefetch))
        self.prompts_per_step = grpo.generation_batch_size // grpo.num_generations
        self.metric_window = MetricWindow()
        self._prepared_at: float | None = None
        self._reference_s = 0.0
        self._step_agree_s = 0.0
        """Seconds this step's syncs waited in their closing all-rank agreement
        (`time/weight_sync_agree_s`)."""
        # A VL policy's processing class is its processor (saved beside checkpoints); the pad id is its
        # tokenizer's.
        self._pad_id = _pad_id(getattr(self.processing_class, "tokenizer", self.processing_class))
        self.add_callback(_ForwardBackwardTimer(self))

    # -- one GRPO step ------------------------------------------------------------------------------

    def create_optimizer(self):  # noqa: D401 - HF signature
        """HF's optimizer; a vision-language model gets `grpo.vision_tower_lr` / `grpo.aligner_lr` for its
        vision tower and aligner (docs/ALGORITHM.md#grpo-knobs), `training.learning_rate` for the rest."""
        if self.optimizer is None and self._is_vision_language():
            optimizer_cls, kwargs = Trainer.get_optimizer_cls_and_kwargs(self.args, self.model)
            groups = part_param_groups(
                self.model,
                base_lr=self.args.learning_rate,
                part_lrs={"vision": self.grpo.vision_tower_lr, "aligner": self.grpo.aligner_lr},
                decay_names=set(self.get_decay_parameter_names(self.model)),
                weight_decay=self.args.weight_decay,
            )
            self.optimizer = optimizer_cls(groups, **kwargs)
        return super().create_optimizer()

    def _is_vision_language(self) -> bool:
        return is_vision_language(getattr(self.model, "config", None))

    def get_batch_samples(self, epoch_iterator, num_batches, device):  # noqa: D401 - HF signature
        """Fetch this rank's slots for the step, then generate, score and prepare its micro-batches.

        With `rollout.async` (`prefetch`), the step's groups come from rank 0's background generation
        requested during the previous step, and the next step's generation is requested right after this
        step's sync.
        """
        raws = self.lookahead.next(epoch_iterator, num_batches)
        if not raws:
            return raws, None
        step = self.state.global_step
        local = [slot_tags(raw) for raw in raws]
        prompts = self._window_prompts(local)
        if self.encoder is not None:
            self.encoder.new_window()  # vision tensors are cached for this step only
        self._step_agree_s = 0.0
        rollout, sync_s = self._step_rollout(prompts, step)
        sync_s += self._launch_next(epoch_iterator, step)
        self._reference_s = 0.0
        with threads_beside_rollout_engine(self.args.device):
            prepared = [self._micro_batch(tags, rollout) for tags in local]
        if self.reference is not None:  # the no-grad forwards only (not collation or image encoding)
            self.metric_window.add_max("time/reference_s", self._reference_s)
        kl = self._sequence_kl(prepared, local) if self._kl_in_reward else None
        advantages = self._advantages(rollout, kl)
        for batch, tags in zip(prepared, local, strict=True):
            batch["advantages"] = advantages[[t.flat_index(self.grpo.num_generations) for t in tags]].float()
        self._record_step(rollout, advantages, sync_s)
        self._prepared_at = time.perf_counter()
        return prepared, None

    def _window_prompts(self, local: list[list[SlotTag]]) -> list[PromptRow]:
        """The step's prompts in generation-batch order, from every rank's slot tags (an all-gather)."""
        window = assemble_window(
            self._all_gather([t for tags in local for t in tags]),
            prompts_per_step=self.prompts_per_step,
            num_generations=self.grpo.num_generations,
        )
        return [self.prompts[i] for i in window]

    def _step_rollout(self, prompts: list[PromptRow], step: int) -> tuple[StepRollout, float]:
        """The step's scored groups: rank 0's background result when there is a fresh one, else generated now
        after this step's sync; returns them with the seconds synced."""
        prefetch = self.prefetch
        if prefetch is not None and prefetch.pending_step == step:
            rollout = self._on_rank0(lambda: prefetch.take(step, prompts), step)
            if rollout is not None:
                return rollout, 0.0
        sync_s = self._sync(step)
        return self._on_rank0(lambda: self._rank0_generator().generate_step(prompts, step), step), sync_s

    def _launch_next(self, epoch_iterator, step: int) -> float:
        """`rollout.async`: this step's sync, then rank 0 requests step + 1's generation in the background."""
        if self.prefetch is None or (self.state.max_steps > 0 and step + 1 >= self.state.max_steps):
            return 0.0
        window = self.lookahead.peek(epoch_iterator, 1, self.args.gradient_accumulation_steps)
        if window is None:
            return 0.0
        prompts = self._window_prompts([slot_tags(raw) for raw in window])
        sync_s = self._sync(step)
        generate = None
        if self.args.process_index == 0:
            generator = self._rank0_generator()
            generate = lambda: generator.generate_step(prompts, step + 1)  # noqa: E731 - bound per launch
        self.prefetch.launch(step + 1, prompts, generate)
        return sync_s

    def _sync(self, step: int) -> float:
        """The lazy once-per-step sync; rank 0 records its version (staleness of background groups)."""
        before = self.weight_sync.last_synced_step
        seconds = self.weight_sync.maybe_sync(self.model, step, self.source)
        if self.prefetch is not None and self.weight_sync.last_synced_step != before:
            self.prefetch.ledger.record(self.weight_sync.version, step)
        self._step_agree_s += self.weight_sync.last_agree_s
        return seconds

    def _rank0_generator(self) -> GroupGenerator:
        if self.generator is None:
            raise RuntimeError("rank 0 has no GroupGenerator; build_grpo_trainer passes one to rank 0")
        return self.generator

    @property
    def _kl_in_reward(self) -> bool:
        return self.grpo.kl_in_reward and self.grpo.beta > 0

    def _on_rank0(self, produce: Callable[[], StepRollout | None], step: int) -> StepRollout | None:
        """Rank 0 runs `produce`; the result (or its failure) is broadcast to every rank."""
        payload: StepRollout | str | None = None
        if self.args.process_index == 0:
            try:
                payload = produce()
            except Exception as exc:  # broadcast the failure so no rank hangs in the collective below
                if self.args.world_size == 1:
                    raise
                logger.exception("GRPO generation failed at step %d", step)
                payload = f"{type(exc).__name__}: {exc}"
        payload = self._broadcast(payload)
        if isinstance(payload, str):
            raise RuntimeError(f"GRPO generation on rank 0 failed at step {step}: {payload}")
        return payload

    def _micro_batch(self, tags: Sequence[SlotTag], rollout: StepRollout) -> dict[str, Any]:
        rows = []
        for tag in tags:
            completion = rollout.groups[tag.prompt_slot].completions[tag.generation]
            group = rollout.groups[tag.prompt_slot]
            rows.append(
                CompletionRow(
                    group.row.prompt_ids,
                    completion.token_ids,
                    completion.logprobs,
                    0.0,
                    rope_positions=group.row.rope_positions,
                    mm_inputs=self._vision_inputs(group.row),
                )
            )
        batch: dict[str, Any] = collate_rows(rows, self._pad_id)
        if self.reference is not None:
            on_device = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            started = time.perf_counter()
            batch["ref_logps"] = self.reference.logps(on_device).cpu()
            self._reference_s += time.perf_counter() - started
        return batch

    def _vision_inputs(self, row: PromptRow) -> dict[str, torch.Tensor]:
        """An image prompt's vision tensors from the run's encoder (same ids as at load time, checked)."""
        if not row.has_images:
            return {}
        if self.encoder is None:
            raise RuntimeError(f"prompt {row.row_id!r} has images but the trainer has no prompt encoder")
        encoded = self.encoder.encode(row.messages, index=row.index)
        if list(encoded.ids) != list(row.prompt_ids):
            raise RuntimeError(
                f"prompt {row.row_id!r}: re-encoding gave {len(encoded.ids)} ids, {len(row.prompt_ids)} at "
                "load time (did an image file change during the run?)"
            )
        return encoded.mm_inputs

    @torch.no_grad()
    def _sequence_kl(self, prepared: list[dict[str, Any]], local: list[list[SlotTag]]) -> torch.Tensor:
        """``KL_i = Σ_t (log π − log π_ref)`` per completion of the step (``kl_in_reward``), all-gathered."""
        mine: list[tuple[int, float]] = []
        for batch, tags in zip(prepared, local, strict=True):
            on_device = {k: v.to(self.args.device) if torch.is_tensor(v) else v for k, v in batch.items()}
            logps = completion_logps(self.model, on_device).cpu()
            kl = sequence_kl(logps, batch["ref_logps"], batch["completion_mask"])
            mine.extend(
                (t.flat_index(self.grpo.num_generations), float(v)) for t, v in zip(tags, kl, strict=True)
            )
        out = torch.zeros(self.grpo.generation_batch_size, dtype=torch.float64)
        for index, value in self._all_gather(mine):
            out[index] = value
        return out

    def _advantages(self, rollout: StepRollout, kl: torch.Tensor | None) -> torch.Tensor:
        """§3.1 over the whole generation batch (group-major ``p · G + j``), the same on every rank."""
        rewards = torch.tensor([r for g in rollout.groups for r in g.rewards], dtype=torch.float64)
        return compute_advantages(
            rewards,
            self.grpo.num_generations,
            estimator=self.grpo.advantage_estimator,
            scale_rewards=self.grpo.scale_rewards,
            kl_in_reward=self._kl_in_reward,
            beta=self.grpo.beta,
            kl=kl,
        )

    def _record_step(self, rollout: StepRollout, advantages: torch.Tensor, sync_s: float) -> None:
        metrics = {
            **reward_metrics(rollout.groups, rollout.first_round_rewards),
            **advantage_metrics(advantages),
            **completion_metrics(rollout.groups),
            **rollout.dynamic_sample_metrics(),
            "data/deleted_overlong": float(self.deleted_overlong),
            "time/generate_s": rollout.generate_s,
            "time/reward_s": rollout.reward_s,
            "rollout/requests": float(rollout.requests),
            "rollout/infer_calls": float(rollout.infer_calls),
            "weight_sync/version": float(self.weight_sync.version if self.args.process_index == 0 else 0),
            "rollout/weight_version_min": float(min(g.weight_version for g in rollout.groups)),
            "rollout/staleness": float(rollout.staleness),
        }
        self.metric_window.add_step(metrics)
        self.metric_window.add_max("time/weight_sync_s", sync_s)
        self.metric_window.add_max("time/weight_sync_agree_s", self._step_agree_s)

    # -- loss ---------------------------------------------------------------------------------------
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """§3.2 loss of one micro-batch (mean over its completions); micro-batch metrics are recorded."""
        logps = completion_logps(model, inputs)
        mask = inputs["completion_mask"]
        weights = self._tis_weights(logps, inputs, mask)
        out = grpo_loss(
            logps,
            inputs["advantages"],
            mask,
            ref_logps=inputs.get("ref_logps"),
            beta=self.grpo.beta,
            epsilon=self.grpo.epsilon,
            kl_in_reward=self.grpo.kl_in_reward,
            is_weights=weights,
        )
        rows = float(mask.shape[0])
        self.metric_window.add_sum("kl/mean", float(out.kl_mean) * rows, rows)
        self.metric_window.add_sum("loss/clip_ratio", float(out.clip_ratio) * rows, rows)
        record_importance_ratio(self.metric_window, logps.detach(), inputs, mask)
        return (out.loss, None) if return_outputs else out.loss

    def _tis_weights(
        self, logps: torch.Tensor, inputs: dict[str, Any], mask: torch.Tensor
    ) -> torch.Tensor | None:
        """`grpo.tis_mode` weights from the server's log-probs (None when off), with their metrics."""
        if self.tis_mode == "off":
            return None
        weights = tis_weights(
            logps,
            inputs["server_logprobs"],
            inputs["server_logprobs_mask"],
            mask,
            mode=self.tis_mode,
            cap=self.grpo.tis_cap,
        )
        record_tis(self.metric_window, weights, mask, self.grpo.tis_cap)
        return weights

    # -- evaluation ---------------------------------------------------------------------------------
    def evaluate(
        self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"
    ) -> dict[str, float]:
        """Held-out rollout F1 of the current weights (``learner.grpo.evaluation``): every rank syncs (the
        lazy once-per-step sync; a colocated HF engine only records the version), rank 0 rolls out the
        held-out samples greedily and scores them, the metrics are broadcast, logged (``metrics.jsonl``) and
        returned.
        ``eval_dataset`` is ignored: the samples are the run's ``data.eval``."""
        if self.heldout is None or not self.heldout.samples:
            return {}
        self._sync(self.state.global_step)
        metrics: dict[str, float] | None = None
        if self.args.process_index == 0:
            was_training = self.model.training
            self.model.eval()
            try:
                metrics = self.heldout.evaluate(prefix=metric_key_prefix)
            finally:
                self.model.train(was_training)
        metrics = self._broadcast(metrics)
        self.log(metrics)
        self.control = self.callback_handler.on_evaluate(self.args, self.state, self.control, metrics)
        return metrics

    # -- logging ------------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        """Adds the GRPO metrics of the steps since the last log to training logs, then defers to HF."""
        if "loss" in logs:
            logs.update(self._finalize_metrics())
            logs.update(peak_memory_metrics(self.args.device))
        super().log(logs, start_time)

    def _finalize_metrics(self) -> dict[str, float]:
        if self.args.world_size <= 1:
            return self.metric_window.finalize()
        _, sums, _, maxima = self.metric_window.reduce_vector()
        sums_t = torch.tensor(sums, dtype=torch.float64, device=self.args.device)
        max_t = torch.tensor(maxima, dtype=torch.float64, device=self.args.device)
        torch.distributed.all_reduce(sums_t)
        torch.distributed.all_reduce(max_t, op=torch.distributed.ReduceOp.MAX)
        return self.metric_window.finalize(sums_t.tolist(), max_t.tolist())

    def record_forward_backward(self) -> None:
        """Called before the optimizer step: the time since the micro-batches were prepared."""
        if self._prepared_at is not None:
            self.metric_window.add_max("time/forward_backward_s", time.perf_counter() - self._prepared_at)
            self._prepared_at = None

    # -- collectives --------------------------------------------------------------------------------
    def _all_gather(self, items: list[Any]) -> list[Any]:
        if self.args.world_size <= 1:
            return list(items)
        gathered: list[list[Any] | None] = [None] * self.args.world_size
        torch.distributed.all_gather_object(gathered, items)
        return [item for part in gathered for item in (part or [])]

    def _broadcast(self, payload: Any) -> Any:
        if self.args.world_size <= 1:
            return payload
        box = [payload]
        torch.distributed.broadcast_object_list(box, src=0)
        return box[0]


class _ForwardBackwardTimer(TrainerCallback):
    """Times forward + backward of a step: from the end of preparation to the optimizer step."""

    def __init__(self, trainer: GrpoTrainer) -> None:
        self.trainer = trainer

    def on_pre_optimizer_step(self, args, state, control, **kwargs) -> None:
        self.trainer.record_forward_backward()


def _pad_id(tokenizer: Any) -> int:
    pad = getattr(tokenizer, "pad_token_id", None)
    if pad is None:
        pad = getattr(tokenizer, "eos_token_id", None)
    if pad is None:
        raise ValueError("the tokenizer has neither pad_token_id nor eos_token_id; set one for padding")
    return int(pad)
