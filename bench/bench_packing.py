"""Post-rollout packing benchmark (docs/ALGORITHM.md#packing). Prints one JSON object per line.

CPU (default): fill ratio of the carry buffer + §14.3 selection at steady state, for log-normal segment
lengths (mean ≈ 1100, max 4096) and rows of ``--packing-length`` tokens, over several inflow rates
(segments inserted per micro-step). Target: mean fill ≥ 0.95 once the inflow matches the row size.

GPU (``--gpu``): teacher-forced forward + backward throughput (real tokens / s) of a random-init
~0.5B Qwen2-architecture model in bf16, on the same segment stream run two ways:
  * padded: batches of ``--padded-batch`` segments, right-padded (``pad_segments``);
  * packed: the carry buffer fed until it holds ≥ one row of tokens, one ``select_segments`` row of
    ``--packing-length`` tokens per micro-step (``pack_segments``), no attention mask.
Attention: flash-attention-2 varlen when ``flash_attn`` is importable, else PyTorch flex-attention
(block-diagonal BlockMask from the position restarts), else sdpa (dense mask over the row); override
with ``--attn``. Target ratio packed / padded ≥ 1.9.

GPU with images (``--gpu --vlm``): the same comparison on a random-init Qwen3-VL-2B-shaped model (bf16, vision
tower included, gradient checkpointing only with ``--gradient-checkpointing``; ``bench/_vlm.py``) through the
learner's own path: image prompts of 448–896 px (196–784 image tokens) encoded by ``PromptEncoder`` (expanded
ids, ``pixel_values``, ``image_grid_thw``, M-RoPE positions), answers of 50–600 tokens turned into segments by
``build_segment``, rows of ``--packing-length`` (default 8192, the configs' value) packed / padded as above,
and every step the learner's ``micro_step_loss`` (compact logits unless ``--logits full``). Attention
is the learner's: ``sdpa`` as configured (flash-attn is not on the device image, Qwen3-VL takes no
flex-attention), which ``micro_step_loss`` runs per packed segment where it does so (``attn`` prints
``segment_sdpa``; on CUDA one varlen flash call per row, ``varlen: true``), else densely under transformers'
block-diagonal mask (``sdpa``). The ratio line also prints
the padding-free bound of the mix (padded slots / real tokens of the padded batches); target ≥ 2×, or ≥ 0.9 ×
the bound where the bound is below 2 (the vision tower's work is never padded, so the bound is not fully
reachable). With ``--vlm`` it also prints the MFU of every run (``learner.flops``, with the card's matmul
ceiling as ``mfu_bound``), peak memory, the same packed rows through the per-segment SDPA loop
(``packed_loop``, the attention before the varlen kernel) with the speed-up beside its bound and a loss /
gradient check of varlen vs loop (``--no-compare-loop`` skips them); ``--profile`` a torch.profiler breakdown
of one packed step each way (``bench/_step_profile.py``); ``--memory-sweep 8192 16384`` the peak memory of
such rows with and without gradient checkpointing; ``--compile vision|all`` last, regional torch.compile of
the ViT blocks (and the decoder layers), with ``--skip-eager`` only the compiled rows (lengths whose eager
step does not fit); ``--phases N`` the step's host / GPU span and idle per phase. ``--ddp`` under
torchrun: the data-parallel scaling of packed rows (1 GPU vs N, bound N). ``bench/mfu_gpu.sh`` runs the
device set. Each measurement lives in its own module of ``bench/_packing/``; this file is the command line.

Examples::

    python bench/bench_packing.py                      # CPU fill ratios
    python bench/bench_packing.py --gpu                # on a CUDA machine
    python bench/bench_packing.py --gpu --smoke        # tiny model, runs on CPU in seconds
    python bench/bench_packing.py --gpu --vlm          # Qwen3-VL-2B shapes, image segments (CUDA)
    python bench/bench_packing.py --gpu --vlm --smoke  # tiny Qwen3-VL on CPU
    torchrun --nproc_per_node 2 bench/bench_packing.py --gpu --vlm --ddp  # 2-GPU scaling
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _packing.ddp import run_ddp  # noqa: E402
from _packing.fill import run_fill  # noqa: E402
from _packing.throughput import run_throughput  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--gpu", action="store_true", help="throughput benchmark (packed vs padded)")
    p.add_argument("--smoke", action="store_true", help="tiny model and lengths (runs on CPU)")
    p.add_argument("--vlm", action="store_true", help="with --gpu: Qwen3-VL and image segments (see above)")
    p.add_argument(
        "--logits",
        choices=["compact", "full"],
        default="compact",
        help="--vlm: the step's logits (stage2.loss.compact_logits)",
    )
    p.add_argument(
        "--gradient-checkpointing",
        action="store_true",
        help="--vlm: turn gradient checkpointing on (default off)",
    )
    p.add_argument(
        "--no-cudnn-sdpa",
        action="store_true",
        help="diagnostic: disable PyTorch's cuDNN SDPA backend (it builds one graph per new sequence length)",
    )
    p.add_argument(
        "--attn-loop",
        action="store_true",
        help="--vlm: packed rows attend per segment in a Python loop (the attention before varlen)",
    )
    p.add_argument(
        "--no-compare-loop",
        dest="compare_loop",
        action="store_false",
        help="--vlm: skip timing the same packed rows through the per-segment loop (and the varlen check)",
    )
    p.add_argument(
        "--profile", action="store_true", help="--vlm: torch.profiler breakdown of one packed step"
    )
    p.add_argument("--profile-table", default=None, help="--profile: op tables to PREFIX.{varlen,loop}.txt")
    p.add_argument(
        "--memory-sweep",
        type=int,
        nargs="*",
        default=[],
        help="--vlm: packing lengths whose peak step memory to measure, checkpointing off / on",
    )
    p.add_argument(
        "--compile",
        choices=["vision", "all"],
        default=None,
        help="--vlm: last, the same packed rows with regional torch.compile of the ViT blocks (vision) or of"
        " them and the decoder layers (all)",
    )
    p.add_argument(
        "--inductor-options",
        nargs="*",
        default=[],
        metavar="JSON",
        help="--compile: then per JSON (e.g. '{\"coordinate_descent_tuning\": true}') the blocks recompiled"
        " with those Inductor options and the same rows timed",
    )
    p.add_argument(
        "--skip-eager",
        action="store_true",
        help="--compile: no eager timing (padded, packed, the loss before): only the compiled rows, for"
        " lengths whose eager step does not fit (with a memory cap)",
    )
    p.add_argument(
        "--varlen-kernel",
        default="auto",
        choices=("auto", "fa4", "torch"),
        help="packed rows' varlen attention kernel (model.varlen_kernel): auto = FA4 where it runs, else"
        " torch",
    )
    p.add_argument(
        "--ab-kernel",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="CUDA: then ROUNDS interleaved timings of the packed rows, varlen kernel torch (FA2) vs fa4",
    )
    p.add_argument(
        "--attn-replay",
        type=int,
        default=0,
        metavar="REPS",
        help="--vlm: the attention calls of one packed row replayed through each varlen kernel that runs here"
        " and the per-segment loop, REPS timings each (bench/_step_profile.py attention_replay)",
    )
    p.add_argument(
        "--ab-copy",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="CUDA: then ROUNDS interleaved timings of the packed rows back to back with their host -> GPU"
        " copy inside: from pageable memory vs pinned + non_blocking (the planner's pin_memory)",
    )
    p.add_argument(
        "--ab-deepstack",
        type=int,
        default=0,
        metavar="ROUNDS",
        help="--compile: then ROUNDS interleaved timings of the compiled rows, deepstack by mask / by index",
    )
    p.add_argument(
        "--phases",
        type=int,
        default=0,
        metavar="ROWS",
        help="--vlm: last, the step (compiled with --compile) cut into phases over ROWS rows: host and GPU"
        " span, kernel time and GPU idle of each (bench/_step_profile.py phase_split)",
    )
    p.add_argument(
        "--index-deepstack",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--vlm: the deepstack merge as an index_add, as the learner loads Qwen3-VL"
        " (learner.kernels.index_deepstack); --no-index-deepstack: transformers' boolean-mask merge",
    )
    p.add_argument(
        "--liger", action="store_true", help="--vlm: then the same packed rows with Liger-Kernel's patches"
    )
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak (default: table)")
    p.add_argument(
        "--ddp",
        action="store_true",
        help="under torchrun: packed rows on every rank, alone on rank 0 then under DDP (scaling)",
    )
    p.add_argument("--answer-min", type=int, default=50, help="--vlm: shortest answer (tokens)")
    p.add_argument("--answer-max", type=int, default=600, help="--vlm: longest answer (tokens)")
    p.add_argument("--cpu", action="store_true", help="force the throughput benchmark onto the CPU")
    p.add_argument("--attn", default="auto", help="auto | flash_attention_2 | flex_attention | sdpa | eager")
    p.add_argument("--packing-length", type=int, default=None, help="16384 (--vlm: 8192)")
    p.add_argument("--packing-buffer", type=int, default=512)
    p.add_argument("--padded-batch", type=int, default=4)
    p.add_argument("--mean-len", type=float, default=1100.0)
    p.add_argument("--sigma", type=float, default=0.6, help="log-normal shape of the segment lengths")
    p.add_argument("--min-len", type=int, default=128)
    p.add_argument("--max-len", type=int, default=4096)
    p.add_argument(
        "--steps", type=int, default=None, help="fill: micro-steps (2000); gpu: timed packed rows (20)"
    )
    p.add_argument("--warmup", type=int, default=100, help="fill: micro-steps ignored at the start")
    p.add_argument("--inflow", type=float, nargs="+", default=[0.9, 0.95, 1.0, 1.05],
                   help="fill: segments per micro-step as a multiple of"
                        " packing_length / mean_len")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.packing_length is None:
        args.packing_length = 8192 if args.vlm else 16384
    if args.vlm and not args.gpu:
        p.error("--vlm goes with --gpu (the fill benchmark does not depend on the model)")
    if args.gpu:
        args.steps = args.steps or 20
        (run_ddp if args.ddp else run_throughput)(args)
    else:
        args.steps = args.steps or 2000
        run_fill(args)


if __name__ == "__main__":
    main()
