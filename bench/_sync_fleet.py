"""`bench/bench_sync.py --gpu --servers N`: weight sync from one learner GPU to N rollout servers through ONE
collective group (the "N+1" topology: learner on GPU 0, one HF-backend server per GPU 1..N), against 1 server.

Ran on 4 x H200 (`--servers 3 --models 1b 7b`, 2026-11-26; figures in `bench/RESULTS.md`, "the 3 + 1
topology"); `--gpu --cpu-check --servers 2 --models tiny` runs the same flow on CPU (gloo, HF servers on this
host's CPU).

One run, per model (`--models`, the presets of `_sync_gpu.py`; random init on the learner's device, bf16,
saved once for the servers):

1. ceilings: a raw `torch.distributed` broadcast of the manifest's buckets (same sizes, same order) from
   rank 0 (GPU 0) to 1 receiver (GPU 1) and to N receivers (GPUs 1..N), one process per GPU, best of 3 after a
   warm-up: the wire time one collective broadcast over 2 and over N + 1 ranks takes for these bytes;
2. N HF-backend rollout servers, server k on GPU k (`CUDA_VISIBLE_DEVICES` of its process), loaded with W0;
   the learner holds W1 (W0 plus noise);
3. per fleet size (1 server, then all N): one warm-up sync, then `--repeats` timed syncs over the collective
   transport (`nccl`; `gloo` on CPU) through the production path (`WeightSyncPolicy.maybe_sync` →
   `ServerRolloutSource.sync_weights`: one group of 1 + N ranks, one broadcast per bucket, the prepare round,
   the commits); best seconds, GB/s, the stage split, per sync its version and every server's served version
   after it (all equal: each server committed that sync once), and the effect check (the fleet's greedy
   tokens and log-probs against the learner's, after the syncs);
4. `fleet_scaling`: N-server seconds over 1-server seconds next to the raw broadcasts' own ratio. The design
   expects both near 1 (the learner's link carries one copy whatever N; NCCL pipelines each bucket along its
   ring/tree, so the time is bytes / the slowest link + a pipeline fill that grows with N): that is what this
   line is for, not an assumption to quote.

Every figure is one JSON line on stdout (and appended to `--out`).
"""

from __future__ import annotations

__all__ = ["bench_fleet"]

import os
import shutil
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def measure_fleet(
    args: Any, emit: Any, model: Any, preset: str, bases: list[str], backend: str, step: int,
    prompts: list[list[int]], nbytes: int, raw: dict[int, float],
) -> tuple[int, float]:  # fmt: skip
    """Warm-up + timed syncs to every server of `bases` through one group; emits `fleet_sync`. Returns the
    next step and the best seconds."""
    import httpx
    from _sync_gpu import greedy_gap

    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    def versions() -> list[int]:
        return [httpx.get(f"{b}/health", timeout=10).json()["weight_version"] for b in bases]

    policy = WeightSyncPolicy(
        SyncConfig(transport=backend, bucket_mb=args.bucket_mb, collective_timeout_s=300)
    )
    with ServerRolloutSource(bases, timeout_s=900, transport=backend, bucket_mb=args.bucket_mb,
                             collective_timeout_s=300) as source:  # fmt: skip
        policy.version = max(versions())
        runs = []
        for _ in range(args.repeats + 1):
            seconds = policy.maybe_sync(model, step, source)
            step += 1
            runs.append((seconds, dict(source.last_sync_stages), [policy.version, versions()]))
        effect = greedy_gap(source, model, prompts)
    timed = runs[1:] or runs
    seconds, stages, _ = min(timed, key=lambda r: r[0])
    world = len(bases) + 1
    record = {
        "measure": "fleet_sync", "model": preset, "transport": backend, "servers": len(bases),
        "world_size": world, "bytes": nbytes, "bucket_mb": args.bucket_mb, "seconds": round(seconds, 4),
        "all_seconds": [round(r[0], 4) for r in timed], "gb_per_s": round(nbytes / seconds / 1e9, 3),
        "stages": {k: (round(v, 4) if k.endswith("_s") else v) for k, v in stages.items()},
        "sync_version_and_served_versions": [r[2] for r in runs], "effect_after_sync": effect,
    }  # fmt: skip
    if world in raw:
        record[f"over_raw_{backend}_broadcast_{world}_ranks"] = round(raw[world] / seconds, 3)
    emit(record)
    return step, seconds


def bench_fleet(args: Any, tmp: Path) -> None:
    import torch
    from _sync_gpu import Emitter, _free

    cpu = args.cpu_check
    n = args.servers
    common: dict[str, Any] = {"bench": "bench_sync --gpu --servers", "cpu_check": cpu}
    if not cpu:
        count = torch.cuda.device_count()
        if count < n + 1:
            raise SystemExit(
                f"--servers {n} needs {n + 1} GPUs (learner on GPU 0, servers on 1..{n}); {count} visible"
            )
        common["gpus"] = [torch.cuda.get_device_name(i) for i in range(count)]
    gpus = (
        [g.strip() for g in args.server_gpus.split(",")]
        if args.server_gpus
        else [str(k) for k in range(1, n + 1)]
    )
    if len(gpus) != n:
        raise SystemExit(f"--server-gpus lists {len(gpus)} GPUs for --servers {n}")
    emit = Emitter(Path(args.out) if args.out else None, common)
    emit({"measure": "host", "servers": n, "server_gpus": None if cpu else gpus, "torch": torch.__version__})
    for preset in args.models:
        shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
        root = Path("/dev/shm") if shm_free > 3 * 16e9 else REPO / ".cache"
        model_dir = root / f"bench-fleet-{preset}-{os.getpid()}"
        try:
            fleet_model(args, tmp, emit, preset, model_dir, gpus)  # its model is freed when it returns
        except Exception as exc:  # one model failing must not lose the next one's figures
            emit({"measure": "error", "model": preset, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        _free()
        shutil.rmtree(model_dir, ignore_errors=True)
        for log in tmp.glob(f"fleet-{preset}-*.log") if args.server_log_dir else ():
            shutil.copy(log, Path(args.server_log_dir) / log.name)


def fleet_model(args: Any, tmp: Path, emit: Any, preset: str, model_dir: Path, gpus: list[str]) -> None:
    """Steps 1-4 of the module docstring for one model."""
    import torch
    from _sync_gpu import _free, build_model, perturb, raw_broadcast_seconds, server_config
    from launcher_utils import running

    from learner.weights.export import full_state_specs
    from shared_schemas.buckets import plan_buckets

    cpu, n = args.cpu_check, len(gpus)
    backend = "gloo" if cpu else "nccl"
    model = build_model(preset, "cpu" if cpu else "cuda:0", model_dir)
    perturb(model)
    sizes = [b.nbytes for b in plan_buckets(full_state_specs(model), args.bucket_mb * 2**20)]
    nbytes = sum(sizes)
    emit(
        {
            "measure": "model",
            "model": preset,
            "bytes": nbytes,
            "buckets": len(sizes),
            "bucket_mb": args.bucket_mb,
        }
    )
    raw: dict[int, float] = {}
    for world in sorted({2, n + 1}):
        seconds, ok = raw_broadcast_seconds(backend, sizes, world=world)
        raw[world] = seconds
        emit({
            "measure": f"ceiling_raw_{backend}_broadcast", "model": preset, "world_size": world,
            "bytes": nbytes, "seconds": round(seconds, 4), "gb_per_s": round(nbytes / seconds / 1e9, 2),
            "received_ok": ok,
        })  # fmt: skip
    _free()
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(10, 1400, (24,), generator=gen).tolist() for _ in range(args.prompts)]
    with ExitStack() as stack:
        bases, contexts = [], []
        started = time.perf_counter()
        for k, gpu in enumerate(gpus):
            config, base, _ = server_config(model_dir, tmp, f"fleet-{preset}-{k}", args.staging)
            cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
            if not cpu:
                cmd = ["env", f"CUDA_VISIBLE_DEVICES={gpu}", *cmd]
            log = tmp / f"fleet-{preset}-{k}.log"
            contexts.append(running(cmd, f"{base}/health", log, deadline_s=900))
            bases.append(base)
        with ThreadPoolExecutor(max_workers=len(contexts)) as pool:  # load the servers side by side
            list(pool.map(stack.enter_context, contexts))
        emit({"measure": "servers_start", "model": preset, "servers": n,
              "seconds": round(time.perf_counter() - started, 1)})  # fmt: skip
        step, best = 0, {}
        for count in sorted({1, n}):
            step, best[count] = measure_fleet(
                args, emit, model, preset, bases[:count], backend, step, prompts, nbytes, raw
            )
    emit({"measure": "fleet_scaling", "model": preset, "servers": n,
          "sync_seconds_1": round(best[1], 4), f"sync_seconds_{n}": round(best[n], 4),
          f"sync_{n}_over_1": round(best[n] / best[1], 3),
          f"raw_broadcast_{n + 1}_over_2_ranks": round(raw[n + 1] / raw[2], 3)})  # fmt: skip
