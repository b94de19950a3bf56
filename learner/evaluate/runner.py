"""One evaluation of a detector, as `python -m learner.evaluate` runs it: resolve the run's config for a
checkpoint or a running server, roll out the held-out samples through the training loop's own evaluation
(`StepPlanner.evaluate` → `learner.stage2.pipeline.evaluate_rollout` → `eval_metrics`), and write the results.

Where rollouts come from (the same `RolloutSource` classes as training, `learner.trainers.build`):

- `--model DIR` (default: the config's `model.path`): a colocated engine in this process, of the config's
  `rollout.backend` (`vllm`: the server's own `VllmEngine` reading the checkpoint, `load_format: auto`, with
  the config's `server:` dtype / `max_model_len` / `enforce_eager` / KV cache size when `rollout.vllm` leaves
  them unset; `hf`: the checkpoint's transformers model).
- `--server URL`: that rollout server's current weights, as they are (nothing is synced).

Decoding is the training evaluation's (`rollout.decoding` with the `stage2.eval` overrides; greedy when the
temperature is 0), with per-token log-probabilities requested for the object scores. Samples: `--data` or
the config's `data.eval` (cut to `data.max_eval_samples`, as training does), then `--limit`.

Outputs go to a temporary sibling of `--out` and are renamed into place at the end, so `--out` never holds a
half-written result: `metrics.json`, `predictions.jsonl`, `gallery.png` (image records only). `metrics.json`
also says which object order the model emits (``object_order``, `learner.evaluate.order`).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from learner.config import RunConfig, load_run_config, resolve_path
from learner.evaluate.metrics import per_category
from learner.evaluate.order import prediction_order
from learner.predictions.gallery import pick_samples, write_gallery
from learner.predictions.records import SamplePrediction, sample_prediction
from learner.rollout.base import RolloutSource
from learner.stage2.pipeline import eval_metrics

__all__ = [
    "EvalInputError",
    "EvalOptions",
    "EvalResult",
    "eval_run_config",
    "evaluate_samples",
    "run_evaluation",
    "write_outputs",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_MODEL_LEN = 4096
"""`max_model_len` of a colocated vLLM engine when neither `rollout.vllm` nor `server.vllm` sets one."""


class EvalInputError(ValueError):
    """Bad input to the evaluation (a missing checkpoint or data file, an unusable `--out`); exit code 2."""


@dataclass(frozen=True)
class EvalOptions:
    """The command's flags (see `python -m learner.evaluate --help`)."""

    config: Path
    out: Path
    model: str | None = None
    server: str | None = None
    data: list[str] | None = None
    limit: int | None = None
    batch_size: int = 16
    gallery: int = 6
    gallery_select: str = "spread"
    coco: bool = True
    server_wait_s: float = 10.0


@dataclass
class EvalResult:
    """What one evaluation produced (also written under `out`)."""

    metrics: dict[str, Any]
    predictions: list[SamplePrediction] = field(default_factory=list)
    out: Path | None = None


def eval_run_config(config: Path, *, model: str | None = None, server: str | None = None) -> RunConfig:
    """The run config to evaluate with: `config`, with `rollout` pointed at `server` or at a colocated engine
    on `model` (default the config's `model.path`), as the module docstring says.

    Raises:
        ConfigError: the YAML is invalid (names file and key).
        EvalInputError: both `model` and `server`, or the checkpoint is not a model directory.
    """
    if model is not None and server is not None:
        raise EvalInputError("pass --model or --server, not both (a server evaluates its own weights)")
    base = load_run_config(config)
    if server is not None:
        overrides: dict[str, Any] = {"rollout": {"mode": "server", "servers": [{"base_url": server}]}}
        return load_run_config(config, overrides)
    path = model if model is not None else base.model.path
    resolved = Path(resolve_path(path))
    if not (resolved / "config.json").is_file():
        raise EvalInputError(
            f"checkpoint {resolved} does not exist or holds no config.json; pass --model DIR of a saved model"
            " (a run writes output_dir/model) or --server URL of a running rollout server"
        )
    server_cfg = base.server or {}
    server_vllm = server_cfg.get("vllm") or {}
    v = base.rollout.vllm
    vllm: dict[str, Any] = {"load_format": "auto"}
    vllm["max_model_len"] = v.max_model_len or server_vllm.get("max_model_len") or DEFAULT_MAX_MODEL_LEN
    if v.dtype == "auto" and server_cfg.get("dtype"):
        vllm["dtype"] = server_cfg["dtype"]
    if not v.enforce_eager and "enforce_eager" in server_vllm:
        vllm["enforce_eager"] = bool(server_vllm["enforce_eager"])
    if v.kv_cache_space_gb is None and server_vllm.get("kv_cache_space_gb"):
        vllm["kv_cache_space_gb"] = server_vllm["kv_cache_space_gb"]
    overrides = {
        "model": {"path": str(resolved)},
        "rollout": {"mode": "colocate", "async": {"enabled": False}, "vllm": vllm},
    }
    return load_run_config(config, overrides)


def _load_samples(cfg: RunConfig, options: EvalOptions) -> list[dict[str, Any]]:
    from learner.trainers.build import load_samples

    files = options.data if options.data else cfg.data.eval
    if not files:
        raise EvalInputError(f"{options.config} lists no data.eval files; pass --data FILE.jsonl")
    for file in files:
        if not Path(resolve_path(file)).is_file():
            raise EvalInputError(f"data file {resolve_path(file)} does not exist; check --data or data.eval")
    samples = load_samples(list(files), cfg)
    if not options.data and cfg.data.max_eval_samples is not None:
        samples = samples[: cfg.data.max_eval_samples]  # what the training loop evaluates
    if options.limit is not None:
        samples = samples[: options.limit]
    return samples


def _build(cfg: RunConfig, options: EvalOptions) -> tuple[Any, RolloutSource]:
    """`(SampleContext, RolloutSource)` for `cfg` (server client or colocated engine)."""
    from learner.data.prompt_encoding import PromptEncoder
    from learner.trainers.build import build_rollout_source, sample_context

    if cfg.rollout.mode == "server":
        from transformers import AutoTokenizer

        from learner.rollout.server_source import ServerRolloutSource

        tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg.model.path))
        source = ServerRolloutSource.from_config(cfg.rollout)
        try:
            source.wait_healthy(options.server_wait_s)
        except BaseException:
            source.close()
            raise
        return sample_context(cfg, tokenizer), source
    if cfg.rollout.backend == "hf":
        from learner.policy import load_policy

        policy = load_policy(cfg.model, resolve_path(cfg.model.path))
        policy.model.eval()
        encoder = PromptEncoder.for_model(policy.model, policy.tokenizer, policy.processor)
        ctx = sample_context(cfg, policy.tokenizer, encoder)
        return ctx, build_rollout_source(cfg, policy.model, policy.tokenizer, encoder)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(resolve_path(cfg.model.path))
    return sample_context(cfg, tokenizer), build_rollout_source(cfg, None, tokenizer)  # type: ignore[arg-type]


def evaluate_samples(
    cfg: RunConfig,
    source: RolloutSource,
    ctx: Any,
    samples: list[dict[str, Any]],
    *,
    batch_size: int,
    progress: Callable[[int], None] | None = None,
) -> tuple[dict[str, float], list[SamplePrediction]]:
    """The training loop's evaluation of `samples` (same planner, parser, matcher and `eval_metrics`), with
    every sample's predictions kept; returns `(eval_rollout_* metrics, predictions)`."""
    from learner.trainers.planner import StepPlanner

    planner = StepPlanner.from_config(cfg, source, ctx, batch_size=batch_size)
    predictions: list[SamplePrediction] = []

    def keep(index: int, result: Any, evaluation: Any) -> None:
        predictions.append(sample_prediction(index, samples[index], result, evaluation))
        if progress is not None:
            progress(1)

    t0 = time.perf_counter()
    sums = planner.evaluate(
        samples,
        batch_size=max(batch_size, 1),
        max_new_tokens=cfg.stage2.eval.max_new_tokens,
        temperature=cfg.stage2.eval.temperature,
        logprobs=True,
        on_sample=keep,
    )
    metrics = eval_metrics(sums, n_samples=len(samples), runtime_s=time.perf_counter() - t0)
    return metrics, predictions


def write_outputs(
    out: Path,
    metrics: dict[str, Any],
    predictions: list[SamplePrediction],
    *,
    gallery: int,
    gallery_select: str,
) -> Path:
    """Writes `metrics.json`, `predictions.jsonl` and `gallery.png` into a temporary sibling of `out`, then
    renames it to `out` (replacing an earlier evaluation there); returns `out`.

    Raises:
        EvalInputError: `out` exists and is not an evaluation output (it is never overwritten then).
    """
    out = Path(out).resolve()
    if out.exists() and (not out.is_dir() or (any(out.iterdir()) and not (out / "metrics.json").exists())):
        raise EvalInputError(f"--out {out} exists and is not an evaluation output; choose another directory")
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    try:
        (tmp / "metrics.json").write_text(json.dumps(metrics, indent=1) + "\n")
        with (tmp / "predictions.jsonl").open("w") as fh:
            for p in predictions:
                fh.write(json.dumps(p.to_json()) + "\n")
        picked = pick_samples(predictions, gallery, gallery_select)  # type: ignore[arg-type]
        if picked:
            f1 = metrics.get("eval_rollout_f1", 0.0)
            write_gallery(picked, tmp / "gallery.png", title=f"{len(predictions)} samples · F1 {f1:.3f}")
        old = out.parent / f".{out.name}.old-{os.getpid()}"
        if out.exists():
            out.rename(old)
        tmp.rename(out)
        shutil.rmtree(old, ignore_errors=True)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


def run_evaluation(
    options: EvalOptions, *, progress_factory: Callable[[int], Any] | None = None
) -> EvalResult:
    """Resolves the config, rolls out, scores, and writes `options.out` (module docstring).

    Args:
        options: the command's flags.
        progress_factory: `total -> tqdm-like` (an `update(n)` method); None for no bar.

    Raises:
        ConfigError, DataRecordError, EvalInputError, RolloutClientError, EngineStartError: bad input
        (the command exits 2 on each).
    """
    if options.coco:
        from learner.evaluate.coco import require_pycocotools

        require_pycocotools()  # before any rollout: a missing extra fails in a second, not after the run
    cfg = eval_run_config(options.config, model=options.model, server=options.server)
    samples = _load_samples(cfg, options)
    ctx, source = _build(cfg, options)
    try:
        weight_version = source.health().weight_version if options.server else None
        bar = progress_factory(len(samples)) if progress_factory is not None else None
        try:
            metrics, predictions = evaluate_samples(
                cfg, source, ctx, samples, batch_size=options.batch_size, progress=bar.update if bar else None
            )
        finally:
            if bar is not None:
                bar.close()
    finally:
        source.close()
    result: dict[str, Any] = {
        "samples": len(samples),
        "model": None if options.server else cfg.model.path,
        "server": options.server,
        "weight_version": weight_version,
        "config": str(options.config),
        "data": list(options.data or cfg.data.eval),
        "matching_gate": cfg.stage2.matching.maskiou_gate,
        **metrics,
        "per_category": per_category(predictions),
        "object_order": prediction_order(predictions).to_json(),
    }
    if options.coco:
        from learner.evaluate.coco import coco_ap

        result["coco"] = coco_ap(predictions)
        result["coco_score"] = "mean token log-probability per object (not a calibrated detector score)"
    out = write_outputs(
        options.out, result, predictions, gallery=options.gallery, gallery_select=options.gallery_select
    )
    return EvalResult(result, predictions, out)
