"""Stage `grpo`: GRPO on image prompts with the rollout server on `--server-gpu`, vLLM backend then HF backend
(same GPU, same run), the learner on GPU 0: `bench/bench_grpo.py --vlm` scaled up.

The model is the tiny Qwen3-VL of the image GRPO demo (`configs/grpo_tiny_vlm_cpu.yaml`), not the VL-2B shapes
of the other stages: GRPO needs a policy whose answers the summary rewards can tell apart, and only the tiny
model has such a warm start (`scripts/build_grpo_demo_data.py --vlm`: a short SFT on the image rows); a
random-init 2B model scores 0 on every completion, so its advantages are all 0 and nothing is learnt. On GPU
the step is scaled instead: `--grpo-prompts` prompts x `--grpo-generations` completions per step (default
32 x 8 = 256, the CPU demo's 8 x 4 = 32), the learner in float32 (the demo's), the server in bf16 (full syncs
are cast to it), vLLM eager as in the demo. Per backend one `grpo` line: the reward curve (first / last
`--window` steps' mean of the first-round reward, and whether the rise beats the step-to-step spread),
steps/s, and the time split per step (generation, policy forward/backward, reference, sync); then
`grpo_vllm_over_hf`.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from bench_grpo import learns, step_records, summary_line, write_config
from bench_learner import run_learner
from launcher_utils import free_port, repo_python

from _vllm_gpu.common import REPO, Bench
from learner.report import load_metrics

MICRO_BATCH = 64
"""Completions per learner micro-batch on GPU (the step's accumulation steps follow)."""


def grpo(bench: Bench) -> None:
    subprocess.run([repo_python(REPO), "scripts/build_grpo_demo_data.py", "--vlm"], cwd=REPO, check=True,
                   stdout=subprocess.DEVNULL)  # fmt: skip
    records = {}
    for backend in bench.args.grpo_backends:
        bench.guarded(f"grpo/{backend}", lambda b=backend: records.update({b: run(bench, b)}))
    if {"vllm", "hf"} <= records.keys():
        fast, slow = records["vllm"], records["hf"]
        bench.emit({"measure": "grpo_vllm_over_hf",
                    "steps_per_s": round(fast["steps_per_s"] / slow["steps_per_s"], 3),
                    "generate_s_per_step": round(slow["generate_s_per_step"]
                                                 / max(1e-9, fast["generate_s_per_step"]), 3)})  # fmt: skip


def run(bench: Bench, backend: str) -> dict[str, Any]:
    """One GRPO run against a fresh server of `backend`; emits and returns its `grpo` line."""
    args = bench.args
    folder = bench.tmp / f"grpo-{backend}"
    port = free_port()
    parent = write_config(folder, port, args.grpo_steps, 1, vlm=True, server_backend=backend)
    config: dict[str, Any] = {
        "extends": str(parent),
        "rollout": {"timeout_s": 900, "infer_timeout_s": 900},
        "server": {"hf": {"batch_size": args.hf_batch}, "vllm": {}},  # GRPO allows no startup_timeout_s
    }
    if not bench.cpu:
        completions = args.grpo_prompts * args.grpo_generations
        gpu = int(args.server_gpu)
        config["server"].update(gpus=[gpu], dtype="bfloat16")
        config["server"]["vllm"].update(max_num_seqs=max(64, completions))
        config["grpo"] = {"num_generations": args.grpo_generations}
        config["batch_plan"] = {"effective_batch_size": completions,
                                "per_device_batch_size": min(MICRO_BATCH, completions),
                                "server_gpus": [gpu], "train_gpus": [0]}  # fmt: skip
    path = folder / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    server = bench.start(None, f"grpo-server-{backend}", path=path)
    load_start = os.getloadavg()
    try:
        paths = run_learner(path, folder / "run", env=bench.learner_env)
    finally:
        server.stop()
    steps = step_records(paths["metrics"])
    summary = summary_line(steps, args.window, 1, load_start, vlm=True)
    rewards = [r["reward/first_round_total_mean"] for r in steps]
    runtime = _train_runtime(paths["metrics"])
    record = {
        "measure": "grpo",
        "backend": backend,
        "model": "tiny-qwen3-vl-grpo-warm",
        "completions_per_step": int(config.get("batch_plan", {}).get("effective_batch_size", 32)),
        "steps_per_s": round(len(steps) / runtime, 4),
        "train_runtime_s": round(runtime, 1),
        "generate_share": round(sum(r.get("time/generate_s") or 0.0 for r in steps) / runtime, 3),
        **{
            k: v
            for k, v in summary.items()
            if k not in ("bench", "loadavg_start", "loadavg_end", "cpu_count")
        },
        **learns(rewards, summary["window"]),
    }
    bench.emit(record)
    bench.keep(paths["metrics"], f"grpo_{backend}_metrics.jsonl")
    return record


def _train_runtime(metrics: Path) -> float:
    """HF's `train_runtime` of a run's `metrics.jsonl` (its last summary record)."""
    runtimes = [r["train_runtime"] for r in load_metrics(metrics) if "train_runtime" in r]
    if not runtimes:
        raise RuntimeError(f"{metrics}: no train_runtime record")
    return float(runtimes[-1])
