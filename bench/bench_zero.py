"""DDP vs DeepSpeed ZeRO-2 vs ZeRO-3 on several GPUs: what each rank holds, peak memory, and the first losses.

    # torchrun is started by this script:
    python bench/bench_zero.py --nproc 2 [--model vlm-2b|tiny-vlm|tiny-text] [--rollout colocate|server]

Per strategy it runs ``python -m learner`` under ``torchrun --nproc_per_node N`` on the image demo's records
(``configs/demo_vlm_cpu.yaml``; ``tiny-text``: the text demo's, ``configs/demo_tiny_cpu.yaml``):
``--warmup`` plain-GT steps, then rollout-matching steps, whose rollouts need the policy's FULL weights.
``--rollout colocate`` (default): the in-process HF engine (no vLLM on the GPU machines; the learner refuses
ZeRO-3 with it). ``--rollout server``: an HF-backend rollout server on the last GPU
(``CUDA_VISIBLE_DEVICES``, shared with the last rank), every rollout-matching step starts with a full weight
sync over ``nccl`` (``gloo`` on CPU) — under ZeRO-3 every rank gathers each bucket and rank 0 sends it. After
the run the server's greedy answers are checked against the weights it should serve (the checkpoint saved
one step before the last, whose weights the last step's sync sent): the log-prob gap of the server's
greedy tokens under that checkpoint, teacher-forced on GPU 0. Same seed and data for every strategy.

Prints one JSON line per strategy: the strategy the learner MEASURED (``learner.trainers.strategy``: the
engine's ZeRO stage, not the config), per-rank parameter / gradient / optimizer-state bytes, per-step loss and
``memory/peak_allocated_gib`` (rank 0), and the rollout F1 of the rollout-matching steps; then one line with
the ratios of optimizer-state bytes to DDP's (ZeRO-2 partitions the state over the ranks, so about 1/N of
DDP's when both keep fp32 state). GPU only for ZeRO (DeepSpeed's optimizers are CUDA); ``--strategies ddp``
runs on CPU with gloo.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from learner.report import load_metrics  # noqa: E402

DEEPSPEED = {"ddp": None, "zero2": "configs/deepspeed/zero2.json", "zero3": "configs/deepspeed/zero3.json"}
REPORT = re.compile(
    r"rank (\d+)/(\d+): (\w+), parameters ([\d.]+) GiB, gradients ([\d.]+) GiB, optimizer state ([\d.]+) GiB"
)


def write_config(
    out: Path,
    strategy: str,
    model: Path,
    steps: int,
    warmup: int,
    cuda: bool,
    train: Path | None,
    server_url: str | None = None,
    text: bool = False,
) -> Path:
    training: dict[str, Any] = {
        "max_steps": steps,
        "per_device_train_batch_size": 4,
        "gradient_accumulation_steps": 1,
        "eval_strategy": "no",
        "save_strategy": "no",
        "report_to": [],
        "seed": 0,
        "bf16": cuda,
        "logging_steps": 1,
    }
    if DEEPSPEED[strategy]:
        training["deepspeed"] = str(REPO / DEEPSPEED[strategy])
    if not cuda:
        training["use_cpu"] = True
    rollout: dict[str, Any] = {
        "mode": "colocate",
        "backend": "hf",
        "decoding": {"max_new_tokens": 96, "rollout_generate_batch_size": 8},
    }
    if server_url is not None:
        # The checkpoint of step `steps - 1` holds the weights the last step's sync sent (the effect check).
        training.update(save_strategy="steps", save_steps=steps - 1, save_only_model=True)
        rollout.update(
            mode="server", servers=[{"base_url": server_url}],
            sync={"mode": "full", "transport": "nccl" if cuda else "gloo", "bucket_mb": 512},
        )  # fmt: skip
    config = {
        "extends": str(REPO / "configs" / ("demo_tiny_cpu.yaml" if text else "demo_vlm_cpu.yaml")),
        "output_dir": str(out / strategy),
        "model": {"path": str(model), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"eval": [], **({"train": [str(train)]} if train is not None else {})},
        "rollout": rollout,
        "training": training,
        "stage2": {"sft_warmup_steps": warmup, "eval": {"at_start": False}},
        "save_final_model": False,
    }
    import yaml

    path = out / f"{strategy}.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def run(config: Path, nproc: int, log: Path, port: int) -> int:
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
           str(port), "-m", "learner", "--config", str(config)]  # fmt: skip
    with log.open("w") as fh:
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode


def read(out: Path, strategy: str, log: Path) -> dict[str, Any]:
    text = log.read_text()
    ranks = [
        {"rank": int(m[0]), "strategy": m[2], "param_gib": float(m[3]), "grad_gib": float(m[4]),
         "optimizer_state_gib": float(m[5])}
        for m in REPORT.findall(text)
    ]  # fmt: skip
    steps = [r for r in load_metrics(out / strategy / "metrics.jsonl") if "loss" in r]
    return {
        "bench": "zero",
        "strategy_asked": strategy,
        "strategy_measured": ranks[0]["strategy"] if ranks else None,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "loss": [round(r["loss"], 4) for r in steps],
        "peak_allocated_gib_rank0": [r.get("memory/peak_allocated_gib") for r in steps],
        "rollout_f1": [round(r["rollout/f1"], 3) for r in steps if "rollout/f1" in r],
    }


def server_effect(model_dir: Path, checkpoint: Path, url: str, device: str) -> dict[str, Any]:
    """The server's greedy tokens on random prompts vs `checkpoint` teacher-forced on `device`."""
    import torch
    from _sync_gpu import greedy_gap
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    from learner.rollout.server_source import ServerRolloutSource
    from shared_schemas.checkpoints import is_vl_checkpoint

    loader = AutoModelForImageTextToText if is_vl_checkpoint(model_dir) else AutoModelForCausalLM
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    policy = loader.from_pretrained(checkpoint, dtype=dtype).to(device).eval()
    gen = torch.Generator().manual_seed(0)
    vocab = min(int(policy.config.get_text_config().vocab_size), 1400)
    prompts = [torch.randint(10, vocab, (24,), generator=gen).tolist() for _ in range(8)]
    with ServerRolloutSource([url], timeout_s=300) as source:
        after = greedy_gap(source, policy, prompts)
    base = loader.from_pretrained(model_dir, dtype=dtype).to(device).eval()
    with ServerRolloutSource([url], timeout_s=300) as source:
        versus_initial = greedy_gap(source, base, prompts)
    return {"checkpoint": checkpoint.name, "gap_vs_synced_checkpoint": after,
            "gap_vs_initial_weights": versus_initial}  # fmt: skip


def start_server(out: Path, model: Path, cuda: bool, gpu: str) -> tuple[list[str], str, Path]:
    """Command, base URL and log of an HF-backend rollout server on `model` (on GPU `gpu` with CUDA)."""
    import yaml
    from launcher_utils import free_port

    port = free_port()
    section = {"port": port, "model": str(model), "backend": "hf", "dtype": "bfloat16" if cuda else "float32",
               "seed": 0, "sync_staging": "auto", "max_body_mb": 4096, "hf": {"batch_size": 8}}  # fmt: skip
    config = out / "server.yaml"
    config.write_text(yaml.safe_dump({"server": section}))
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
    if cuda:
        cmd = ["env", f"CUDA_VISIBLE_DEVICES={gpu}", *cmd]
    return cmd, f"http://127.0.0.1:{port}", out / "server.log"


def read_syncs(run_dir: Path) -> dict[str, Any]:
    """Weight-sync figures of the run's metrics records (seconds and bytes per sync)."""
    records = load_metrics(run_dir / "metrics.jsonl")
    seconds = [r["time/weight_sync_s"] for r in records if r.get("time/weight_sync_s")]
    return {"count": len(seconds), "seconds": [round(x, 4) for x in seconds],
            "keys": sorted(k for r in records for k in r if "sync" in k)[:20]}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero2,zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", choices=("vlm-2b", "tiny-vlm", "tiny-text"), default="vlm-2b")
    parser.add_argument("--rollout", choices=("colocate", "server"), default="colocate")
    parser.add_argument("--server-gpu", default=None, help="--rollout server: its GPU (default: the last)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="plain-GT steps before rollout-matching ones")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_zero")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    text = args.model == "tiny-text"
    train: Path | None = None
    if not text:
        data = out / "data"  # 256 records of the image demo's generator: steps x ranks x 4 need no more
        subprocess.run([sys.executable, "scripts/build_vlm_demo_data.py", "--out", str(data),
                        "--n-train", "256", "--n-eval", "8"],
                       cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        train = data / "train.jsonl"
    if text:
        from bench_learner import build_demo_assets

        build_demo_assets()
        import yaml

        model = REPO / yaml.safe_load((REPO / "configs" / "demo_tiny_cpu.yaml").read_text())["model"]["path"]
    elif args.model == "vlm-2b":
        from _vlm import save_vlm_2b

        model = save_vlm_2b(out / "qwen3-vl-2b-shapes", "cuda" if cuda else "cpu")
    else:
        subprocess.run([sys.executable, "scripts/build_tiny_vlm.py", "--out", ".cache/models", "--preset",
                        "tiny-qwen3-vl-demo"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        model = REPO / ".cache" / "models" / "tiny-qwen3-vl-demo"
    results = {}
    for k, strategy in enumerate(args.strategies.split(",")):
        log = out / f"{strategy}.log"
        server = contextlib.nullcontext(0.0)
        url = None
        if args.rollout == "server":
            from launcher_utils import running

            gpu = args.server_gpu or str(max(torch.cuda.device_count() - 1, 0))
            (out / strategy).mkdir(parents=True, exist_ok=True)
            cmd, url, server_log = start_server(out / strategy, model, cuda, gpu)
            server = running(cmd, f"{url}/health", server_log, deadline_s=900)
        with server:
            config = write_config(out, strategy, model, args.steps, args.warmup, cuda, train, url, text)
            rc = run(config, args.nproc, log, 29600 + k)
            if rc != 0:
                print(json.dumps({"bench": "zero", "strategy_asked": strategy, "rc": rc,
                                  "log_tail": log.read_text()[-3000:]}), flush=True)  # fmt: skip
                continue
            results[strategy] = read(out, strategy, log)
            if url is not None:
                checkpoint = out / strategy / f"checkpoint-{args.steps - 1}"
                try:
                    results[strategy]["server_effect"] = server_effect(
                        model, checkpoint, url, "cuda:0" if cuda else "cpu"
                    )
                except Exception as exc:  # the figures above must not be lost
                    results[strategy]["server_effect"] = {"error": f"{type(exc).__name__}: {exc}"[:1500]}
                results[strategy]["syncs"] = read_syncs(out / strategy)
        print(json.dumps(results[strategy]), flush=True)
    if "ddp" in results:
        base = sum(r["optimizer_state_gib"] for r in results["ddp"]["ranks"][:1]) or 1e-9
        print(json.dumps({
            "bench": "zero_ratios", "nproc": args.nproc, "model": args.model,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "optimizer_state_rank0_over_ddp": {s: round(r["ranks"][0]["optimizer_state_gib"] / base, 3)
                                               for s, r in results.items() if r["ranks"]},
            "param_rank0_over_ddp": {
                s: round(r["ranks"][0]["param_gib"] / max(results["ddp"]["ranks"][0]["param_gib"], 1e-9), 3)
                for s, r in results.items() if r["ranks"]},
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
