"""DDP vs DeepSpeed ZeRO-2 vs ZeRO-3 on several GPUs: what each rank holds, peak memory, and the first losses.

    torchrun is started by this script:  python bench/bench_zero.py --nproc 2 [--model vlm-2b|tiny-vlm]

Per strategy it runs ``python -m learner`` under ``torchrun --nproc_per_node N`` on the image demo's records
(``configs/demo_vlm_cpu.yaml``) with rollouts from the in-process HF engine (``rollout.mode: colocate``; no vLLM
on the GPU machines): ``--warmup`` plain-GT steps, then rollout-matching steps, whose rollouts need the
policy's FULL weights — under ZeRO-3 the colocated engine gathers them bucket by bucket (the export path every
full weight sync takes). Same seed and data for every strategy.

Prints one JSON line per strategy: the strategy the learner MEASURED (``learner.trainers.strategy``: the engine's
ZeRO stage, not the config), per-rank parameter / gradient / optimizer-state bytes, per-step loss and
``memory/peak_allocated_gib`` (rank 0), and the rollout F1 of the rollout-matching steps; then one line with the
ratios of optimizer-state bytes to DDP's (ZeRO-2 partitions the state over the ranks, so about 1/N of DDP's
when both keep fp32 state). GPU only for ZeRO (DeepSpeed's optimizers are CUDA); ``--strategies ddp`` runs on
CPU with gloo.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).resolve().parent))

DEEPSPEED = {"ddp": None, "zero2": "configs/deepspeed/zero2.json", "zero3": "configs/deepspeed/zero3.json"}
REPORT = re.compile(
    r"rank (\d+)/(\d+): (\w+), parameters ([\d.]+) GiB, gradients ([\d.]+) GiB, optimizer state ([\d.]+) GiB"
)


def write_config(
    out: Path, strategy: str, model: Path, steps: int, warmup: int, cuda: bool, train: Path
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
    config = {
        "extends": str(REPO / "configs" / "demo_vlm_cpu.yaml"),
        "output_dir": str(out / strategy),
        "model": {"path": str(model), "dtype": "bfloat16" if cuda else "float32"},
        "data": {"train": [str(train)], "eval": []},
        "rollout": {
            "mode": "colocate",
            "backend": "hf",
            "decoding": {"max_new_tokens": 96, "rollout_generate_batch_size": 8},
        },
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
    records = [json.loads(x) for x in (out / strategy / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    return {
        "bench": "zero",
        "strategy_asked": strategy,
        "strategy_measured": ranks[0]["strategy"] if ranks else None,
        "ranks": sorted(ranks, key=lambda r: r["rank"]),
        "loss": [round(r["loss"], 4) for r in steps],
        "peak_allocated_gib_rank0": [r.get("memory/peak_allocated_gib") for r in steps],
        "rollout_f1": [round(r["rollout/f1"], 3) for r in steps if "rollout/f1" in r],
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--strategies", default="ddp,zero2,zero3")
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--model", choices=("vlm-2b", "tiny-vlm"), default="vlm-2b")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=3, help="plain-GT steps before rollout-matching ones")
    parser.add_argument("--out", type=Path, default=REPO / "runs" / "bench_zero")
    args = parser.parse_args(argv)
    import torch

    cuda = torch.cuda.is_available()
    out = args.out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    data = out / "data"  # 256 records of the image demo's generator: steps x ranks x 4 need no more
    subprocess.run([sys.executable, "scripts/build_vlm_demo_data.py", "--out", str(data), "--n-train", "256",
                    "--n-eval", "8"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
    if args.model == "vlm-2b":
        from _vlm import save_vlm_2b

        model = save_vlm_2b(out / "qwen3-vl-2b-shapes", "cuda" if cuda else "cpu")
    else:
        subprocess.run([sys.executable, "scripts/build_tiny_vlm.py", "--out", ".cache/models", "--preset",
                        "tiny-qwen3-vl-demo"], cwd=REPO, check=True, stdout=subprocess.DEVNULL)  # fmt: skip
        model = REPO / ".cache" / "models" / "tiny-qwen3-vl-demo"
    results = {}
    for k, strategy in enumerate(args.strategies.split(",")):
        config = write_config(out, strategy, model, args.steps, args.warmup, cuda, data / "train.jsonl")
        log = out / f"{strategy}.log"
        rc = run(config, args.nproc, log, 29600 + k)
        if rc != 0:
            print(json.dumps({"bench": "zero", "strategy_asked": strategy, "rc": rc,
                              "log_tail": log.read_text()[-1500:]}), flush=True)  # fmt: skip
            continue
        results[strategy] = read(out, strategy, log)
        print(json.dumps(results[strategy]), flush=True)
    if "ddp" in results:
        base = sum(r["optimizer_state_gib"] for r in results["ddp"]["ranks"][:1]) or 1e-9
        print(json.dumps({
            "bench": "zero_ratios", "nproc": args.nproc, "model": args.model,
            "device": torch.cuda.get_device_name() if cuda else "cpu",
            "optimizer_state_rank0_over_ddp": {s: round(r["ranks"][0]["optimizer_state_gib"] / base, 3)
                                               for s, r in results.items() if r["ranks"]},
            "param_rank0_over_ddp": {s: round(r["ranks"][0]["param_gib"] / max(results["ddp"]["ranks"][0]["param_gib"],
                                                                              1e-9), 3)
                                     for s, r in results.items() if r["ranks"]},
        }), flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
