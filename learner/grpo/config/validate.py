"""GRPO run configuration (docs/ALGORITHM.md#grpo-config, GRPO §2–§3): :func:`validate_grpo_run` and its
result.

:func:`validate_grpo_run` takes an already-merged YAML mapping (``extends`` resolved by
``learner.yaml_loader.load_yaml_with_extends``) and returns a :class:`ResolvedGrpoRun`, or raises
:class:`ConfigError` with ONE line naming the dotted key, the rule and the fix. It is pure apart from
checking that the model directories (and the reward schema file) exist.

Two topologies (``rollout.mode``): ``server`` (the §2 rules: one rollout server process, disjoint GPU
sets) and ``colocate`` (one learner process that also generates, with the HF engine in-process: no
``server:`` section is read and the server rules do not apply; docs/GRPO.md "Colocated rollouts").

Top-level keys read here besides the sections: ``train_gpus`` (learner GPU list, default ``6,7``; ``0`` in
colocate mode) and ``batch_plan`` (§2.4). Both are consumed: :attr:`ResolvedGrpoRun.learner_config` no longer
has them, so it can be passed to ``learner.config.RunConfig``.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import TypeAdapter, ValidationError

from learner.grpo.config import rules
from learner.grpo.config.batch_plan import BatchPlan, apply_batch_plan, set_dotted
from learner.grpo.config.sections import GrpoConfig
from shared_schemas.config import ConfigError, GpuList
from shared_schemas.server_config import ServerConfig

__all__ = ["ConfigError", "GrpoConfig", "ResolvedGrpoRun", "validate_grpo_run"]

DEFAULT_TRAIN_GPUS = (6, 7)
COLOCATE_TRAIN_GPUS = (0,)
"""``train_gpus`` of a colocated run when the YAML sets none: one learner, which also generates."""
GRPO_TRAINING_DEFAULTS = {"learning_rate": 5e-6, "num_train_epochs": 1.0}
"""The `training:` defaults a GRPO run overrides (`learner.training_config.TrainingConfig` holds the others):
a small learning rate for RL on a trained policy, and one pass over the prompts when `max_steps` is unset."""


@dataclass(frozen=True)
class ResolvedGrpoRun:
    """A validated GRPO run: what the launchers and the GRPO trainer read.

    Attributes:
        grpo: the ``grpo`` knobs, ``generation_batch_size`` resolved.
        server: the ``server`` section, validated by the server's own ``ServerConfig`` (its defaults are the
            ones the server runs with), ``model`` absolute (default ``model.path``; colocate mode: the
            defaults, nothing reads it).
        train_gpus: learner GPU indices; ``world_size == len(train_gpus)``.
        per_device_batch_size, gradient_accumulation_steps, effective_batch_size: in completions.
        model_path: absolute learner model directory.
        base_url: the one rollout server URL of ``rollout.servers``; ``""`` in colocate mode.
        timeout_s, infer_timeout_s: health wait and generate read timeout.
        reward_weights: resolved reward name → weight.
        reward_schema_path: absolute schema file, or None.
        output_dir: absolute run output root.
        learner_config: the merged mapping for ``learner.config.RunConfig`` (batch plan applied, GRPO-only
            top-level keys removed, paths absolute, ``rollout.decoding``/``rollout.sync.mode`` filled from
            GRPO).
    """

    grpo: GrpoConfig
    server: ServerConfig
    train_gpus: tuple[int, ...]
    per_device_batch_size: int
    gradient_accumulation_steps: int
    effective_batch_size: int
    model_path: Path
    base_url: str
    timeout_s: float
    infer_timeout_s: float
    reward_weights: dict[str, float]
    reward_schema_path: Path | None
    output_dir: Path
    learner_config: dict[str, Any]

    @property
    def world_size(self) -> int:
        return len(self.train_gpus)

    @property
    def prompts_per_step(self) -> int:
        return self.effective_batch_size // self.grpo.num_generations


def validate_grpo_run(
    raw: Mapping[str, Any], base_dir: Path, overrides: Mapping[str, Any] | None = None
) -> ResolvedGrpoRun:
    """Validates a merged GRPO run mapping against §2.3 (and §2.4, §3) and resolves it.

    Args:
        raw: the merged YAML mapping (``extends`` already resolved; a leftover ``extends`` key is ignored).
        base_dir: directory relative paths (model, schema file, output_dir) resolve against.
        overrides: dotted key → value applied after the batch plan (launcher flags such as ``server.port``,
            ``server.gpus``, ``train_gpus``); flags override the YAML.

    Returns:
        :class:`ResolvedGrpoRun`.

    Raises:
        ConfigError: one line naming the dotted key and the rule that failed.
    """
    base_dir = Path(base_dir).resolve()
    data = {k: v for k, v in raw.items() if k != "extends"}
    colocate = rules.rollout_mode(rules.mapping(data, "rollout", "rule 1")) == "colocate"
    if not colocate and not isinstance(data.get("server"), Mapping):
        raise rules.fail("server", "section is missing", "rule 1", "add the server: section (§2.2)")
    data = apply_batch_plan(
        data, rules.validate_section(BatchPlan, data.pop("batch_plan", None) or {}, "batch_plan")
    )
    for key, value in (overrides or {}).items():
        set_dotted(data, key, value)
    rollout = rules.mapping(data, "rollout", "rule 1")
    if colocate:  # no server process: its section (an inherited one, say) is read for nothing but defaults
        rules.check_colocate(rollout)
        server_raw: dict[str, Any] = {}
    else:
        server_raw = dict(data["server"])
        rules.check_lora(server_raw)
        rules.check_server_keys(server_raw)
    # One schema: the server's own models (rule 2's host/token, rule 3, rule 4's TP x DP = GPUs, the defaults
    # the server runs with); `model` is filled from `model.path` below when the section leaves it out.
    given_model = server_raw.get("model")
    server = rules.validate_section(ServerConfig, {**server_raw, "model": given_model or ""}, "server")
    default_gpus = COLOCATE_TRAIN_GPUS if colocate else DEFAULT_TRAIN_GPUS
    try:
        train_gpus = TypeAdapter(GpuList).validate_python(data.get("train_gpus", default_gpus)) or ()
    except ValidationError as exc:
        raise rules.fail(
            "train_gpus", exc.errors()[0]["msg"], "rule 7", "list GPU indices, e.g. 6,7"
        ) from None
    if colocate:
        rules.check_colocate_world(train_gpus)
    else:
        rules.check_gpu_sets(server.gpus, train_gpus)
    grpo = rules.validate_section(GrpoConfig, data.get("grpo") or {}, "grpo")
    rules.check_lengths(server, grpo, colocate=colocate)
    training = rules.mapping(data, "training", "§3.3")
    per_device, gas, effective, generation = rules.batch_sizes(training, len(train_gpus), grpo)
    grpo = grpo.model_copy(update={"generation_batch_size": generation})
    timeout_s, infer_timeout_s = rules.timeouts(rollout)
    base_url = "" if colocate else rules.check_servers(rollout, server)
    rules.check_sync(rollout)
    model = rules.mapping(data, "model", "rule 10")
    model_path = rules.existing_dir("model.path", model.get("path"), base_dir)
    server_model = rules.existing_dir("server.model", given_model, base_dir) if given_model else model_path
    server = server.model_copy(update={"model": str(server_model)})
    weights, schema_path = rules.reward_weights(grpo, base_dir)

    learner_config = copy.deepcopy(data)
    learner_config.pop("train_gpus", None)
    learner_config["model"] = {**model, "path": str(model_path)}
    if not colocate:
        learner_config["server"] = {**data["server"], "model": str(server_model)}
    learner_config["grpo"] = grpo.model_dump(mode="json")
    sync = dict(rollout.get("sync") or {})
    learner_config["rollout"] = {
        **rollout,
        "timeout_s": timeout_s,
        "infer_timeout_s": infer_timeout_s,
        "sync": {**sync, "mode": "full"},
        "decoding": rules.decoding(rollout, grpo),
    }
    learner_config["training"] = {**GRPO_TRAINING_DEFAULTS, **training}
    output_dir = Path(str(data.get("output_dir", "runs/default"))).expanduser()
    return ResolvedGrpoRun(
        grpo=grpo,
        server=server,
        train_gpus=train_gpus,
        per_device_batch_size=per_device,
        gradient_accumulation_steps=gas,
        effective_batch_size=effective,
        model_path=model_path,
        base_url=base_url,
        timeout_s=timeout_s,
        infer_timeout_s=infer_timeout_s,
        reward_weights=weights,
        reward_schema_path=schema_path,
        output_dir=output_dir if output_dir.is_absolute() else (base_dir / output_dir).resolve(),
        learner_config=learner_config,
    )
