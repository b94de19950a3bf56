"""Assemble a rollout-matching SFT run from a validated `RunConfig`: model, data, rollout source, trainer.

Only this module (and `__main__`) knows how the parts are wired; the trainer receives its collaborators.
"""

from __future__ import annotations

import inspect
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedModel, TrainingArguments
from transformers.trainer_callback import PrinterCallback, ProgressCallback

from learner.config import REPO_ROOT, ConfigError, RunConfig, check_runtime_guards, resolve_path
from learner.data.dataset import RepeatedWindowDataset, SampleListDataset
from learner.data.prompt_encoding import PromptEncoder
from learner.data.records import build_sample, load_records, record_user_text
from learner.policy import Policy, load_policy
from learner.rollout.base import RolloutSource
from learner.rollout.seeds import stage2_seed_plan
from learner.stage2.coords import CoordVocab
from learner.stage2.pipeline import SampleContext
from learner.stage2.rollout_reuse import RolloutBuffer
from learner.trainers.callbacks import LiveProgressCallback, MetricsJsonlCallback
from learner.trainers.eval_gallery import EvalGallery
from learner.trainers.overlap import RolloutOverlap
from learner.trainers.planner import StepPlanner
from learner.trainers.rollout_matching import RolloutMatchingTrainer
from learner.trainers.strategy import StrategyCallback
from learner.weights.sync import WeightSyncPolicy

__all__ = [
    "REPO_ROOT",
    "RunParts",
    "build_rollout_source",
    "build_run",
    "check_compact_logits",
    "check_images",
    "load_samples",
    "resolve_path",
    "sample_context",
    "training_args",
]

logger = logging.getLogger(__name__)

# TrainingArguments we must own (and why), for both trainers: the identity collators need the raw columns
# (GRPO: the slot tags); the step windows and the rollout-buffer repetition order live in the dataset order,
# so sampling must be sequential. The defaults of `training:` are `learner.training_config.TrainingConfig`'s.
_FORCED_ARGS = {"remove_unused_columns": False, "train_sampling_strategy": "sequential"}


def training_args(
    cfg: RunConfig,
    output_dir: Path,
    *,
    defaults: dict[str, Any] | None = None,
    fixed: dict[str, Any] | None = None,
) -> TrainingArguments:
    """`training:` → `TrainingArguments`, the one map of both trainers (docs/ARCHITECTURE.md#configuration).

    `use_cpu` (true without CUDA), then `defaults` (a trainer's own), then `training:` (`cfg.training_view`:
    its typed keys with their defaults and every other key as written), then the forced settings,
    `output_dir` and `fixed` (values a trainer computes, e.g. GRPO's `max_steps`, which also drops
    `num_train_epochs`)."""
    kwargs = {
        "use_cpu": not torch.cuda.is_available(),
        **(defaults or {}),
        **cfg.training_view.arguments(),
        **_FORCED_ARGS,
        "output_dir": str(output_dir),
        **(fixed or {}),
    }
    if "max_steps" in (fixed or {}):
        kwargs.pop("num_train_epochs", None)
    return TrainingArguments(**kwargs)


def load_samples(files: list[str], cfg: RunConfig) -> list[dict[str, Any]]:
    """Sample dicts (docs/ALGORITHM.md#records §1.5) of the given JSONL files, in dataset-namespace order.

    A record's `metadata.scene` text (a text-only record describes its scene in the prompt) is appended to
    the user prompt on a new line (`learner.data.records.record_user_text`).
    """
    samples: list[dict[str, Any]] = []
    seed = cfg.training_view.seed
    for namespace, file in enumerate(files):
        path = resolve_path(file)
        for base_idx, record in enumerate(
            load_records(
                path, image_root=cfg.data.image_root, max_images_per_sample=cfg.data.max_images_per_sample
            )
        ):
            user = record_user_text(record, cfg.prompts.user)
            samples.append(
                build_sample(
                    record,
                    base_idx=base_idx,
                    dataset=Path(path).stem,
                    dataset_namespace=namespace,
                    system_prompt=cfg.prompts.system,
                    user_prompt=user,
                    ordering=cfg.data.object_ordering,
                    seed=seed,
                )
            )
    return samples


def build_rollout_source(
    cfg: RunConfig, model: PreTrainedModel, tokenizer: Any, encoder: PromptEncoder | None = None
) -> RolloutSource:
    """The configured `RolloutSource`: server client(s) or the colocated engine (same protocol).

    `encoder` is the run's prompt encoder; a colocated HF engine encodes its prompts (images included) with
    it, so rollout and teacher forcing share one encoding and one image cache.
    """
    if cfg.rollout.mode == "server":
        from learner.rollout.server_source import ServerRolloutSource

        source = ServerRolloutSource.from_config(cfg.rollout)
        source.wait_healthy()
        return source
    from learner.rollout.colocate import ColocateRolloutSource

    return ColocateRolloutSource.from_config(cfg, model=model, tokenizer=tokenizer, encoder=encoder)


@dataclass
class RunParts:
    """Everything `__main__` needs to run and report."""

    trainer: RolloutMatchingTrainer
    source: RolloutSource
    output_dir: Path


def check_compact_logits(cfg: RunConfig, model: torch.nn.Module) -> None:
    """`stage2.loss.compact_logits` needs a forward that takes a tensor `logits_to_keep` (transformers' causal
    LMs and Qwen-VL do).

    Raises:
        ConfigError: naming the key and the model class.
    """
    if not cfg.stage2.loss.compact_logits:
        return
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if "logits_to_keep" not in inspect.signature(base.forward).parameters:
        raise ConfigError(
            f"stage2.loss.compact_logits: {type(base).__name__}.forward takes no `logits_to_keep`; "
            "set stage2.loss.compact_logits: false"
        )


def check_images(policy: Policy, samples: list[dict[str, Any]], cfg: RunConfig) -> None:
    """Image records need a vision-language model.

    Raises:
        ConfigError: naming the data key and the model path.
    """
    if policy.is_vision_language:
        return
    with_images = next((s for s in samples if s.get("images")), None)
    if with_images is not None:
        raise ConfigError(
            f"data.train holds image records (sample base_idx={with_images['base_idx']} of "
            f"{with_images['dataset']}) but model.path {cfg.model.path} is a text-only model; point "
            "model.path at a Qwen-VL checkpoint, or use text-only records with data.max_images_per_sample: 0"
        )


def check_sync_mode(cfg: RunConfig, policy: Policy) -> None:
    """An adapter sync carries only the LLM adapters: refused when base weights train too.

    Raises:
        ConfigError: `rollout.sync.mode: adapter` with an unfrozen vision tower or aligner.
    """
    if cfg.rollout.sync.mode == "adapter" and policy.trains_outside_adapters:
        raise ConfigError(
            "rollout.sync.mode is 'adapter' but base weights train outside the adapters (model.freeze_vision "
            "/ model.freeze_aligner false): an adapter sync would leave the engine's vision tower stale; use "
            "rollout.sync.mode: full (or auto, which picks full here)"
        )


def sample_context(cfg: RunConfig, tokenizer: Any, encoder: PromptEncoder | None = None) -> SampleContext:
    """The per-sample context of `cfg` (tokenizer, coord ids, prompts, stage-2 knobs); `encoder` defaults to a
    text-only `PromptEncoder` (evaluation never encodes prompts; teacher forcing and colocated HF do).

    Raises:
        ConfigError: the tokenizer does not encode a newline as one id.
    """
    s2 = cfg.stage2
    eot_id = tokenizer.convert_tokens_to_ids(cfg.chat.end_of_turn_token)
    newline = tokenizer.encode("\n", add_special_tokens=False)
    if len(newline) != 1:
        raise ConfigError(f"the tokenizer encodes '\\n' as {newline}; the turn suffix needs a single id")
    return SampleContext(
        tokenizer=tokenizer,
        encoder=encoder if encoder is not None else PromptEncoder(tokenizer),
        coord_vocab=CoordVocab.from_tokenizer(tokenizer),
        system_prompt=cfg.prompts.system,
        stop_markers=tuple(s2.parse.stop_markers),
        matching=s2.matching,
        targets=s2.targets,
        malformed_policy=s2.gt.malformed_policy,
        fn_desc_ce=s2.loss.fn_desc_ce,
        prefix_structure_ce=s2.loss.prefix_structure_ce,
        packing_length=s2.packing.packing_length or s2.encode.global_max_length,
        on_prompt_mismatch=s2.encode.on_prompt_mismatch,
        oversize_policy=s2.encode.oversize_policy,
        eot_id=int(eot_id),
        newline_id=int(newline[0]),
        fp_unlikelihood_tokens=s2.loss.fp_unlikelihood_tokens if s2.loss.fp_unlikelihood_weight > 0 else None,
        fp_unlikelihood_objects=s2.loss.fp_unlikelihood_objects,
    )


def build_run(cfg: RunConfig, *, output_dir: str | Path | None = None) -> RunParts:
    """Builds model, data, rollout source, sync policy, buffer and trainer for `cfg`.

    Raises:
        ConfigError: a guard that needs the world size or the servers' `/health` failed.
    """
    out = Path(resolve_path(str(output_dir or cfg.output_dir)))
    args = training_args(cfg, out)
    policy = load_policy(cfg.model, resolve_path(cfg.model.path))
    model, tokenizer = policy.model, policy.tokenizer
    check_compact_logits(cfg, model)
    check_sync_mode(cfg, policy)
    ctx = sample_context(cfg, tokenizer, PromptEncoder.for_model(model, tokenizer, policy.processor))
    train = load_samples(cfg.data.train, cfg)
    evals = load_samples(cfg.data.eval, cfg)[: cfg.data.max_eval_samples]
    check_images(policy, train + evals, cfg)
    longest = max((len(ctx.prompt_ids(s)) for s in train[:256]), default=0)
    ctx.encoder.new_window()
    # Guards that need no engine run first: a colocated engine is slow to start and takes GPU memory.
    check_runtime_guards(cfg, world_size=args.world_size, longest_prompt_tokens=longest)
    source = build_rollout_source(cfg, model, tokenizer, ctx.encoder)
    health = source.health()
    check_runtime_guards(
        cfg,
        world_size=args.world_size,
        server_lora_enabled=health.lora_enabled,
        server_max_model_len=health.max_model_len,
        longest_prompt_tokens=longest,
    )
    gas = args.gradient_accumulation_steps
    buffer_cfg = cfg.stage2.rollout_buffer
    m_steps = buffer_cfg.m_steps if buffer_cfg.enabled else 1
    block = args.per_device_train_batch_size * gas * args.world_size
    dataset = RepeatedWindowDataset(train, block=block, m_steps=m_steps, seed=args.seed)
    sync = run_weight_sync(cfg, args, source, _engine_dtype(health), seed_plan=stage2_seed_plan(args.seed))
    planner = StepPlanner.from_config(
        cfg,
        source,
        ctx,
        batch_size=args.per_device_train_batch_size,
        rank=args.process_index,
        adapter_name=lambda: sync.request_adapter,
        pin_memory=args.device.type == "cuda",
    )
    overlap = RolloutOverlap(
        lambda batch: source.infer(batch),  # looked up per call: tests instrument the instance
        endpoints=source.endpoints,
        max_staleness=cfg.rollout.async_.max_staleness,
        wait_timeout_s=cfg.rollout.async_wait_timeout_s,
        agree=(lambda stale: not all_ranks_ok(not stale)) if args.world_size > 1 else (lambda stale: stale),
    )
    report_to = args.report_to if isinstance(args.report_to, list) else [args.report_to]
    gallery = EvalGallery(
        evals,
        out,
        cfg.stage2.eval.gallery_images if args.process_index == 0 else 0,
        # beside HF's own event files (output_dir/runs/<date>_<host>): `tensorboard --logdir output_dir`
        tensorboard_dir=str(out / "runs" / "eval_gallery") if "tensorboard" in report_to else None,
    )
    strategy = StrategyCallback()  # says which data-parallel strategy engaged (DDP, ZeRO-2/3) and its bytes
    trainer = RolloutMatchingTrainer(
        planner=planner,
        overlap=overlap,
        weight_sync=sync,
        rollout_buffer=RolloutBuffer(m_steps=m_steps, gas=gas, enabled=buffer_cfg.enabled),
        run_cfg=cfg,
        eval_samples=evals,
        gallery=gallery,
        model=model,
        args=args,
        train_dataset=dataset,
        eval_dataset=SampleListDataset(evals) if evals else None,
        data_collator=_identity_collator,
        processing_class=policy.processing_class,
        callbacks=[strategy, MetricsJsonlCallback(out / "metrics.jsonl"), LiveProgressCallback()],
    )
    strategy.trainer = trainer
    trainer.remove_callback(ProgressCallback)
    trainer.remove_callback(PrinterCallback)
    return RunParts(trainer=trainer, source=source, output_dir=out)


def _engine_dtype(health: Any) -> torch.dtype | None:
    """The dtype full syncs are cast to: the engine's, when `/health` reports one."""
    name = getattr(health, "dtype", None)
    return getattr(torch, name) if isinstance(name, str) and hasattr(torch, name) else None


def _identity_collator(batch: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Micro-batches are plain lists of sample dicts (docs/ALGORITHM.md#records §1.5)."""
    return batch


def run_weight_sync(
    cfg: RunConfig, args: TrainingArguments, source: RolloutSource, dtype: torch.dtype | None, **extra: Any
) -> WeightSyncPolicy:
    """The run's `WeightSyncPolicy` over `rollout.sync`: the ranks that send are the ones `source` names
    (colocated engines: every TP-group host rank feeds its own engine; servers: only global rank 0), and
    with several ranks every rank agrees on each sync's outcome (`all_ranks_ok`). `extra`: further
    `WeightSyncPolicy` keywords (`seed_plan`)."""
    sends = getattr(source, "sends_weights", args.process_index == 0)
    return WeightSyncPolicy(
        cfg.rollout.sync,
        is_rank0=lambda: bool(sends),
        all_ok=all_ranks_ok if args.world_size > 1 else (lambda ok: ok),
        dtype=dtype,
        seed=args.seed,
        **extra,
    )


def all_ranks_ok(ok: bool) -> bool:
    """Whether every rank passed `ok=True` (an all-reduce MIN of one flag; also a barrier).

    The flag lives on the current CUDA device under NCCL (which cannot reduce CPU tensors), else on the CPU.
    """
    device = (
        torch.device("cuda", torch.cuda.current_device())
        if torch.distributed.get_backend() == "nccl"
        else torch.device("cpu")
    )
    flag = torch.tensor([1 if ok else 0], dtype=torch.int32, device=device)
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MIN)
    return bool(flag.item())
