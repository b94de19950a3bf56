"""Fixtures and helpers for the learner-loop integration tests: real rollout servers on loopback, a small
synthetic detection set, and run configs built in code.

Servers are real `python -m rollout_server` processes (no mocks), each started on a free loopback port, ready
when `/health` says so, and stopped by their own pid (SIGTERM, then SIGKILL of their process group): the
process handling is `servers.py`'s, shared with `conftest`; this module writes the learner-loop servers' YAML.
Import the fixture functions into a test module
(`from tests.integration.learner_fixtures import demo_data_fixture`); they register under their `name`
(`demo_data`).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import pytest

from learner.config import RunConfig, deep_merge
from tests.integration.servers import REPO, ServerProcess, free_port, spawn, wait_healthy

__all__ = [
    "RolloutServer",
    "demo_data_fixture",
    "free_port",
    "run_config",
    "spawn_server",
    "start_server",
    "start_servers",
    "wait_healthy",
]

RolloutServer = ServerProcess
"""The one server-process class of `servers.py` (`kill` as a crash, `stop`, `weight_version`, …)."""
SERVER_MAX_MODEL_LEN = 256
"""The short test prompts (`run_config`) are at most ~90 tokens; 256 leaves room for short rollouts."""
SYSTEM_PROMPT = "Detect every object as JSON."
USER_PROMPT = "List every object."


def spawn_server(
    model_dir: Path,
    tmp: Path,
    *,
    backend: str = "vllm",
    max_model_len: int = SERVER_MAX_MODEL_LEN,
    enable_lora: bool = False,
    sync_timeout_s: float = 600.0,
) -> ServerProcess:
    """Spawns a rollout server (float32, seed 0, eager, 1 GiB KV cache) without waiting for it
    (`wait_healthy`)."""
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    shm = tmp / "shm"
    cfg = tmp / "server.yaml"
    cfg.write_text(
        f"server:\n  model: {model_dir}\n  backend: {backend}\n  dtype: float32\n  seed: 0\n  port: {port}\n"
        f"  shm_dir: {shm}\n  sync_timeout_s: {sync_timeout_s}\n  hf: {{batch_size: 8}}\n"
        f"  vllm: {{max_model_len: {max_model_len}, enforce_eager: true, enable_prefix_caching: true,"
        f" enable_lora: {str(enable_lora).lower()}, max_num_seqs: 32, kv_cache_space_gb: 1}}\n"
    )
    return spawn(f"{backend} ({tmp.name})", cfg, tmp / "server.log", port=port, shm_dir=shm, backend=backend)


def start_server(
    model_dir: Path, tmp: Path, *, deadline_s: float | None = None, **options: Any
) -> ServerProcess:
    """Starts a rollout server (`spawn_server` with `options`) and waits until `/health` is ok (within
    `deadline_s`, default `servers.SERVER_DEADLINE_S`).

    Raises:
        AssertionError: the process died or was not healthy within `deadline_s` (log tail included).
    """
    server = spawn_server(model_dir, tmp, **options)
    wait_healthy([server], deadline_s)
    return server


def start_servers(
    model_dir: Path, tmps: list[Path], *, deadline_s: float | None = None, **options: Any
) -> list[ServerProcess]:
    """One server per folder of `tmps`, started side by side (their start-ups overlap on the cores)."""
    servers = [spawn_server(model_dir, tmp, **options) for tmp in tmps]
    wait_healthy(servers, deadline_s)
    return servers


@pytest.fixture(scope="module", name="demo_data")
def demo_data_fixture(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small synthetic detection set (docs/ALGORITHM.md#records; text-only scenes): 48 train rows."""
    from learner.demo_data.scenes import DemoDataConfig, write_demo_dataset

    train, _ = write_demo_dataset(tmp_path_factory.mktemp("loop_data"), 48, 4, 0, DemoDataConfig())
    return Path(train)


def run_config(model_dir: Path, train: Path, output_dir: Path, **sections: Any) -> RunConfig:
    """A float32 learner run on the tiny model: short prompts, 4 samples per step, 16 new tokens, no eval, no
    checkpoints.

    Keyword arguments are top-level sections deep-merged over the defaults (lists replace).
    """
    base: dict[str, Any] = {
        "output_dir": str(output_dir),
        "model": {"path": str(model_dir), "dtype": "float32"},
        "data": {"train": [str(train)], "max_images_per_sample": 0},
        # Short prompts keep prefill and teacher forcing cheap
        # (the demo's default system prompt is ~400 tokens).
        "prompts": {"system": SYSTEM_PROMPT, "user": USER_PROMPT},
        "rollout": {
            "backend": "hf",
            "mode": "colocate",
            "timeout_s": 60,
            # generous: the first generation of a fresh engine is slow on a loaded CPU
            "infer_timeout_s": 120,
            "decoding": {"max_new_tokens": 16, "temperature": 0.0, "rollout_generate_batch_size": 4},
        },
        "training": {
            "seed": 0,
            "max_steps": 1,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 1,
            "learning_rate": 5.0e-3,
            "lr_scheduler_type": "constant",
            "report_to": [],
            "save_strategy": "no",
            "logging_steps": 1,
        },
        "stage2": {"encode": {"global_max_length": 1024}, "eval": {"at_start": False}},
    }
    return RunConfig.model_validate(deep_merge(base, sections))


EXIT_LOOP_RUNS = int(os.environ.get("ROLLMATCH_EXIT_LOOP_RUNS", "1"))
"""Two-rank runs per variant in the exit loop (issue 22: one in a few CI runs aborted at exit before the fix).
One by default: the check that catches the cause is deterministic (a gloo thread still alive after
`destroy_process_group`: it failed on the first run with the fix removed), and each run costs ~15-30 s of a
suite that must stay under 20 minutes; where another test already runs the same two-rank variant and checks
its exit, that run counts as the loop's first. Set `ROLLMATCH_EXIT_LOOP_RUNS=10` to soak the abort itself."""
EXIT_ABORTS = ("terminate called", "collective threads still alive", "Fatal Python error")


def exit_problems(result: subprocess.CompletedProcess) -> list[str]:
    """What an orderly two-rank exit must not show:
    a non-zero code, `std::terminate`, a leftover gloo thread."""
    output = result.stdout + result.stderr
    problems = [marker for marker in EXIT_ABORTS if marker in output]
    if result.returncode != 0:
        problems.append(f"exit code {result.returncode}")
    return problems


def start_learner_2rank(config: Path, timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """`scripts/start_learner.sh --nproc 2` on `config` (torchrun, gloo), proxies and WORLD_SIZE unset."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "WORLD_SIZE"}
    return subprocess.run(
        ["bash", str(REPO / "scripts" / "start_learner.sh"), "--config", str(config), "--nproc", "2"],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
