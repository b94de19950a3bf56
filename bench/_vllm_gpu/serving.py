"""Stages `vllm` and `hf`: one rollout server of that backend on the VL model, on `--server-gpu`, and on it
the parts of `--parts`:

- `infer`: `--images` image prompts x `--new-tokens` tokens (`ignore_eos`: every engine generates the same
  count), one `/infer/` call timed after a warm-up: tokens/s and requests/s;
- `sync` (vLLM only): full syncs from a learner copy on GPU 0 (perturbed weights) over `--transports` against
  a raw 2-process NCCL broadcast of the same bytes (`bench/_sync_gpu.py`), with the learner-vs-server log-prob
  gap;
- `loop`: `python -m learner` in server mode on GPU 0 (the image demo's data and recipe, every step a rollout
  step, `rollout.async` on, full syncs over nccl, `model.compile_blocks`): steps/s, MFU from `metrics.jsonl`,
  and the GPUs' busy fraction sampled by nvidia-smi. `--loop-batch N` sets `per_device_train_batch_size` (2 N
  samples per step with the recipe's 2 accumulation steps; the packed row grows with it).
"""

from __future__ import annotations

import argparse
import time

import yaml
from _sync_gpu import measure_transport, perturb, raw_broadcast_seconds
from bench_learner import VLM_BASE_CONFIG, read_metrics, run_learner, summarize, write_configs

from _vllm_gpu.common import (
    Bench,
    GpuSampler,
    Server,
    images,
    loop_batch_override,
    messages,
    post_infer,
    short,
    token_count,
    token_prompts,
    via,
)


def serving(bench: Bench, backend: str) -> None:
    """One server of `backend` on the VL model: infer, then (vLLM) sync, then loop."""
    server = bench.start(bench.server_section(bench.vl_model(), backend), f"server-{backend}")
    try:
        bench.guarded(f"{backend}/infer", lambda: infer(bench, server, backend))
        if backend == "vllm" and "sync" in bench.args.parts:
            bench.guarded("vllm/sync", lambda: sync(bench, server))
        if "loop" in bench.args.parts:
            bench.guarded(f"{backend}/loop", lambda: loop(bench, server, backend))
    finally:
        server.stop()


def infer(bench: Bench, server: Server, backend: str) -> None:
    requests = [{"messages": messages(path), "request_id": f"img-{i}"}
                for i, path in enumerate(images(bench.args.images))]  # fmt: skip
    post_infer(server.base, requests[:4], 8)  # warm-up: compiled shapes, processor, caches
    started = time.perf_counter()
    result = post_infer(server.base, requests, bench.args.new_tokens)
    seconds = time.perf_counter() - started
    tokens = token_count(result)
    bench.emit({"measure": "infer_images", "backend": backend, "requests": len(requests),
                "new_tokens": bench.args.new_tokens, "tokens": tokens, "seconds": round(seconds, 3),
                "tokens_per_s": round(tokens / seconds, 1),
                "requests_per_s": round(len(requests) / seconds, 2)})  # fmt: skip


def sync(bench: Bench, server: Server) -> None:
    import torch

    from learner.weights.export import full_state_specs
    from shared_schemas.buckets import plan_buckets

    args = bench.args
    backend = "gloo" if bench.cpu else "nccl"
    model = bench.load_vl_model()  # the served checkpoint itself, perturbed: the learner's "trained" weights
    perturb(model)
    sizes = [b.nbytes for b in plan_buckets(full_state_specs(model), args.bucket_mb * 2**20)]
    nbytes = sum(sizes)
    seconds, ok = raw_broadcast_seconds(backend, sizes)
    bench.emit({"measure": f"ceiling_raw_{backend}_broadcast", "model": "vl2b", "bytes": nbytes,
                "buckets": len(sizes), "seconds": round(seconds, 4),
                "gb_per_s": round(nbytes / seconds / 1e9, 2), "received_ok": ok})  # fmt: skip
    sync_args = argparse.Namespace(cpu_check=bench.cpu, bucket_mb=args.bucket_mb, repeats=3, slow_repeats=1,
                                   staging="auto")  # fmt: skip
    step = 0
    prompts, ceilings, shm = token_prompts(8), {"raw_broadcast": seconds}, bench.tmp / "shm-vllm"
    for transport in ["gloo" if t == "nccl" and bench.cpu else t for t in args.transports]:
        try:
            step = measure_transport(sync_args, bench.emit, model, "vl2b", transport, server.base, shm, step,
                                     prompts, ceilings, nbytes, backend)  # fmt: skip
        except Exception as exc:
            bench.emit({"measure": "error", "stage": f"vllm/sync/{transport}", "error": short(exc)})
            bench.ok = False
    bench.emit({"measure": "nccl_channels", "server": [ln[-200:] for ln in via(server.tail(10**7))][:6]})
    del model
    if not bench.cpu:
        torch.cuda.empty_cache()


def loop(bench: Bench, server: Server, backend: str) -> None:
    args = bench.args
    folder = bench.tmp / f"loop-{backend}"
    steps = args.loop_steps if backend == "vllm" else args.hf_loop_steps
    _, configs = write_configs(folder, server.port, steps, [1], "server", VLM_BASE_CONFIG,
                               bench.vl_model() if not bench.cpu else None,
                               compile_blocks=not bench.cpu)  # fmt: skip
    run: dict = {
        "extends": str(configs[1]),
        "output_dir": str(folder / "run"),
        "rollout": {"timeout_s": 900, "infer_timeout_s": 900,
                    "sync": {"mode": "full", "transport": "gloo" if bench.cpu else "nccl"},
                    "async": {"enabled": True, "max_staleness": 1}},
    }  # fmt: skip
    if bench.same_gpu:  # NCCL cannot put two ranks on one GPU: the server beside the learner syncs by shm
        run["rollout"]["sync"] = {"mode": "full", "transport": "shm", "shm_dir": str(server.shm_dir)}
    run |= loop_batch_override(args.loop_batch)
    (folder / "run.yaml").write_text(yaml.safe_dump(run))
    with GpuSampler() as gpus:
        started = time.perf_counter()
        paths = run_learner(folder / "run.yaml", folder / "run", env=bench.learner_env)
        wall = time.perf_counter() - started
    record = summarize(1, *read_metrics(paths["metrics"]), warmup_steps=2)
    bench.emit({**record, "measure": "loop", "backend": backend, "wall_s": round(wall, 1),
                "per_device_train_batch_size": args.loop_batch or "recipe",
                "gpus": gpus.summary()})  # fmt: skip
    # The run's own record travels with the JSON lines.
    bench.keep(paths["metrics"], f"loop_{backend}_metrics.jsonl")
    bench.keep(folder / "run" / "report.png", f"loop_{backend}_report.png")
