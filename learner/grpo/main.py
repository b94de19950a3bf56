"""Entry point of a GRPO run: ``run_grpo(config_path)`` (``python -m learner --config X`` dispatches here when
the YAML has a ``grpo:`` section), and ``build_grpo_trainer`` which wires the parts.

The YAML is validated by ``learner.grpo.config.validate_grpo_run`` (docs/ALGORITHM.md#grpo-rules; a failure is
a ``ConfigError``, exit 2 in ``__main__``). Launcher flags reach the learner through ONE variable set by
``scripts/start_learner.sh``: ``ROLLMATCH_TRAIN_GPUS`` (its ``--gpus``/``--nproc``), applied as the
``train_gpus`` override so the learner validates exactly what the launcher validated. The process count
(``WORLD_SIZE`` from torchrun) must equal ``len(train_gpus)`` — the batch sizes of rule 8 depend on it.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from transformers import TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from learner.config import RunConfig, check_runtime_guards
from learner.data.dataset import SampleListDataset
from learner.data.errors import DataRecordError
from learner.data.prompt_encoding import EncodedPrompt, PromptEncoder
from learner.grpo.config import ResolvedGrpoRun, validate_grpo_run
from learner.grpo.config.sections import GrpoConfig
from learner.grpo.data import GenerationSlots, PromptSet, load_prompt_rows
from learner.grpo.evaluation import build_heldout_eval
from learner.grpo.generation import GroupGenerator, ResamplePool
from learner.grpo.overlap import GrpoPrefetch
from learner.grpo.progress import GrpoProgressCallback
from learner.grpo.reference import build_reference
from learner.grpo.rollouts import request_config
from learner.grpo.trainer import GrpoTrainer
from learner.policy import is_vl_checkpoint, load_policy
from learner.report import load_metrics
from learner.rewards.detection import DETECTION_TASK, DetectionScorer
from learner.rewards.registry import DETECTION_REWARDS, uses_detection
from learner.rewards.summary_schema import load_schemas
from learner.rollout.base import RolloutSource
from learner.trainers.build import build_rollout_source, run_weight_sync, training_args
from learner.trainers.callbacks import MetricsJsonlCallback
from learner.trainers.strategy import StrategyCallback
from learner.yaml_loader import ConfigError, format_validation_error, load_yaml_with_extends
from shared_schemas.config import REPO_ROOT

__all__ = [
    "TRAIN_GPUS_ENV",
    "GrpoRun",
    "build_grpo_trainer",
    "check_reward_rows",
    "resolve_grpo_config",
    "run_grpo",
]

logger = logging.getLogger(__name__)

TRAIN_GPUS_ENV = "ROLLMATCH_TRAIN_GPUS"
"""Set by ``scripts/start_learner.sh`` when ``--gpus``/``--nproc`` override ``train_gpus``."""


@dataclass
class GrpoRun:
    """Everything ``run_grpo`` needs after building."""

    trainer: GrpoTrainer
    source: RolloutSource
    resolved: ResolvedGrpoRun
    output_dir: Path


def resolve_grpo_config(
    config_path: str | Path, train_gpus: str | None = None
) -> tuple[ResolvedGrpoRun, RunConfig]:
    """Loads the YAML, validates it (§2.3) and returns the resolved run and its learner ``RunConfig``.

    Args:
        config_path: the run YAML (``extends`` chain allowed).
        train_gpus: optional ``train_gpus`` override (``"6,7"``), as the launcher passes it.

    Raises:
        ConfigError: one line naming the key and the rule.
    """
    raw = load_yaml_with_extends(config_path)
    overrides = {"train_gpus": train_gpus} if train_gpus else None
    resolved = validate_grpo_run(raw, REPO_ROOT, overrides)
    try:
        cfg = RunConfig.model_validate(resolved.learner_config)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, config_path)) from exc
    return resolved, cfg


def _training_args(cfg: RunConfig, output_dir: Path, max_steps: int) -> TrainingArguments:
    """The shared `training:` map (`learner.trainers.build.training_args`) with GRPO's step count."""
    defaults: dict[str, Any] = {}
    if not torch.cuda.is_available() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        defaults["ddp_backend"] = "gloo"  # multi-rank CPU runs (accelerate would otherwise pick nothing)
    return training_args(cfg, output_dir, defaults=defaults, fixed={"max_steps": max_steps})


def _num_steps(cfg: RunConfig, num_rows: int, prompts_per_step: int) -> int:
    """``training.max_steps`` when set, else ``num_train_epochs`` passes over the prompts (rounded up)."""
    training = cfg.training_view
    if training.max_steps > 0:
        return training.max_steps
    return max(1, math.ceil(training.num_train_epochs * num_rows / prompts_per_step))


def _load_encode(encoder: PromptEncoder):
    """``encoder.encode`` for the load pass: nothing is kept in its cache (the rows keep ids and positions;
    the vision tensors are encoded again, once per step, when a step uses the row)."""

    def encode(messages: list[dict[str, Any]]) -> EncodedPrompt:
        encoded = encoder.encode(messages)
        encoder.new_window()
        return encoded

    return encode


def _resolve(path: str) -> Path:
    p = Path(path).expanduser()
    return p if p.is_absolute() else (REPO_ROOT / p).resolve()


def _sync_dtype(resolved: ResolvedGrpoRun) -> torch.dtype | None:
    """The server's dtype (full syncs are cast to it; the server rejects a mismatch); None for ``auto``."""
    name = resolved.server.dtype
    return None if name == "auto" else getattr(torch, name)


def check_reward_rows(weights: dict[str, float], prompts: PromptSet) -> None:
    """The configured rewards must have rows of their task: detection rewards need detection records, and
    rewards that are all summary rewards cannot score a set of detection records only (every group would have
    zero variance, silently).

    Raises:
        ConfigError: naming ``grpo.reward_preset`` and the fix.
    """
    optimized = [name for name, w in weights.items() if w != 0]
    detection_rows = sum(r.reward_row.get("task_mode") == DETECTION_TASK for r in prompts.rows)
    if any(n in DETECTION_REWARDS for n in optimized) and detection_rows == 0:
        raise ConfigError(
            "grpo.reward_preset: detection rewards are configured but data.train holds no detection records "
            "(rows with `objects`, docs/DATA.md); point data.train at detection records or use a summary "
            "preset"
        )
    if (
        optimized
        and detection_rows == len(prompts.rows)
        and not any(n in DETECTION_REWARDS for n in optimized)
    ):
        raise ConfigError(
            "grpo.reward_preset: data.train holds detection records only but no detection reward is "
            "weighted; set grpo.reward_preset: detection (or weight detection.* in grpo.reward_weights)"
        )


def _generator(
    resolved: ResolvedGrpoRun,
    cfg: RunConfig,
    tokenizer: Any,
    source: RolloutSource,
    prompts: PromptSet,
    seed: int,
) -> GroupGenerator:
    """The rank-0 generation step: requests, rewards (§5 weights, schema file when configured, the detection
    scorer on the policy tokenizer and `stage2.matching` when a detection reward is), resampling."""
    grpo = resolved.grpo
    detection = (
        DetectionScorer.from_tokenizer(
            tokenizer, matching=cfg.stage2.matching, stop_markers=cfg.stage2.parse.stop_markers
        )
        if uses_detection(resolved.reward_weights)
        else None
    )
    return GroupGenerator(
        source=source,
        config=request_config(grpo),
        reward_weights=resolved.reward_weights,
        schemas=load_schemas(resolved.reward_schema_path) if resolved.reward_schema_path else None,
        seed=seed,
        resample_pool=ResamplePool(prompts.rows, seed),
        dynamic_sample=grpo.dynamic_sample,
        max_resample_times=grpo.max_resample_times,
        detection=detection,
    )


def _model_section(cfg: RunConfig, grpo: Any, model_path: Any) -> Any:
    """`model:` with GRPO's `grpo.freeze_vision_tower` applied to a VL checkpoint (GRPO's spelling of
    `model.freeze_vision`; text checkpoints ignore it, as there is no vision tower).

    Raises:
        ConfigError: both keys are set and disagree.
    """
    if not is_vl_checkpoint(model_path):
        return cfg.model
    stage2_key = cfg.model.freeze_vision
    if stage2_key is not None and stage2_key != grpo.freeze_vision_tower:
        raise ConfigError(
            f"grpo.freeze_vision_tower {grpo.freeze_vision_tower} and model.freeze_vision {stage2_key}"
            " disagree; set one of them"
        )
    return cfg.model.model_copy(update={"freeze_vision": grpo.freeze_vision_tower})


def build_grpo_trainer(
    resolved: ResolvedGrpoRun, cfg: RunConfig, *, source: RolloutSource | None = None
) -> GrpoRun:
    """Builds model, reference, prompts, rollout source, sync policy, generator and trainer.

    Args:
        resolved: from :func:`resolve_grpo_config`.
        cfg: its learner ``RunConfig``.
        source: an already-built rollout source (default: the configured servers, waited for).

    Raises:
        ConfigError: the world size does not match ``train_gpus``, unusable prompt data (names file and line),
            or a runtime guard failed.
    """
    grpo = resolved.grpo
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world != resolved.world_size:
        raise ConfigError(
            f"train_gpus: {len(resolved.train_gpus)} learner GPUs {list(resolved.train_gpus)} but {world} "
            "processes were started (GRPO §2.3 rule 7, docs/ALGORITHM.md#grpo-rules: world size = "
            "len(train_gpus)); launch with scripts/start_learner.sh, whose --gpus/--nproc keep both in step"
        )
    policy = load_policy(_model_section(cfg, grpo, resolved.model_path), resolved.model_path)
    model, tokenizer = policy.model, policy.tokenizer
    reference = build_reference(model, grpo.beta)
    encoder = PromptEncoder.for_model(model, tokenizer, policy.processor)
    budget = grpo.global_max_length - grpo.max_completion_length
    try:
        prompts: PromptSet = load_prompt_rows(
            [_resolve(f) for f in cfg.data.train],
            _load_encode(encoder),
            budget=budget,
            image_root=_resolve(cfg.data.image_root) if cfg.data.image_root else None,
            max_images=cfg.data.max_images_per_sample,
            system_prompt=cfg.prompts.system,
            user_prompt=cfg.prompts.user,
        )
    except (DataRecordError, OSError) as exc:
        raise ConfigError(f"data.train: {exc}") from exc
    check_reward_rows(resolved.reward_weights, prompts)
    prompts_per_step = resolved.prompts_per_step
    num_steps = _num_steps(cfg, len(prompts.rows), prompts_per_step)
    args = _training_args(cfg, resolved.output_dir, num_steps)
    evaluates = _evaluates(cfg, args)
    # server mode: the configured server, waited for; colocate: the HF engine on this very model (the
    # rollout-matching builder either way)
    source = source if source is not None else build_rollout_source(cfg, model, tokenizer, encoder)
    health = source.health()
    check_runtime_guards(
        cfg,
        world_size=args.world_size,
        server_max_model_len=health.max_model_len,
        longest_prompt_tokens=max(len(r.prompt_ids) for r in prompts.rows),
    )
    # a colocated HF engine records the version on its own rank (nothing moves: it IS the policy)
    sync = run_weight_sync(cfg, args, source, _sync_dtype(resolved))
    generator = (
        _generator(resolved, cfg, tokenizer, source, prompts, args.seed) if args.process_index == 0 else None
    )
    dataset = GenerationSlots(
        num_rows=len(prompts.rows),
        prompts_per_step=prompts_per_step,
        num_generations=grpo.num_generations,
        num_steps=num_steps,
        seed=args.seed,
    )
    heldout = build_heldout_eval(cfg, source, tokenizer, encoder) if evaluates else None
    strategy = StrategyCallback()  # says which data-parallel strategy engaged (DDP, ZeRO-2/3) and its bytes
    trainer = GrpoTrainer(
        grpo=grpo,
        prompts=prompts.rows,
        source=source,
        weight_sync=sync,
        generator=generator,
        reference=reference,
        deleted_overlong=prompts.deleted_overlong,
        encoder=encoder if any(r.has_images for r in prompts.rows) else None,
        prefetch=_prefetch(cfg, source),
        tis_mode=_tis_mode(grpo, cfg),
        heldout=heldout,
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=SampleListDataset(list(heldout.samples)) if heldout and heldout.samples else None,
        data_collator=_identity_collator,
        processing_class=policy.processing_class,
        callbacks=[
            strategy,
            MetricsJsonlCallback(resolved.output_dir / "metrics.jsonl"),
            GrpoProgressCallback(),
        ],
    )
    strategy.trainer = trainer
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    logger.info(
        "GRPO: %d prompts (%d with images, %d deleted as overlong), %d steps of %d prompts × %d generations, "
        "world %d, reference %s",
        len(prompts.rows),
        sum(r.has_images for r in prompts.rows),
        prompts.deleted_overlong,
        num_steps,
        prompts_per_step,
        grpo.num_generations,
        args.world_size,
        reference.kind if reference else "none (beta 0)",
    )
    return GrpoRun(trainer=trainer, source=source, resolved=resolved, output_dir=resolved.output_dir)


def _evaluates(cfg: RunConfig, args: TrainingArguments) -> bool:
    """Whether the run evaluates on held-out data: `training.eval_strategy` other than `no`, which needs
    `data.eval` (detection records, scored by the rollout-matching evaluator: `learner.grpo.evaluation`).

    Raises:
        ConfigError: an evaluation strategy without `data.eval`.
    """
    if args.eval_strategy == "no":
        return False
    if not cfg.data.eval:
        raise ConfigError(
            f"training.eval_strategy: {args.eval_strategy.value} but data.eval lists no file; point data.eval"
            " at held-out detection records or set training.eval_strategy: 'no'"
        )
    return True


def _prefetch(cfg: Any, source: RolloutSource) -> GrpoPrefetch | None:
    """Overlapped generation when `rollout.async.enabled` (docs/RUNBOOK.md, overlapped rollouts)."""
    overlap = cfg.rollout.async_
    if not overlap.enabled:
        return None
    return GrpoPrefetch(
        max_staleness=overlap.max_staleness,
        wait_timeout_s=cfg.rollout.async_wait_timeout_s,
        endpoints=source.endpoints,
    )


def _tis_mode(grpo: GrpoConfig, cfg: Any) -> str:
    """`grpo.tis_mode`; `auto`: per-token truncated importance sampling with `rollout.async` on, else off."""
    if grpo.tis_mode != "auto":
        return grpo.tis_mode
    return "token" if cfg.rollout.async_.enabled else "off"


def _identity_collator(batch: list[dict[str, int]]) -> list[dict[str, int]]:
    """Micro-batches are plain lists of slot tags; the trainer builds the tensors."""
    return batch


def _first_last(metrics_path: Path, key: str) -> tuple[float | None, float | None]:
    records = load_metrics(metrics_path) if metrics_path.exists() else []
    values = [float(r[key]) for r in records if r.get(key) is not None]
    return (values[0], values[-1]) if values else (None, None)


def train_with_evaluation(trainer: GrpoTrainer, cfg: RunConfig) -> tuple[dict[str, float], dict[str, float]]:
    """Trains; a run with a held-out evaluation is also evaluated before the first step
    (`stage2.eval.at_start`) and after the last one when `training.eval_steps` did not land on it, as
    `python -m learner` does. Returns the first and the last evaluation's metrics (`{}` without evaluation).
    """
    evaluates = trainer.heldout is not None
    first = trainer.evaluate() if evaluates and cfg.stage2.eval.at_start else {}
    trainer.train(resume_from_checkpoint=cfg.training_view.resume_from_checkpoint)
    if not evaluates:
        return first, {}
    step, every = trainer.state.global_step, max(int(trainer.args.eval_steps or 1), 1)
    if trainer.args.eval_strategy == "steps" and step % every == 0:
        for record in reversed(trainer.state.log_history):  # HF evaluated the final weights already
            if "eval_rollout_f1" in record:
                return first, record
    return first, trainer.evaluate()


def run_grpo(config_path: str | Path) -> int:
    """Runs GRPO for the YAML at ``config_path``; returns the process exit code (0 on success).

    Raises:
        ConfigError: invalid configuration (``__main__`` prints it and exits 2).
    """
    resolved, cfg = resolve_grpo_config(config_path, os.environ.get(TRAIN_GPUS_ENV) or None)
    run = build_grpo_trainer(resolved, cfg)
    trainer = run.trainer
    try:
        f1_first, f1_last = train_with_evaluation(trainer, cfg)
    finally:
        run.source.close()
    if trainer.is_world_process_zero():
        metrics_path = run.output_dir / "metrics.jsonl"
        first, last = _first_last(metrics_path, "reward/first_round_total_mean")
        summary = {
            "steps": trainer.state.global_step,
            "reward_first_round_start": first,
            "reward_first_round_end": last,
            "eval_rollout_f1_start": f1_first.get("eval_rollout_f1"),
            "eval_rollout_f1_end": f1_last.get("eval_rollout_f1"),
            "metrics": str(metrics_path),
        }
        (run.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        logger.info("GRPO done: %s", json.dumps(summary))
    return 0
