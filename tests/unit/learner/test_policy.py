"""The one policy loader (`learner.policy`): text vs Qwen-VL by config, freeze knobs, adapter targets,
errors."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from learner.config import ConfigError, ModelConfig, RunConfig
from learner.policy import is_vl_checkpoint, load_policy, vl_parts


@pytest.fixture(scope="module")
def vlm_dir() -> Path:
    from tests.conftest import MODEL_CACHE

    sys.path.insert(0, str(Path(__file__).resolve().parents[3] / "scripts"))
    from build_tiny_vlm import MODEL_NAME, build_tiny_vlm

    return build_tiny_vlm(MODEL_CACHE / MODEL_NAME, seed=0)


def _trainable(model, part: str) -> set[bool]:
    return {p.requires_grad for _, p in vl_parts(model)[part]}


def test_text_model_loads_as_causal_lm(tiny_model_dir: Path) -> None:
    policy = load_policy(ModelConfig(path=str(tiny_model_dir)), tiny_model_dir)
    assert not policy.is_vision_language and policy.processor is None
    assert policy.processing_class is policy.tokenizer
    assert not is_vl_checkpoint(tiny_model_dir)


@pytest.mark.parametrize("key", ["freeze_vision", "freeze_aligner", "freeze_llm", "image_max_pixels"])
def test_vl_knobs_on_a_text_model_are_config_errors(tiny_model_dir: Path, key: str) -> None:
    value = 4096 if key == "image_max_pixels" else True
    with pytest.raises(ConfigError, match=f"model.{key} is set but .* is a text-only model"):
        load_policy(ModelConfig(path=str(tiny_model_dir), **{key: value}), tiny_model_dir)


def test_vl_model_defaults_freeze_vision_and_aligner(vlm_dir: Path) -> None:
    policy = load_policy(ModelConfig(path=str(vlm_dir)), vlm_dir)
    assert policy.is_vision_language and policy.processor is not None
    assert policy.processing_class is policy.processor
    assert _trainable(policy.model, "vision") == {False}
    assert _trainable(policy.model, "aligner") == {False}
    assert _trainable(policy.model, "llm") == {True}
    names = [n for n, _ in vl_parts(policy.model)["aligner"]]
    assert any(".merger." in n for n in names) and any("deepstack_merger_list" in n for n in names)


def test_vl_lora_targets_the_llm_only_and_trains_unfrozen_parts_in_full(vlm_dir: Path) -> None:
    cfg = ModelConfig(path=str(vlm_dir), adapter="dora", lora_r=4, freeze_vision=False)
    policy = load_policy(cfg, vlm_dir)
    adapted = {n.split(".lora_")[0] for n, _ in policy.model.named_parameters() if ".lora_" in n}
    assert adapted and all(".language_model.layers." in n for n in adapted)
    assert {n.rsplit(".", 1)[-1] for n in adapted} >= {"q_proj", "v_proj", "gate_proj", "down_proj"}
    assert _trainable(policy.model, "vision") == {True}  # unfrozen: trained in full beside the adapters
    assert _trainable(policy.model, "aligner") == {False}
    assert policy.trains_outside_adapters


def test_contradictory_vl_knobs_are_config_errors(vlm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="freeze_llm is true"):
        load_policy(ModelConfig(path=str(vlm_dir), adapter="lora", freeze_llm=True), vlm_dir)
    with pytest.raises(ConfigError, match="nothing would train"):
        load_policy(ModelConfig(path=str(vlm_dir), freeze_llm=True), vlm_dir)


def test_adapter_sync_with_a_trainable_vision_tower_is_refused(vlm_dir: Path) -> None:
    from learner.trainers.build import check_sync_mode

    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(vlm_dir), "adapter": "lora", "freeze_aligner": False},
            "data": {"train": ["x.jsonl"]},
            "rollout": {
                "mode": "server",
                "servers": [{"base_url": "http://127.0.0.1:9"}],
                "sync": {"mode": "adapter"},
            },
        }
    )
    with pytest.raises(ConfigError, match="rollout.sync.mode is 'adapter' but base weights train"):
        check_sync_mode(cfg, load_policy(cfg.model, vlm_dir))


def test_image_pixel_bounds_reach_the_processor(vlm_dir: Path) -> None:
    policy = load_policy(
        ModelConfig(path=str(vlm_dir), image_min_pixels=1024, image_max_pixels=4096), vlm_dir
    )
    size = policy.processor.image_processor.size
    assert (size["shortest_edge"], size["longest_edge"]) == (1024, 4096)


def test_colocated_vllm_on_a_vl_checkpoint(tmp_path: Path) -> None:
    """A VL checkpoint's engine reads the checkpoint (dummy is refused), takes images but no video."""
    from learner.rollout.colocate.vllm import server_config_for

    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_vl"}))
    base = {
        "model": {"path": str(tmp_path), "image_max_pixels": 4096},
        "data": {"train": ["x.jsonl"]},
        "rollout": {"mode": "colocate", "vllm": {"max_model_len": 512}},
    }
    server = server_config_for(RunConfig.model_validate(base))
    assert server.vllm.engine_kwargs["load_format"] == "auto"
    assert server.vllm.limit_mm_per_prompt == {"image": 1, "video": 0}
    assert server.vllm.mm_processor_kwargs == {"max_pixels": 4096}
    base["rollout"]["vllm"]["load_format"] = "dummy"
    with pytest.raises(ConfigError, match="load_format: dummy with a Qwen-VL checkpoint"):
        server_config_for(RunConfig.model_validate(base))


def test_pixel_bounds_must_be_ordered() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="image_min_pixels 4096 > model.image_max_pixels 1024"):
        ModelConfig(path="x", image_min_pixels=4096, image_max_pixels=1024)


def test_part_param_groups_give_each_part_its_rate(vlm_dir: Path) -> None:
    """GRPO's `vision_tower_lr` / `aligner_lr`: every trainable parameter in exactly one group,
    at its part's rate."""
    from learner.policy import part_param_groups

    cfg = ModelConfig(path=str(vlm_dir), adapter="lora", lora_r=4, freeze_vision=False, freeze_aligner=False)
    model = load_policy(cfg, vlm_dir).model
    decay = {n for n, _ in model.named_parameters() if n.endswith("weight")}
    groups = part_param_groups(
        model, base_lr=1e-5, part_lrs={"vision": 1e-8, "aligner": 1e-6}, decay_names=decay, weight_decay=0.1
    )
    by_id = {id(p): g for g in groups for p in g["params"]}
    trainable = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    assert len(by_id) == len(trainable) == sum(len(g["params"]) for g in groups)
    parts = vl_parts(model)
    for part, lr in (("vision", 1e-8), ("aligner", 1e-6)):
        assert {by_id[id(p)]["lr"] for _, p in parts[part]} == {lr}
    adapters = [p for n, p in trainable if "lora_" in n]
    assert adapters and {by_id[id(p)]["lr"] for p in adapters} == {1e-5}
    assert {g["weight_decay"] for g in groups} == {0.0, 0.1}


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the CPU refusal")
def test_liger_kernel_without_cuda_is_a_config_error_naming_the_fix(vlm_dir: Path) -> None:
    with pytest.raises(ConfigError, match="model.liger_kernel needs a CUDA device.*set it false on CPU"):
        load_policy(ModelConfig(path=str(vlm_dir), liger_kernel=True), vlm_dir)


def test_liger_kernel_is_off_by_default() -> None:
    assert ModelConfig(path="x").liger_kernel is False


def test_varlen_kernel_fa4_without_flash_attn_4_is_a_config_error_naming_the_fix(vlm_dir: Path) -> None:
    """`model.varlen_kernel: fa4` where flash-attn-4 does not import (this CPU machine) fails at load, naming
    the package and the `auto` alternative; unknown kernels are refused by the config itself."""
    from learner.kernels import fa4_importable

    if fa4_importable():
        pytest.skip("flash-attn-4 is installed here")
    with pytest.raises(ConfigError, match="model.varlen_kernel: fa4 needs flash-attn-4.*pip install.*auto"):
        load_policy(ModelConfig(path=str(vlm_dir), varlen_kernel="fa4"), vlm_dir)
    assert ModelConfig(path="x").varlen_kernel == "auto"
    with pytest.raises(ValueError, match="varlen_kernel"):
        ModelConfig(path="x", varlen_kernel="fa3")
