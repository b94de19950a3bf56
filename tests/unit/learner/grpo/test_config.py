"""GRPO config validation (docs/ALGORITHM.md#grpo-rules rules 1–10, §2.4, §3; the failing examples of §8)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from learner.grpo.config import ConfigError, validate_grpo_run
from learner.rewards.registry import PRESETS
from learner.yaml_loader import load_yaml_with_extends
from tests.unit.learner.grpo.grpo_examples import ATTR_KEY_PRESET, REPO_ROOT, with_model

Edit = Callable[[dict[str, Any]], None]


def _drop_plan(raw: dict[str, Any]) -> None:
    """Spells the batch plan out in the namespaces (so a test can break one field)."""
    del raw["batch_plan"]
    raw["training"].update(per_device_train_batch_size=4, gradient_accumulation_steps=4)
    raw["train_gpus"] = "6,7"


def _set(path: str, value: Any) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value

    return edit


def _delete(path: str) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        *parents, leaf = path.split(".")
        node = raw
        for key in parents:
            node = node[key]
        del node[leaf]

    return edit


def _chain(*edits: Edit) -> Edit:
    def edit(raw: dict[str, Any]) -> None:
        for one in edits:
            one(raw)

    return edit


FAILING = [
    ("rule1-mode", _set("rollout.mode", "remote"), "rollout.mode", "rule 1"),
    (
        "rule1-colocate-unknown-engine",
        _chain(_set("rollout.mode", "colocate"), _set("rollout.backend", "sglang")),
        "rollout.backend",
        "rule 1",
    ),
    (
        "rule1-colocate-async",
        _chain(
            _set("rollout.mode", "colocate"),
            _set("rollout.backend", "hf"),
            _set("rollout.async.enabled", True),
        ),
        "rollout.async.enabled",
        "rule 1",
    ),
    (
        "rule7-colocate-two-learners",
        _chain(_set("rollout.mode", "colocate"), _set("rollout.backend", "hf")),
        "train_gpus",
        "rule 7",
    ),
    ("rule1-no-server", _delete("server"), "server", "rule 1"),
    ("rule2-host-0.0.0.0", _set("server.host", "0.0.0.0"), "server.host", "rule 2"),
    ("rule2-host-lan", _set("server.host", "10.0.0.5"), "server.host", "rule 2"),
    (
        "rule2-non-loopback-without-token",
        _chain(_set("server.host", "0.0.0.0"), _set("server.allow_non_loopback", True)),
        "server.auth_token",
        "rule 2",
    ),
    (
        "rule2-base-url-port",
        _set("rollout.servers", [{"base_url": "http://127.0.0.1:9000"}]),
        "rollout.servers[0].base_url",
        "rule 2",
    ),
    (
        "rule2-base-url-host",
        _set("rollout.servers", [{"base_url": "http://10.0.0.5:8080"}]),
        "rollout.servers[0].base_url",
        "rule 2",
    ),
    (
        "rule2-two-servers",
        _set("rollout.servers", [{"base_url": "http://127.0.0.1:8080"}] * 2),
        "rollout.servers",
        "rule 2",
    ),
    ("rule3-port-70000", _set("server.port", 70000), "server.port", "rule 3"),
    ("rule3-port-0", _set("server.port", 0), "server.port", "rule 3"),
    ("rule4-tp1-dp5-6gpus", _set("batch_plan.server_dp", 5), "server.gpus", "rule 4"),
    (
        "rule4-namespaces",
        _chain(_delete("batch_plan.server_dp"), _set("server.vllm.data_parallel_size", 5)),
        "server.gpus",
        "rule 4",
    ),
    (
        "rule5-max-model-len-8000",
        _set("server.vllm.max_model_len", 8000),
        "server.vllm.max_model_len",
        "rule 5",
    ),
    (
        "rule5-global-le-completion",
        _set("grpo.max_completion_length", 12000),
        "grpo.global_max_length",
        "rule 5",
    ),
    ("rule6-enable-lora", _set("server.vllm.enable_lora", True), "server.vllm.enable_lora", "rule 6"),
    ("rule6-max-lora-rank", _set("server.vllm.max_lora_rank", 16), "server.vllm.max_lora_rank", "rule 6"),
    ("rule6-adapter-sync", _set("rollout.sync.mode", "adapter"), "rollout.sync.mode", "rule 6"),
    ("rule7-overlap", _set("batch_plan.train_gpus", [5, 6]), "train_gpus", "rule 7"),
    ("rule7-overlap-namespaces", _chain(_drop_plan, _set("train_gpus", "4,5,6,7")), "train_gpus", "rule 7"),
    ("rule7-empty-train", _chain(_drop_plan, _set("train_gpus", [])), "train_gpus", "rule 7"),
    (
        "rule7-empty-server",
        _chain(_delete("batch_plan.server_gpus"), _set("server.gpus", "")),
        "server.gpus",
        "rule 7",
    ),
    ("rule7-duplicate", _set("batch_plan.server_gpus", [0, 1, 2, 3, 4, 4]), "server.gpus", "rule 7"),
    (
        "rule8-generation-ne-effective",
        _chain(_drop_plan, _set("grpo.generation_batch_size", 24)),
        "grpo.generation_batch_size",
        "rule 8",
    ),
    (
        "rule8-not-multiple-of-G",
        _chain(
            _drop_plan,
            _set("training.per_device_train_batch_size", 3),
            _set("training.gradient_accumulation_steps", 5),
        ),
        "grpo.generation_batch_size",
        "rule 8",
    ),
    (
        "rule8-bad-per-device",
        _chain(_drop_plan, _set("training.per_device_train_batch_size", "four")),
        "training.per_device_train_batch_size",
        "rule 8",
    ),
    ("rule9-timeout-0", _set("rollout.timeout_s", 0), "rollout.timeout_s", "rule 9"),
    (
        "rule9-infer-timeout-negative",
        _set("rollout.infer_timeout_s", -1),
        "rollout.infer_timeout_s",
        "rule 9",
    ),
    ("rule9-unknown-vllm-key", _set("server.vllm.foo", 1), "server.vllm.foo", "rule 9"),
    ("rule9-unknown-server-key-vllm_foo", _set("server.vllm_foo", 1), "server.vllm_foo", "rule 9"),
    (
        "rule9-not-allow-listed",
        _set("server.vllm.max_num_batched_tokens", 8192),
        "server.vllm.max_num_batched_tokens",
        "rule 9",
    ),
    ("rule10-missing-model", _set("model.path", "/nonexistent/model"), "model.path", "rule 10"),
    ("rule10-missing-server-model", _set("server.model", "not/here"), "server.model", "rule 10"),
    ("rule10-no-model-key", _delete("model.path"), "model.path", "rule 10"),
]


@pytest.mark.parametrize(("edit", "key", "rule"), [f[1:] for f in FAILING], ids=[f[0] for f in FAILING])
def test_each_rule_has_a_failing_example_spec_8(
    server_raw: dict[str, Any], edit: Edit, key: str, rule: str
) -> None:
    edit(server_raw)
    with pytest.raises(ConfigError) as info:
        validate_grpo_run(server_raw, REPO_ROOT)
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(f"{key}:"), message
    assert f"§2.3 {rule})" in message, message


def test_default_preset_passes(server_raw: dict[str, Any], model_dir: Path) -> None:
    run = validate_grpo_run(server_raw, REPO_ROOT)
    assert (run.per_device_batch_size, run.world_size, run.gradient_accumulation_steps) == (4, 2, 4)
    assert run.effective_batch_size == run.grpo.generation_batch_size == 32
    assert run.prompts_per_step == 8
    assert run.server.gpus == (0, 1, 2, 3, 4, 5) and run.train_gpus == (6, 7)
    assert (run.server.vllm.tensor_parallel_size, run.server.vllm.data_parallel_size) == (1, 6)
    assert run.base_url == "http://127.0.0.1:8080"
    assert run.model_path == model_dir.resolve() and run.server.model == str(model_dir.resolve())
    assert run.reward_weights == dict(PRESETS["server"]) and run.reward_schema_path is None
    assert (run.timeout_s, run.infer_timeout_s) == (300.0, 300.0)
    assert run.output_dir == REPO_ROOT / "runs" / "grpo_summary_1024_server"


def test_attr_key_preset_passes_with_its_schema(model_dir: Path) -> None:
    run = validate_grpo_run(with_model(load_yaml_with_extends(ATTR_KEY_PRESET), model_dir), REPO_ROOT)
    assert run.reward_weights == dict(PRESETS["attr_key"])
    assert run.reward_schema_path == REPO_ROOT / "learner/rewards/schemas/worked_example.json"


def test_second_preset_batch_plan_spec_2_4(server_raw: dict[str, Any]) -> None:
    server_raw["batch_plan"] = {
        "effective_batch_size": 48,
        "per_device_batch_size": 8,
        "server_gpus": "0,1",
        "train_gpus": [2, 3, 4, 5, 6, 7],
        "server_tp": 1,
        "server_dp": 2,
    }
    server_raw["server"]["vllm"].update(max_num_seqs=2, gpu_memory_utilization=0.80)
    run = validate_grpo_run(server_raw, REPO_ROOT)
    assert (
        run.effective_batch_size,
        run.per_device_batch_size,
        run.world_size,
        run.gradient_accumulation_steps,
    ) == (
        48,
        8,
        6,
        1,
    )
    assert run.server.gpus == (0, 1) and run.server.vllm.data_parallel_size == 2
    assert run.server.vllm.max_num_seqs == 2


def test_batch_plan_gas_must_be_an_integer(server_raw: dict[str, Any]) -> None:
    server_raw["batch_plan"]["effective_batch_size"] = 30
    with pytest.raises(ConfigError, match=r"^batch_plan\.effective_batch_size: .*§2\.4"):
        validate_grpo_run(server_raw, REPO_ROOT)


def test_non_loopback_allowed_when_opted_in(server_raw: dict[str, Any]) -> None:
    server_raw["server"].update(host="0.0.0.0", allow_non_loopback=True, auth_token="t0k")
    server_raw["rollout"]["servers"] = [{"base_url": "http://trainer-node-3:8080"}]
    assert validate_grpo_run(server_raw, REPO_ROOT).server.host == "0.0.0.0"
    server_raw["server"]["host"] = "10.0.0.5"
    server_raw["rollout"]["servers"] = [{"base_url": "http://10.0.0.5:8080/"}]
    assert validate_grpo_run(server_raw, REPO_ROOT).base_url == "http://10.0.0.5:8080"
    del server_raw["server"]["auth_token"]
    server_raw["server"]["allow_unauthenticated"] = True  # the explicit opt-out (the server warns at start)
    assert validate_grpo_run(server_raw, REPO_ROOT).server.auth_token is None


@pytest.mark.parametrize("host", ["localhost", "::1"])
def test_loopback_aliases(server_raw: dict[str, Any], host: str) -> None:
    server_raw["server"]["host"] = host
    assert validate_grpo_run(server_raw, REPO_ROOT).server.host == host


def test_relative_model_path_is_made_absolute(server_raw: dict[str, Any], model_dir: Path) -> None:
    server_raw["model"]["path"] = model_dir.name
    server_raw["server"].pop("model")
    run = validate_grpo_run(server_raw, model_dir.parent)
    assert run.model_path == model_dir.resolve() and run.model_path.is_absolute()
    assert run.server.model == str(model_dir.resolve())


def test_overrides_apply_after_the_batch_plan(server_raw: dict[str, Any]) -> None:
    overrides = {"server.port": 9001, "rollout.servers": [{"base_url": "http://127.0.0.1:9001"}]}
    assert validate_grpo_run(server_raw, REPO_ROOT, overrides).server.port == 9001
    with pytest.raises(ConfigError, match=r"^train_gpus: .*rule 7"):
        validate_grpo_run(server_raw, REPO_ROOT, {"train_gpus": "0,1"})


def test_sampling_knobs_have_one_source(server_raw: dict[str, Any]) -> None:
    run = validate_grpo_run(server_raw, REPO_ROOT)
    decoding = run.learner_config["rollout"]["decoding"]
    assert decoding == {
        "max_new_tokens": 4096,
        "temperature": 0.7,
        "top_p": 1.0,
        "top_k": -1,
        "repetition_penalty": 1.05,
    }
    server_raw["rollout"]["decoding"] = {"temperature": 0.5}
    with pytest.raises(ConfigError, match=r"^rollout\.decoding\.temperature: .*grpo\.temperature"):
        validate_grpo_run(server_raw, REPO_ROOT)


@pytest.mark.parametrize(
    ("section", "value", "match"),
    [
        (
            "grpo.reward_weights",
            {"summary.nope": 1.0},
            r"^grpo\.reward_weights\.summary\.nope: unknown reward",
        ),
        ("grpo.reward_preset", "attr_key", r"^grpo\.reward_schema_path: is missing"),
        ("grpo.reward_schema_path", "missing.json", r"^grpo\.reward_schema_path: cannot read"),
        ("grpo.num_generations", 1, r"^grpo\.num_generations: .*rule 8"),
        ("grpo.advantage_estimator", "rloo", r"^grpo\.advantage_estimator: .*§3\)"),
        ("grpo.num_iterations", 2, r"^grpo\.num_iterations: "),
        ("grpo.unknown_knob", 1, r"^grpo\.unknown_knob: unknown key"),
        ("grpo.kl_in_reward", True, None),
        ("batch_plan.bogus", 1, r"^batch_plan\.bogus: unknown key"),
    ],
)
def test_grpo_section_errors(server_raw: dict[str, Any], section: str, value: Any, match: str | None) -> None:
    _set(section, value)(server_raw)
    if match is None:  # kl_in_reward with the grpo estimator
        server_raw["grpo"]["advantage_estimator"] = "grpo"
        match = r"^grpo: .*reinforce_plus_plus only"
    with pytest.raises(ConfigError, match=match):
        validate_grpo_run(server_raw, REPO_ROOT)


def test_grpo_defaults_follow_spec_3(server_raw: dict[str, Any]) -> None:
    server_raw["grpo"] = {}
    grpo = validate_grpo_run(server_raw, REPO_ROOT).grpo
    assert (grpo.num_generations, grpo.temperature, grpo.repetition_penalty, grpo.beta) == (
        4,
        0.7,
        1.05,
        0.04,
    )
    assert (grpo.advantage_estimator, grpo.scale_rewards, grpo.kl_in_reward) == (
        "reinforce_plus_plus",
        "batch",
        False,
    )
    assert (grpo.max_completion_length, grpo.global_max_length, grpo.epsilon) == (4096, 12000, 0.2)
    assert (grpo.dynamic_sample, grpo.max_resample_times, grpo.truncation_strategy) == (True, 1, "delete")


def test_learner_config_is_consumable(server_raw: dict[str, Any]) -> None:
    original = copy.deepcopy(server_raw)
    run = validate_grpo_run(server_raw, REPO_ROOT)
    assert server_raw == original  # input untouched
    cfg = run.learner_config
    assert "batch_plan" not in cfg and "train_gpus" not in cfg
    assert cfg["training"]["per_device_train_batch_size"] == 4
    assert cfg["training"]["gradient_accumulation_steps"] == 4
    assert cfg["training"]["learning_rate"] == 5e-6
    assert cfg["rollout"]["sync"]["mode"] == "full"
    learner_config = pytest.importorskip("learner.config")
    learner_config.RunConfig.model_validate(cfg)


def test_async_rollouts_and_tis_knobs_resolve(server_raw: dict[str, Any]) -> None:
    from learner.grpo.main import _tis_mode

    server_raw["rollout"]["async"] = {"enabled": True, "max_staleness": 1}
    resolved = validate_grpo_run(server_raw, REPO_ROOT)
    assert resolved.grpo.tis_mode == "auto" and resolved.grpo.tis_cap == 2.0

    class Cfg:  # the learner config's rollout section, as `_tis_mode` reads it
        class rollout:  # noqa: N801
            class async_:  # noqa: N801
                enabled = True

    assert _tis_mode(resolved.grpo, Cfg) == "token"
    Cfg.rollout.async_.enabled = False
    assert _tis_mode(resolved.grpo, Cfg) == "off"
    server_raw["grpo"]["tis_mode"] = "sequence"
    assert _tis_mode(validate_grpo_run(server_raw, REPO_ROOT).grpo, Cfg) == "sequence"
    server_raw["grpo"]["tis_cap"] = 0.5
    with pytest.raises(ConfigError, match=r"grpo\.tis_cap"):
        validate_grpo_run(server_raw, REPO_ROOT)


@pytest.mark.parametrize("backend", ["hf", "vllm"])
def test_colocate_mode_needs_no_server(server_raw: dict[str, Any], model_dir: Path, backend: str) -> None:
    """`rollout.mode: colocate` (the HF or a vLLM engine in the learner process): no server section, no server
    rules, one learner; the sampling knobs still come from `grpo`, and a null decoding key (a config extending
    a rollout-matching one) counts as unset."""
    del server_raw["server"], server_raw["batch_plan"]
    server_raw["rollout"] = {
        "mode": "colocate",
        "backend": backend,
        "decoding": {"temperature": None, "max_new_tokens": None, "rollout_generate_batch_size": 16},
    }
    server_raw["training"].update(per_device_train_batch_size=8, gradient_accumulation_steps=2)
    run = validate_grpo_run(server_raw, REPO_ROOT)
    assert run.train_gpus == (0,) and run.world_size == 1 and run.base_url == ""
    assert run.effective_batch_size == 16 and run.prompts_per_step == 4
    assert "server" not in run.learner_config and run.learner_config["rollout"]["mode"] == "colocate"
    assert run.learner_config["rollout"]["backend"] == backend
    decoding = run.learner_config["rollout"]["decoding"]
    assert decoding["temperature"] == 0.7 and decoding["max_new_tokens"] == 4096
    assert decoding["rollout_generate_batch_size"] == 16


def test_shipped_colocate_config_resolves() -> None:
    tree = load_yaml_with_extends(REPO_ROOT / "configs" / "grpo_detection_vlm_colocate.yaml")
    tree["model"]["path"] = str(REPO_ROOT / "configs")  # any existing directory: the model is not read here
    run = validate_grpo_run(tree, REPO_ROOT)
    assert run.learner_config["rollout"]["mode"] == "colocate" and run.world_size == 1
    assert run.prompts_per_step == 4 and run.reward_weights == dict(PRESETS["detection"])
    # the evaluation decodes like the rollout-matching demo it extends (greedy there, same length/penalty)
    decoding = run.learner_config["rollout"]["decoding"]
    assert (decoding["max_new_tokens"], decoding["repetition_penalty"]) == (200, 1.0)
