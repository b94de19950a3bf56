"""Stage `colocate`: colocated vLLM on GPU 0 alone (`rollout.mode: colocate`, sleep level 1 between rollouts
on GPU; no sleep mode on CPU), in two parts:

- `check` (always), through the public colocate API in this process (`ColocateRolloutSource.from_config` on
  the loop's own run config): the GPU memory the engine holds built and asleep, after a sync (weights awake),
  while it generates (its processes' peak, nvidia-smi per process) and asleep again — from
  `torch.cuda.mem_get_info` deltas against the memory free before the engine was built, so this process's
  own allocations cancel out; and whether the weights are equal after the in-process sync: the largest
  log-prob gap between the learner's model (the checkpoint, perturbed) and the engine's greedy tokens on the
  same prompts, before and after one full sync (bf16 noise after it); then `--colocate-syncs N` more full
  syncs, each split into its phases (`ColocateRolloutSource.last_sync_stages`: cast, handoff, commit) next to
  the bound: a device-to-device `copy_` of the same bytes timed in this run (commit ÷ bound: how far the
  commit is from a plain copy; `--handoff` picks `rollout.vllm.weight_handoff`);
- `loop` (`--colocate-steps N`, 0: none): `python -m learner` on that config, N steps: steps/s, the time
  split, and each process's GPU memory (min = asleep, max = awake) from nvidia-smi per process. With
  `--colocate-plain-steps P` the run first trains P plain-SFT steps (`stage2.sft_warmup_steps`), so the same
  run prices a rollout-matching step against a plain one (`rm_over_plain`) and against its bound, the
  step's own rollout seconds plus a plain step (`rm_over_bound`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from _sync_gpu import greedy_gap, perturb
from bench_learner import ROLLOUT_KEYS, VLM_BASE_CONFIG, read_metrics, run_learner, summarize, write_configs
from launcher_utils import free_port

from _vllm_gpu.common import Bench, GpuSampler, ProcessMemorySampler, loop_batch_override, token_prompts

GIB = float(1 << 30)


def colocate(bench: Bench) -> None:
    run = _run_config(bench)
    bench.guarded("colocate/check", lambda: check(bench, run))
    if bench.args.colocate_steps:
        bench.guarded("colocate/loop", lambda: loop(bench, run))


def _run_config(bench: Bench) -> Path:
    folder = bench.tmp / "colocate"
    model = bench.vl_model() if not bench.cpu else None
    steps = max(1, bench.args.colocate_steps) + bench.args.colocate_plain_steps
    _, configs = write_configs(folder, free_port(), steps, [1], "server", VLM_BASE_CONFIG,
                               model, compile_blocks=not bench.cpu)  # fmt: skip
    # The engine in the learner's dtype: float32 weights synced into a bf16 engine differ by bf16 noise.
    dtype = "float32" if bench.cpu else "bfloat16"
    vllm: dict[str, Any] = {"max_model_len": 2048, "gpu_memory_utilization": 0.35, "dtype": dtype,
                            "weight_handoff": bench.args.handoff}  # fmt: skip
    if bench.cpu:
        vllm["enforce_eager"] = True  # as the colocate integration tests: no CPU compile
    else:
        vllm["sleep_level"] = bench.args.sleep_level
    overrides = loop_batch_override(bench.args.loop_batch)
    run = folder / "run.yaml"
    run.write_text(yaml.safe_dump({
        **overrides,
        "extends": str(configs[1]),
        "output_dir": str(folder / "run"),
        "rollout": {"mode": "colocate", "backend": "vllm", "servers": [], "vllm": vllm},
        "stage2": {**overrides.get("stage2", {}), "sft_warmup_steps": bench.args.colocate_plain_steps},
    }))  # fmt: skip
    return run


def check(bench: Bench, run: Path) -> None:
    import torch

    from learner.config import load_run_config
    from learner.rollout.colocate import ColocateRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    cfg = load_run_config(run)
    model = bench.load_vl_model()
    perturb(model)  # the learner's "trained" weights: the engine serves the checkpoint until the first sync
    prompts = token_prompts(8)
    memory = _FreeMemory(bench.cpu)
    with ProcessMemorySampler() as processes:
        memory.mark("before_engine")
        with ColocateRolloutSource.from_config(cfg, model=model, tokenizer=None) as source:
            memory.mark("engine_built")  # asleep on GPU: from_config puts it to sleep until the first sync
            before = greedy_gap(source, model, prompts)  # wakes it, generates, sleeps again
            memory.mark("asleep_after_generate")
            policy = WeightSyncPolicy(SyncConfig(mode="full"), is_rank0=lambda: source.sends_weights)
            seconds = policy.maybe_sync(model, 0, source)
            memory.mark("after_sync")  # weights awake, KV cache still asleep
            after = greedy_gap(source, model, prompts)
            memory.mark("asleep_after_generate_2")
            perturb(model)  # new weights again: the timed syncs (copy plan) must serve these, not sync 0's
            stale = greedy_gap(source, model, prompts)
            syncs = [
                _timed_sync(policy, model, source, step) for step in range(1, bench.args.colocate_syncs + 1)
            ]
            replayed = greedy_gap(source, model, prompts) if syncs else None
            rpc = _rpc_round_trip_seconds(source)
        memory.mark("engine_closed")
    bench.emit({"measure": "colocate_weights_equal", "sleep_level": cfg.rollout.vllm.sleep_level,
                "before_sync": before, "after_sync": after, "sync_s": round(seconds, 3),
                "before_timed_syncs": stale, "after_timed_syncs": replayed,
                "sync_bytes": policy.last_report.bytes if policy.last_report else None})  # fmt: skip
    if syncs:
        nbytes = syncs[0]["bytes"]
        bound = _copy_seconds(nbytes, bench.device)
        for row in syncs:
            row |= {
                "bound_copy_s": round(bound, 4),
                "commit_over_bound": round(row["commit_s"] / max(bound, 1e-9), 2),
                # the worker's copy alone (the commit less its RPC round trip)
                "worker_copy_over_bound": round(row["worker_copy_s"] / max(bound, 1e-9), 2),
            }
        # A sync is two engine RPCs (stage, commit) around the copy: no protocol of this shape beats that.
        floor = 2 * rpc + bound
        bench.emit({"measure": "colocate_sync_phases", "handoff": cfg.rollout.vllm.weight_handoff,
                    "bytes": nbytes, "bound_copy_s": round(bound, 4), "rpc_round_trip_s": round(rpc, 4),
                    "sync_floor_s": round(floor, 4),
                    "sync_floor_over_copy": round(floor / max(bound, 1e-9), 2),
                    "syncs": syncs})  # fmt: skip
    bench.emit({"measure": "colocate_memory", "sleep_level": cfg.rollout.vllm.sleep_level,
                "gpu_memory_utilization": cfg.rollout.vllm.gpu_memory_utilization,
                "engine_gib": memory.engine_gib(), "processes": processes.summary()})  # fmt: skip
    del model
    if not bench.cpu:
        torch.cuda.empty_cache()


def _timed_sync(policy: Any, model: Any, source: Any, step: int) -> dict[str, Any]:
    """One full sync at `step`: its phases (s) from the source, its total and its bytes."""
    total = policy.maybe_sync(model, step, source)
    stages = source.last_sync_stages
    phases = ("cast_s", "handoff_s", "commit_s", "worker_copy_s", "commit_planned", "wake_s", "apply_s")
    row = {k: round(stages.get(k, 0.0), 4) for k in phases}
    nbytes = policy.last_report.bytes if policy.last_report else 0
    handoff = getattr(source.backend, "handoff", None)
    return {"step": step, "handoff": handoff, **row, "total_s": round(total, 4), "bytes": nbytes}


def _rpc_round_trip_seconds(source: Any, repeats: int = 20) -> float:
    """Best of `repeats` no-op `collective_rpc` round trips to the colocated engine's workers (the discard of
    an empty stage): the latency floor of each of a sync's two engine calls."""
    import time

    from rollout_server.engines.vllm.worker import DISCARD_METHOD

    backend = source.backend  # reaches into the backend's engine: a measurement, not an API
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        backend._call(backend._engine._llm.collective_rpc(DISCARD_METHOD), 30.0, what="no-op rpc")
        best = min(best, time.perf_counter() - started)
    return best


def _copy_seconds(nbytes: int, device: Any, repeats: int = 5) -> float:
    """Best of `repeats` device-to-device `copy_` of `nbytes` bytes on `device` (the commit's lower bound)."""
    import time

    import torch

    src = torch.empty(max(nbytes, 1), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        started = time.perf_counter()
        dst.copy_(src)
        if src.is_cuda:
            torch.cuda.synchronize(src.device)
        best = min(best, time.perf_counter() - started)
    return best


class _FreeMemory:
    """`torch.cuda.mem_get_info` of GPU 0 at named points (nothing on CPU)."""

    def __init__(self, cpu: bool) -> None:
        self.cpu = cpu
        self.free: dict[str, int] = {}

    def mark(self, point: str) -> None:
        if not self.cpu:
            import torch

            torch.cuda.synchronize(0)
            self.free[point] = torch.cuda.mem_get_info(0)[0]

    def engine_gib(self) -> dict[str, float]:
        """GiB the engine's processes hold at each point: free memory before the engine minus free now."""
        base = self.free.get("before_engine")
        return {k: round((base - v) / GIB, 2) for k, v in self.free.items() if base is not None}


def loop(bench: Bench, run: Path) -> None:
    folder = run.parent
    with GpuSampler() as gpus, ProcessMemorySampler() as processes:
        paths = run_learner(run, folder / "run", env=bench.learner_env)
    steps, summary = read_metrics(paths["metrics"])
    record = summarize(1, steps, summary, warmup_steps=2)
    bench.keep(paths["metrics"], "colocate_metrics.jsonl")
    bench.emit({**record, "measure": "colocate", "sleep_level": 0 if bench.cpu else bench.args.sleep_level,
                "per_device_train_batch_size": bench.args.loop_batch or "recipe",
                **step_costs(steps, bench.args.colocate_plain_steps),
                "processes": processes.summary(), "gpus": gpus.summary()})  # fmt: skip


def step_costs(steps: list[dict[str, Any]], plain_steps: int) -> dict[str, Any]:
    """Seconds of a plain-SFT step and of a rollout-matching step of ONE run (the first `plain_steps` are
    plain), by the wall clock between consecutive step records; each phase's first step (one-off costs:
    kernel selection, the engine's first wake) is left out. `rm_over_bound` divides a rollout-matching step
    by its bound: its own rollout (generation + sync) seconds plus a plain step. Empty when either phase has
    fewer than two steps."""
    walls = {int(r["step"]): float(r["wall_s"]) for r in steps}
    rollout = {int(r["step"]): sum(float(r.get(k) or 0.0) for k in ROLLOUT_KEYS) for r in steps}
    plain = [walls[s] - walls[s - 1] for s in sorted(walls) if 2 < s <= plain_steps and s - 1 in walls]
    rm = [walls[s] - walls[s - 1] for s in sorted(walls) if s > plain_steps + 1 and s - 1 in walls]
    if not plain or not rm:
        return {}
    plain_s, rm_s = sum(plain) / len(plain), sum(rm) / len(rm)
    rm_rollout = [rollout[s] for s in sorted(walls) if s > plain_steps + 1 and s - 1 in walls]
    bound = plain_s + sum(rm_rollout) / len(rm_rollout)
    return {"plain_step_s": round(plain_s, 3), "rm_step_s": round(rm_s, 3),
            "rm_rollout_s": round(sum(rm_rollout) / len(rm_rollout), 3),
            "rm_over_plain": round(rm_s / plain_s, 2), "rm_bound_s": round(bound, 3),
            "rm_over_bound": round(rm_s / bound, 2), "plain_steps_timed": len(plain),
            "rm_steps_timed": len(rm)}  # fmt: skip
