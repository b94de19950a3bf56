"""`/infer/` against vLLM's own OpenAI server, shared by `bench/bench_server.py` (CPU) and
`bench/bench_vllm_gpu.py --stages openai` (GPU): the same token-id prompts through ONE `/infer/` call and ONE
`/v1/completions` call, `ignore_eos` so both generate the same number of tokens, each timed after a short
warm-up call; the two servers run one after the other, never together. vLLM's server gets the engine args
our server builds from the same `server:` section (`engine_kwargs_from_config`), as command-line flags.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import yaml
from launcher_utils import free_port, running, server_env

__all__ = ["infer_vs_openai", "openai_command"]

OURS_ONLY = ("worker_extension_cls", "weight_transfer_config")
"""Engine args of our server that only its weight sync uses (idle while generating); vLLM's server has no
worker extension of ours to load."""
FLAGS_ONLY = ("disable_log_stats",)
"""vLLM command-line switches without a `--no-` form."""


def openai_command(
    section: dict[str, Any], port: int, env: dict[str, str]
) -> tuple[list[str], dict[str, str]]:
    """Command and environment (`env` plus what our server's launcher would set) of
    `python -m vllm.entrypoints.openai.api_server` on the engine args of the `server:` section `section`: its
    GPUs, on CPU its KV-cache size, and for a Qwen-VL checkpoint the torchvision-free import shim on
    `PYTHONPATH` (it switches itself off where torchvision imports)."""
    from vllm.platforms import current_platform

    from rollout_server.config import ServerConfig
    from rollout_server.engines.vllm.params import engine_kwargs_from_config
    from shared_schemas.checkpoints import is_vl_checkpoint
    from shared_schemas.vlm_shim import SHIM_DIR

    cfg = ServerConfig.model_validate(section)
    kwargs = engine_kwargs_from_config(cfg, cpu=current_platform.is_cpu())
    cmd = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if key in OURS_ONLY or value is None:
            continue
        if key in FLAGS_ONLY:
            cmd += [flag] if value else []
        elif isinstance(value, bool):
            cmd.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, dict):
            cmd += [flag, json.dumps(value)]
        else:
            cmd += [flag, str(value)]
    env = dict(env)
    if is_vl_checkpoint(cfg.model_path):
        env["PYTHONPATH"] = os.pathsep.join([str(SHIM_DIR), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    if cfg.gpus:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(str(g) for g in cfg.gpus)
    if cfg.vllm.kv_cache_space_gb is not None:
        env["VLLM_CPU_KVCACHE_SPACE"] = str(cfg.vllm.kv_cache_space_gb)
    return cmd, env


def time_ours(base: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    body = {
        "infer_requests": [{"prompt_token_ids": p} for p in prompts],
        "request_config": {"max_tokens": new_tokens, "temperature": 0.0, "ignore_eos": True, "seed": 0},
    }
    t0 = time.perf_counter()
    resp = httpx.post(f"{base}/infer/", json=body, timeout=3600)
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    return elapsed, sum(len(r["choices"][0]["token_ids"]) for r in resp.json()["results"])


def time_openai(base: str, model: str, prompts: list[list[int]], new_tokens: int) -> tuple[float, int]:
    body = {
        "model": model, "prompt": prompts, "max_tokens": new_tokens, "temperature": 0.0,
        "ignore_eos": True, "seed": 0,
    }  # fmt: skip
    t0 = time.perf_counter()
    resp = httpx.post(f"{base}/v1/completions", json=body, timeout=3600)
    elapsed = time.perf_counter() - t0
    resp.raise_for_status()
    return elapsed, int(resp.json()["usage"]["completion_tokens"])


def infer_vs_openai(
    section: dict[str, Any],
    tmp: Path,
    prompts: list[list[int]],
    warm: list[list[int]],
    new_tokens: int,
    *,
    env: dict[str, str] | None = None,
    deadline_s: float = 600,
) -> dict[str, Any]:
    """Our server on `section`, then vLLM's OpenAI server on the same engine args: the `infer_throughput`
    record (tokens/s of each, `ratio` = ours / vLLM's, each server's start-up seconds).

    Raises:
        RuntimeError: a server did not start (its log is named).
        httpx.HTTPStatusError: a server refused the timed call.
    """
    env = env if env is not None else server_env()
    config = tmp / "ours.yaml"
    config.write_text(yaml.safe_dump({"server": section}))
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
    base = f"http://127.0.0.1:{section['port']}"
    with running(cmd, f"{base}/health", tmp / "ours.log", deadline_s, env) as start_s:
        time_ours(base, warm, 8)
        ours_s, ours_tokens = time_ours(base, prompts, new_tokens)
    port = free_port()
    cmd, openai_env = openai_command(section, port, env)
    base = f"http://127.0.0.1:{port}"
    with running(cmd, f"{base}/health", tmp / "vllm_openai.log", deadline_s, openai_env) as vllm_start_s:
        time_openai(base, str(section["model"]), warm, 8)
        vllm_s, vllm_tokens = time_openai(base, str(section["model"]), prompts, new_tokens)
    ours_tps, vllm_tps = ours_tokens / ours_s, vllm_tokens / vllm_s
    return {
        "measure": "infer_throughput",
        "prompts": len(prompts),
        "new_tokens": new_tokens,
        "ours_tokens": ours_tokens,
        "vllm_tokens": vllm_tokens,
        "ours_s": round(ours_s, 3),
        "vllm_openai_s": round(vllm_s, 3),
        "ours_tok_per_s": round(ours_tps, 1),
        "vllm_openai_tok_per_s": round(vllm_tps, 1),
        "ratio": round(ours_tps / vllm_tps, 3),
        "ours_start_s": round(start_s, 1),
        "vllm_openai_start_s": round(vllm_start_s, 1),
        "vllm_openai_command": " ".join(cmd[3:]),
    }
