"""``--ddp`` under torchrun: the data-parallel scaling of packed rows (1 GPU vs N, bound N)."""

from __future__ import annotations

import argparse
import os
import random

import torch

from learner.flops import FlopModel

from .common import emit, pack_stream, text_setup, train_tokens_per_s, vlm_setup


def run_ddp(args: argparse.Namespace) -> None:
    """Data-parallel scaling of packed training (``torchrun --nproc_per_node N ... --ddp``): every rank builds
    the same model and its own segment stream (seed + rank); rank 0 first times its packed rows ALONE (the
    others wait), then all ranks time theirs under DistributedDataParallel. Prints the 1-GPU and the N-GPU
    tokens/s (all ranks) and their ratio beside its bound N (target ≥ 0.9 N)."""
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    cuda = torch.cuda.is_available() and not args.cpu
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    local = int(os.environ.get("LOCAL_RANK", rank))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    if args.vlm and rank == 0:  # ranks building the shared tiny model folder side by side race
        from _vlm import tiny_vlm_dir

        tiny_vlm_dir()
    dist.barrier()
    setup = (vlm_setup if args.vlm else text_setup)(args, device, random.Random(args.seed + rank))
    model = setup["model"]
    coord_ids = torch.tensor(setup["coord_ids"], device=device)
    cap = 1024 if args.smoke else args.packing_length
    steps, warmup = (3 if args.smoke else args.steps), 2
    rows = pack_stream(setup["new_segment"], cap, args.packing_buffer, steps + warmup)[0]
    run = dict(eos_id=setup["eos_id"], compact=setup["compact"], flop_model=FlopModel.from_model(model))
    single = None
    if rank == 0:
        single = train_tokens_per_s(model, rows, coord_ids, device, warmup, False, **run)[0]
    dist.barrier()
    ddp = DistributedDataParallel(model, device_ids=[local] if cuda else None)
    tps, info = train_tokens_per_s(ddp, rows, coord_ids, device, warmup, False, **run)
    totals = torch.tensor([info["tokens"], info["seconds"]], dtype=torch.float64, device=device)
    seconds = totals[1:].clone()
    dist.all_reduce(totals[:1])
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        aggregate = float(totals[0]) / float(seconds[0])
        emit(bench="packing_ddp", device=torch.cuda.get_device_name() if cuda else "cpu", ranks=world,
             vlm=args.vlm, smoke=args.smoke, packing_length=cap, single_tokens_per_s=round(single, 1),
             ddp_tokens_per_s=round(aggregate, 1), rank0_tokens_per_s=round(tps, 1),
             scaling=round(aggregate / single, 3), bound=world, target=round(0.9 * world, 2),
             met=aggregate / single >= 0.9 * world)  # fmt: skip
    dist.destroy_process_group()
