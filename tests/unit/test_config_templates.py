"""Every YAML under configs/ validates with the real loader of each process that reads it.

Which processes read a file follows from its top-level keys (docs/ARCHITECTURE.md#configuration): `grpo:` →
the GRPO resolver (`learner.grpo.config.validate_grpo_run`, whose learner mapping must then pass `RunConfig`);
`model:` or `data:` → the learner (`learner.config.load_run_config`); `server:` (or a file that is only a
server section) → the rollout server (`rollout_server.config.load_server_config`). Model paths of the
templates are placeholders for real checkpoints, so every load points them at the tiny model.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from learner.config import RunConfig, check_runtime_guards, load_run_config
from learner.grpo.config import validate_grpo_run
from learner.yaml_loader import load_yaml_with_extends
from rollout_server.config import load_server_config

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "configs").glob("*.yaml"))
COLOCATE = REPO / "configs" / "colocate_tp4_template.yaml"
SERVER_3V1 = REPO / "configs" / "server_3v1_template.yaml"


def readers(tree: dict) -> set[str]:
    """The processes that read a merged config tree."""
    if "grpo" in tree:
        return {"grpo", "server"}
    out = set()
    if "model" in tree or "data" in tree:
        out.add("learner")
    if "server" in tree or "model" not in tree and "data" not in tree:
        out.add("server")
    return out


def test_configs_exist() -> None:
    names = {p.name for p in CONFIGS}
    assert {"colocate_tp4_template.yaml", "server_3v1_template.yaml", "demo_tiny_cpu.yaml"} <= names


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_every_config_validates_for_its_processes(path: Path, tiny_model_dir: Path) -> None:
    tree = load_yaml_with_extends(path)
    who = readers(tree)
    assert who, f"{path.name}: no process reads this file"
    tiny = str(tiny_model_dir)
    if "grpo" in who:
        run = validate_grpo_run(tree, REPO, {"model.path": tiny, "server.model": tiny})
        RunConfig.model_validate(run.learner_config)
    if "learner" in who:
        load_run_config(path, overrides={"model": {"path": tiny}})
    if "server" in who:
        cfg = load_server_config(path, overrides={"model": tiny})
        assert cfg.model_path == Path(tiny).resolve()


def test_colocate_template(tiny_model_dir: Path) -> None:
    cfg = load_run_config(COLOCATE, overrides={"model": {"path": str(tiny_model_dir)}})
    assert "server" not in load_yaml_with_extends(COLOCATE), "colocate mode starts no rollout server"
    assert (cfg.rollout.mode, cfg.rollout.backend) == ("colocate", "vllm")
    assert cfg.rollout.vllm.tensor_parallel_size == 4
    assert cfg.rollout.vllm.gpu_memory_utilization == 0.45
    assert cfg.model.adapter == "lora"
    assert cfg.stage2.packing.enabled and cfg.stage2.rollout_buffer.enabled
    assert cfg.stage2.rollout_buffer.m_steps > 1
    # docs/ALGORITHM.md#offload: offload is rejected with sharded optimizer states, and ZeRO-2 shards them.
    assert not cfg.stage2.offload.enabled
    assert cfg.stage2.packing.packing_length <= cfg.rollout.vllm.max_model_len
    ds = json.loads((REPO / cfg.training["deepspeed"]).read_text())
    assert ds["zero_optimization"]["stage"] == 2
    check_runtime_guards(cfg, world_size=4)  # TP 4 divides the 4 learner ranks
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        check_runtime_guards(cfg, world_size=6)


def test_server_3v1_template(tiny_model_dir: Path) -> None:
    tiny = str(tiny_model_dir)
    run = load_run_config(SERVER_3V1, overrides={"model": {"path": tiny}})
    server = load_server_config(SERVER_3V1, overrides={"model": tiny})
    assert run.rollout.mode == "server" and run.rollout.sync.mode == "full"
    assert server.vllm.data_parallel_size == 3 and server.vllm.tensor_parallel_size == 1
    assert server.gpus == (0, 1, 2)
    assert not server.vllm.enable_lora
    # One learner entry per server process, pointing at the server's own address.
    assert [s.base_url for s in run.rollout.servers] == [f"http://{server.host}:{server.port}"]
    # One nccl group: the learner + every engine's worker (DP 3 x TP 1), all on this node (loopback address).
    assert run.rollout.sync.transport == "nccl" and run.rollout.sync.collective_address is None
    assert server.sync_staging == "auto" and run.rollout.sync.collective_timeout_s <= server.sync_timeout_s
    assert run.stage2.encode.global_max_length <= server.vllm.max_model_len
    assert run.rollout.sync.bucket_mb <= server.max_body_mb  # adapter syncs go over HTTP
    # Both sides load the same checkpoint (one YAML anchor), so prompt ids agree.
    raw = load_yaml_with_extends(SERVER_3V1)
    assert raw["model"]["path"] == raw["server"]["model"]
    check_runtime_guards(
        run,
        world_size=1,
        server_lora_enabled=server.vllm.enable_lora,
        server_max_model_len=server.vllm.max_model_len,
    )


@pytest.mark.parametrize("stage", [2, 3])
def test_deepspeed_configs(stage: int) -> None:
    ds = json.loads((REPO / "configs" / "deepspeed" / f"zero{stage}.json").read_text())
    assert ds["zero_optimization"]["stage"] == stage
    # "auto" lets the HF integration fill batch sizes and clipping from TrainingArguments (no second source).
    for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
        assert ds[key] == "auto", key
