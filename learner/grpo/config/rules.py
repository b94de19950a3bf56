"""The GRPO §2.3 rules (docs/ALGORITHM.md#grpo-rules) as small checks, each raising a one-line ``ConfigError``
``<dotted key>: <problem> (docs/ALGORITHM.md#grpo-rules, GRPO §2.3 rule N); <fix>``."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

from pydantic import BaseModel, ValidationError

from learner.grpo.config.sections import GrpoConfig
from learner.rewards.registry import PRESETS, REWARD_NAMES, SCHEMA_TREE
from learner.rewards.summary_schema import load_schemas
from learner.training_config import TRAINING_DEFAULTS
from shared_schemas.config import CONFIG_RULE, ConfigError, is_loopback
from shared_schemas.server_config import ServerConfig, VllmServerConfig

WILDCARD_HOSTS = frozenset({"0.0.0.0", "::"})
DEFAULT_TIMEOUT_S = 300.0

_RULE_BY_KEY = {
    "server.host": "rule 2",
    "server.allow_non_loopback": "rule 2",
    "server.auth_token": "rule 2",
    "server.port": "rule 3",
    "server.vllm.tensor_parallel_size": "rule 4",
    "server.vllm.data_parallel_size": "rule 4",
    "server.vllm.max_model_len": "rule 5",
    "grpo.global_max_length": "rule 5",
    "grpo.max_completion_length": "rule 5",
    "server.vllm.enable_lora": "rule 6",
    "server.gpus": "rule 7",
    "train_gpus": "rule 7",
    "grpo.generation_batch_size": "rule 8",
    "grpo.num_generations": "rule 8",
}
_SERVER_RULE_BY_KEY = {"host": "rule 2", "auth_token": "rule 2", "gpus": "rule 4", "health_port": "rule 3"}
"""The §2.3 rule of each cross-field rule of ``ServerConfig`` (keyed by the field its error names)."""
_SCALARS = (int, float, bool)

GRPO_SERVER_KEYS = frozenset(
    {
        "host",
        "port",
        "gpus",
        "allow_non_loopback",
        "auth_token",
        "allow_unauthenticated",
        "model",
        "backend",
        "dtype",
        "seed",
        "max_body_mb",
        "shm_dir",
        "sync_timeout_s",
        "vllm",
        "hf",
    }
)
"""The ``server:`` keys a GRPO run may set (§2.2); their schema is the server's own (``ServerConfig``)."""
GRPO_VLLM_KEYS = frozenset(
    {
        "tensor_parallel_size",
        "data_parallel_size",
        "gpu_memory_utilization",
        "max_model_len",
        "enable_lora",
        "enable_prefix_caching",
        "max_num_seqs",
        "enforce_eager",
        "limit_mm_per_prompt",
        "disable_custom_all_reduce",
        "engine_kwargs",
        "mm_processor_cache_gb",
        "disable_cascade_attn",
        "quantization",
        "mm_processor_kwargs",
    }
)
"""The ``server.vllm`` keys a GRPO run may set (§2.2: the core knobs plus the allow-listed engine keys)."""

M = TypeVar("M", bound=BaseModel)


def fail(key: str, problem: str, rule: str, fix: str) -> ConfigError:
    """``key: problem (<docs anchor>, GRPO §2.3 rule N); fix`` — ``rule`` is ``rule N`` or a GRPO section like
    ``§3`` (docs/ALGORITHM.md numbers GRPO's sections so)."""
    if rule.startswith("rule"):
        where = f"docs/ALGORITHM.md#grpo-rules, GRPO §2.3 {rule}"
    else:
        where = f"docs/ALGORITHM.md#grpo, GRPO {rule}"
    return ConfigError(f"{key}: {problem} ({where}); {fix}")


def validate_section(model: type[M], data: Any, prefix: str) -> M:
    """Validates one section; the first pydantic error becomes a one-line ``ConfigError``."""
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        key = ".".join([prefix, *(str(part) for part in err["loc"])])
        section_rule = {"server": "§2.2", "grpo": "§3", "batch_plan": "§2.4"}.get(prefix, "§2")
        if err["type"] == CONFIG_RULE:  # a cross-field rule of ServerConfig: "<problem>; <fix>"
            problem, _, fix = err["ctx"]["reason"].rpartition("; ")
            rule = _SERVER_RULE_BY_KEY.get(err["ctx"]["key"], section_rule)
            raise fail(
                f"{key}.{err['ctx']['key']}", problem or fix, rule, fix if problem else "fix it"
            ) from None
        if err["type"] == "extra_forbidden":
            if prefix == "server":
                raise fail(
                    key, "unknown key", "rule 9", "remove it; server and server.vllm take only the §2.2 keys"
                ) from None
            raise fail(key, "unknown key", section_rule, "remove it or fix its spelling") from None
        value = err.get("input")
        shown = f" (got {value!r})" if isinstance(value, _SCALARS) else ""
        rule = _RULE_BY_KEY.get(key, section_rule)
        raise fail(key, f"{err['msg']}{shown}", rule, "fix the value") from None


def check_lora(server_raw: Mapping[str, Any]) -> None:
    """Rule 6 on the raw section, so ``max_lora_rank`` gets its own message rather than "unknown key"."""
    vllm = server_raw.get("vllm") if isinstance(server_raw.get("vllm"), Mapping) else {}
    if "max_lora_rank" in vllm:
        raise fail(
            "server.vllm.max_lora_rank",
            "must be absent",
            "rule 6",
            "remove it: GRPO syncs full merged weights, engine-side LoRA is never used",
        )
    if vllm.get("enable_lora") not in (None, False):
        raise fail(
            "server.vllm.enable_lora",
            f"{vllm['enable_lora']!r} is not false",
            "rule 6",
            "set it to false: GRPO syncs full merged weights",
        )


def check_server_keys(server_raw: Mapping[str, Any]) -> None:
    """Rule 9: ``server`` and ``server.vllm`` hold only the §2.2 keys (a server knob outside the allow-list is
    refused too; the values are checked by the server's own ``ServerConfig``)."""
    vllm = server_raw.get("vllm") if isinstance(server_raw.get("vllm"), Mapping) else {}
    sections = (
        ("server", server_raw, GRPO_SERVER_KEYS, ServerConfig),
        ("server.vllm", vllm, GRPO_VLLM_KEYS, VllmServerConfig),
    )
    for prefix, section, allowed, model in sections:
        for key in section:
            if key not in allowed:
                problem = "not in the GRPO allow-list" if key in model.model_fields else "unknown key"
                raise fail(
                    f"{prefix}.{key}",
                    problem,
                    "rule 9",
                    "remove it; server and server.vllm take only the §2.2 keys",
                )


def rollout_mode(rollout: Mapping[str, Any]) -> str:
    """Rule 1: ``rollout.mode`` is ``server`` or ``colocate``; returns it."""
    mode = rollout.get("mode")
    if mode not in ("server", "colocate"):
        raise fail(
            "rollout.mode",
            f"{mode!r} is neither 'server' nor 'colocate'",
            "rule 1",
            "set rollout.mode: server (a rollout server process) or colocate (rollouts in the learner's own"
            " process, rollout.backend: hf or vllm)",
        )
    return str(mode)


def check_colocate(rollout: Mapping[str, Any]) -> None:
    """Colocate mode: the HF engine (the policy generates itself, so a sync moves nothing) or a vLLM engine
    in the learner process (the policy's weights reach it after every step, as in rollout-matching), and no
    overlap."""
    backend = rollout.get("backend", "vllm")
    if backend not in ("hf", "vllm"):
        raise fail(
            "rollout.backend",
            f"{backend!r} in colocate mode: GRPO colocates the HF or the vLLM engine",
            "rule 1",
            "set rollout.backend: hf or vllm, or rollout.mode: server with a vLLM rollout server",
        )
    overlap = rollout.get("async") if isinstance(rollout.get("async"), Mapping) else {}
    if overlap.get("enabled"):
        raise fail(
            "rollout.async.enabled",
            "true in colocate mode (the policy cannot generate the next step while it trains)",
            "rule 1",
            "set rollout.async.enabled: false, or use rollout.mode: server",
        )


def check_colocate_world(train_gpus: tuple[int, ...]) -> None:
    """Colocate mode runs ONE learner process (several ranks would each need their own engine: not built)."""
    if len(train_gpus) != 1:
        raise fail(
            "train_gpus",
            f"{list(train_gpus)} lists {len(train_gpus)} learners in colocate mode, which runs one",
            "rule 7",
            "set train_gpus: [0] (one process), or use rollout.mode: server for several learners",
        )


def check_lengths(server: ServerConfig, grpo: GrpoConfig, *, colocate: bool = False) -> None:
    """Rule 5: ``max_model_len >= global_max_length > max_completion_length`` (colocate mode: the second
    inequality only; the in-process engine checks every prompt + completion against the model's length)."""
    if not colocate and server.vllm.max_model_len < grpo.global_max_length:
        raise fail(
            "server.vllm.max_model_len",
            f"{server.vllm.max_model_len} < grpo.global_max_length {grpo.global_max_length}",
            "rule 5",
            "raise server.vllm.max_model_len",
        )
    if grpo.global_max_length <= grpo.max_completion_length:
        raise fail(
            "grpo.global_max_length",
            f"{grpo.global_max_length} <= grpo.max_completion_length {grpo.max_completion_length}",
            "rule 5",
            "leave room for the prompt",
        )


def check_gpu_sets(server_gpus: tuple[int, ...] | None, train_gpus: tuple[int, ...] | None) -> None:
    """Rule 7: both GPU lists set, non-empty, without repeats, and disjoint."""
    server_gpus, train_gpus = server_gpus or (), train_gpus or ()
    for key, gpus in (("server.gpus", server_gpus), ("train_gpus", train_gpus)):
        if not gpus:
            raise fail(key, "is empty or unset", "rule 7", "list at least one GPU")
        if len(set(gpus)) != len(gpus):
            raise fail(key, f"{list(gpus)} repeats a GPU", "rule 7", "list each GPU once")
    shared = sorted(set(server_gpus) & set(train_gpus))
    if shared:
        raise fail(
            "train_gpus",
            f"{list(train_gpus)} overlaps server.gpus {list(server_gpus)} on {shared}",
            "rule 7",
            "give the server and the learner disjoint GPUs",
        )


def batch_sizes(training: Mapping[str, Any], world: int, grpo: GrpoConfig) -> tuple[int, int, int, int]:
    """``(per_device, gas, effective, generation_batch_size)`` after the rule-8 checks."""
    per_device = training.get("per_device_train_batch_size", TRAINING_DEFAULTS.per_device_train_batch_size)
    gas = training.get("gradient_accumulation_steps", TRAINING_DEFAULTS.gradient_accumulation_steps)
    for key, value in (("per_device_train_batch_size", per_device), ("gradient_accumulation_steps", gas)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise fail(f"training.{key}", f"{value!r} is not an int >= 1", "rule 8", "set a positive integer")
    effective = per_device * world * gas
    generation = grpo.generation_batch_size or effective
    if generation != effective:
        raise fail(
            "grpo.generation_batch_size",
            f"{generation} != effective batch size {effective} "
            f"(per_device_train_batch_size {per_device} × {world} learners × gas {gas})",
            "rule 8",
            "make them equal (batch_plan.effective_batch_size does it)",
        )
    if generation % grpo.num_generations:
        raise fail(
            "grpo.generation_batch_size",
            f"{generation} is not a multiple of grpo.num_generations {grpo.num_generations}",
            "rule 8",
            "change the batch size or num_generations",
        )
    return per_device, gas, effective, generation


def timeouts(rollout: Mapping[str, Any]) -> tuple[float, float]:
    """Rule 9: ``(timeout_s, infer_timeout_s)``, both > 0; ``infer_timeout_s`` defaults to ``timeout_s``."""
    timeout = rollout.get("timeout_s", DEFAULT_TIMEOUT_S)
    infer = rollout.get("infer_timeout_s", timeout)
    for key, value in (("rollout.timeout_s", timeout), ("rollout.infer_timeout_s", infer)):
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise fail(key, f"{value!r} is not a number > 0", "rule 9", "set a positive number of seconds")
    return float(timeout), float(infer)


def check_servers(rollout: Mapping[str, Any], server: ServerConfig) -> str:
    """Rule 2: the one ``rollout.servers`` entry points at the server's host and port; returns its base_url.

    Loopback names are interchangeable; a wildcard bind (``0.0.0.0``, ``::``) accepts any host name.
    """
    servers = rollout.get("servers")
    if not isinstance(servers, list) or len(servers) != 1 or not isinstance(servers[0], Mapping):
        raise fail(
            "rollout.servers",
            "must hold exactly one {base_url} (one server process, DP included)",
            "rule 2",
            f"set rollout.servers: [{{base_url: http://{server.host}:{server.port}}}]",
        )
    base_url = str(servers[0].get("base_url", "")).rstrip("/")
    parts = urlsplit(base_url)
    try:
        port = parts.port
    except ValueError:
        port = None
    host = (parts.hostname or "").lower()
    host_ok = (
        server.host in WILDCARD_HOSTS
        or host == server.host.lower()
        or (is_loopback(host) and is_loopback(server.host))
    )
    if not host_ok or port != server.port:
        raise fail(
            "rollout.servers[0].base_url",
            f"{base_url!r} does not point at server {server.host}:{server.port}",
            "rule 2",
            "make the learner's base_url use the server's host and port",
        )
    return base_url


def check_sync(rollout: Mapping[str, Any]) -> None:
    """Rule 6, learner side: ``rollout.sync.mode`` is ``full`` (or unset)."""
    sync = rollout.get("sync") if isinstance(rollout.get("sync"), Mapping) else {}
    if sync.get("mode", "full") != "full":
        raise fail(
            "rollout.sync.mode",
            f"{sync['mode']!r} is not 'full'",
            "rule 6",
            "use full: engine-side LoRA is off, so adapters cannot be synced",
        )


def existing_dir(key: str, value: Any, base_dir: Path) -> Path:
    """Rule 10: ``value`` is an existing local path; returns it absolute (relative → under ``base_dir``)."""
    if not isinstance(value, str) or not value:
        raise fail(key, "is missing", "rule 10", "set the local model directory")
    path = Path(value).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    if not path.exists():
        raise fail(
            key,
            f"{value!r} does not exist (looked at {path})",
            "rule 10",
            "point it at a local model directory (a relative path would be taken as a hub name)",
        )
    return path


def reward_weights(grpo: GrpoConfig, base_dir: Path) -> tuple[dict[str, float], Path | None]:
    """Preset weights plus overrides (§5.3), and the absolute schema file, checked by loading it."""
    unknown = sorted(set(grpo.reward_weights) - set(REWARD_NAMES))
    if unknown:
        raise fail(
            f"grpo.reward_weights.{unknown[0]}",
            "unknown reward",
            "§5",
            f"use one of {', '.join(REWARD_NAMES)}",
        )
    weights = {**PRESETS[grpo.reward_preset], **grpo.reward_weights}
    if grpo.reward_schema_path is None:
        if SCHEMA_TREE in weights:
            raise fail(
                "grpo.reward_schema_path",
                f"is missing but {SCHEMA_TREE} is configured",
                "§5.1",
                "point it at a schema file (format: learner/rewards/schemas/README.md)",
            )
        return weights, None
    path = Path(grpo.reward_schema_path).expanduser()
    path = (path if path.is_absolute() else base_dir / path).resolve()
    try:
        load_schemas(path)
    except ValueError as exc:
        raise fail("grpo.reward_schema_path", str(exc), "§5.1", "fix the schema file") from None
    return weights, path


_DECODING_FROM_GRPO = {
    "max_new_tokens": "max_completion_length",
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "repetition_penalty": "repetition_penalty",
}


def decoding(rollout: Mapping[str, Any], grpo: GrpoConfig) -> dict[str, Any]:
    """``rollout.decoding`` with the sampling knobs taken from ``grpo`` (one source of truth). A key set to
    null counts as unset: a GRPO config extending a rollout-matching one clears that one's decoding so."""
    out = dict(rollout.get("decoding") or {})
    for key, grpo_key in _DECODING_FROM_GRPO.items():
        value = getattr(grpo, grpo_key)
        value = -1 if key == "top_k" and value is None else value
        if out.get(key) is not None and out[key] != value:
            raise fail(
                f"rollout.decoding.{key}",
                f"{out[key]!r} differs from grpo.{grpo_key} {value!r}",
                "§3",
                f"GRPO samples with grpo.{grpo_key}; remove rollout.decoding.{key}",
            )
        out[key] = value
    return out


def mapping(raw: Mapping[str, Any], key: str, rule: str) -> dict[str, Any]:
    """``raw[key]`` as a dict (missing → empty)."""
    value = raw.get(key, {})
    if not isinstance(value, Mapping):
        raise fail(key, f"must be a mapping, got {type(value).__name__}", rule, f"write {key}: as a mapping")
    return dict(value)
