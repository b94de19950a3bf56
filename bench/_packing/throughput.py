"""``--gpu``: teacher-forced forward + loss + backward throughput (real tokens / s) of the same segment stream
padded (``--padded-batch`` segments a batch) and packed (one carry-buffer row of ``--packing-length`` tokens a
micro-step), their ratio beside the padding-free bound, and each run's MFU (``learner.flops``); with
``--vlm`` then the measurements of ``vlm_phases``."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Callable

import torch
from _step_profile import matmul_ceiling_tflops

from learner.batching.packing import pad_segments
from learner.flops import FlopModel, peak_tflops, utilization

from .common import emit, pack_stream, text_setup, train_tokens_per_s, varlen_ran, vlm_setup
from .vlm_phases import PackedRun, run_vlm_phases


def mfu_of(peak: float | None, ceiling: float | None, params: int) -> Callable[[dict], dict]:
    """``perf(info)``: the MFU and friends of one timed run (`learner.flops`), the FLOP sums popped from
    ``info``; ``mfu_6n_total`` is the issue's first estimate (6 × every parameter × language tokens);
    ``mfu_bound`` the card's matmul ceiling."""

    def perf(info: dict) -> dict:
        sums = {"perf/tokens": info["tokens"], "perf/model_flops": info.pop("model_flops"),
                "perf/attn_flops": info.pop("attn_flops")}  # fmt: skip
        out = {
            k.removeprefix("perf/"): round(v, 4)
            for k, v in utilization(sums, info["seconds"], 1, peak).items()
            if k != "perf/tokens_per_s"  # printed as the run's own tokens_per_s
        }
        if peak:
            out["mfu_6n_total"] = round(6 * params * info["tokens"] / info["seconds"] / 1e12 / peak, 4)
            out["peak_tflops"] = peak
            if ceiling:
                out["mfu_bound"] = round(ceiling / peak, 4)
        return out

    return perf


def run_throughput(args: argparse.Namespace) -> None:
    device = torch.device("cuda" if torch.cuda.is_available() and not args.cpu else "cpu")
    if args.no_cudnn_sdpa:
        torch.backends.cuda.enable_cudnn_sdp(False)
    rng = random.Random(args.seed)
    setup = (vlm_setup if args.vlm else text_setup)(args, device, rng)
    model, attn, dtype = setup["model"], setup["attn"], setup["dtype"]
    coord_ids = torch.tensor(setup["coord_ids"], device=device)
    cap = 1024 if args.smoke else args.packing_length
    steps = 3 if args.smoke else args.steps

    warmup = 2
    n_packs = steps + warmup
    packed_batches, used, fills = pack_stream(setup["new_segment"], cap, args.packing_buffer, n_packs)
    padded_batches = [
        pad_segments(used[i : i + args.padded_batch], setup["pad_id"])
        for i in range(0, len(used), args.padded_batch)
    ]
    pad_warmup = max(1, round(warmup * len(padded_batches) / n_packs))
    timed = padded_batches[pad_warmup:]
    bound = sum(int(b.input_ids.numel()) for b in timed) / sum(b.num_tokens for b in timed)

    base = dict(bench="packing_throughput",
                device=torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                attn=attn, dtype=str(dtype).removeprefix("torch."), smoke=args.smoke,
                params_m=round(sum(p.numel() for p in model.parameters()) / 1e6, 1),
                cudnn_sdpa=torch.backends.cuda.cudnn_sdp_enabled())  # fmt: skip
    if args.vlm:
        lengths = [s.meta.encoded_len for s in used]
        image_tokens = [s.input_ids.count(setup["image_token_id"]) for s in used]
        base |= dict(model="qwen3_vl", logits="compact" if setup["compact"] else "full",
                     gradient_checkpointing=bool(model.is_gradient_checkpointing), segments=len(used),
                     segment_len_mean=round(statistics.fmean(lengths)), segment_len_min=min(lengths),
                     segment_len_max=max(lengths), image_tokens_min=min(image_tokens),
                     image_tokens_max=max(image_tokens),
                     image_tokens_mean=round(statistics.fmean(image_tokens)))  # fmt: skip
    flash = attn.startswith("flash")
    cuda = device.type == "cuda"
    flop_model = FlopModel.from_model(model)
    peak = peak_tflops(base["device"], args.peak_tflops)
    ceiling = matmul_ceiling_tflops() if cuda else None
    params = sum(p.numel() for p in model.parameters())
    perf = mfu_of(peak, ceiling, params)
    run = dict(eos_id=setup["eos_id"], compact=setup["compact"], flop_model=flop_model)
    varlen = args.varlen_kernel if not args.attn_loop else False
    packed_tps = None
    if not args.skip_eager:
        padded_tps, padded_info = train_tokens_per_s(
            model, padded_batches, coord_ids, device, pad_warmup, False, varlen=varlen, **run
        )
        emit(**base, mode="padded", batch=args.padded_batch, tokens_per_s=round(padded_tps, 1),
             pad_fraction=round(1 - padded_info["tokens"] / padded_info["slots"], 4), **perf(padded_info),
             **padded_info)  # fmt: skip
        packed_tps, packed_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=varlen, **run
        )
        packed_perf = perf(packed_info)
        ran = varlen and varlen_ran(model, packed_batches[0], device, varlen)
        emit(**base, mode="packed", packing_length=cap, tokens_per_s=round(packed_tps, 1),
             fill_mean=round(statistics.fmean(fills), 4), varlen=ran, **packed_perf,
             **packed_info)  # fmt: skip
        ratio = packed_tps / padded_tps
        if args.vlm:  # ≥ 2x, or ≥ 90 % of the padding-free bound where the bound is below 2
            target = 2.0 if bound >= 2.0 else round(0.9 * bound, 3)
            emit(**base, mode="ratio", packed_over_padded=round(ratio, 3), padding_free_bound=round(bound, 3),
                 ratio_over_bound=round(ratio / bound, 3), target=target, met=ratio >= target)  # fmt: skip
        else:
            emit(
                **base,
                mode="ratio",
                packed_over_padded=round(ratio, 3),
                padding_free_bound=round(bound, 3),
                target=1.9,
            )
    if not args.vlm:
        return
    packed = PackedRun(
        model=model, device=device, coord_ids=coord_ids, new_segment=setup["new_segment"],
        eos_id=setup["eos_id"], compact=setup["compact"], rows=packed_batches, warmup=warmup, flash=flash,
        varlen=varlen, run=run, perf=perf, base=base, packed_tps=packed_tps,
    )  # fmt: skip
    run_vlm_phases(args, packed)
