"""What ``--gpu --vlm`` measures after the padded / packed / ratio lines, in this order, on the packed rows
already timed: the per-segment loop and the varlen check, the attention replay, the profiles, the memory
sweep, Liger, regional compile, the kernel and host-copy A/Bs, and the phase split. Liger and compile come
late because neither can be undone."""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable
from dataclasses import dataclass

import torch
from _step_profile import attention_replay, compare_varlen, phase_split, profile_step

from learner.kernels import apply_liger

from .ab import ab_copy, ab_kernel
from .common import emit, guarded, learner_step, pack_stream, train_tokens_per_s
from .compiled import compiled_phase, tuned_phase
from .memory import peak_memory


@dataclass
class PackedRun:
    """The ``--vlm`` run's model and packed rows, as ``throughput`` built and timed them."""

    model: torch.nn.Module
    device: torch.device
    coord_ids: torch.Tensor
    new_segment: Callable
    eos_id: int
    compact: bool | None
    rows: list
    """The packed batches (the first ``warmup`` untimed)."""
    warmup: int
    flash: bool
    varlen: bool | str
    run: dict
    """``train_tokens_per_s`` keywords: ``eos_id``, ``compact``, ``flop_model``."""
    perf: Callable[[dict], dict]
    base: dict
    """The keys every record of the run starts with."""
    packed_tps: float | None
    """The packed rows' tokens/s (None with ``--skip-eager``)."""


def run_vlm_phases(args: argparse.Namespace, r: PackedRun) -> None:
    model, device, coord_ids, packed_batches = r.model, r.device, r.coord_ids, r.rows
    warmup, flash, varlen, run, perf, base = r.warmup, r.flash, r.varlen, r.run, r.perf, r.base
    packed_tps = r.packed_tps
    cuda = device.type == "cuda"
    step_args = (coord_ids, r.eos_id, r.compact)

    def step(batch, varlen: bool | str = varlen, mark: Callable[[str], None] | None = None) -> torch.Tensor:
        return learner_step(model, batch.to(device), *step_args, varlen=varlen, mark=mark)[0]

    if args.compare_loop and varlen:  # the same packed rows through the per-segment loop: the "before"
        loop_tps, loop_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=False, **run
        )
        loop_perf = perf(loop_info)
        emit(**base, mode="packed_loop", tokens_per_s=round(loop_tps, 1), **loop_perf, **loop_info)
        speedup_bound = (loop_perf.get("mfu_bound") or 0) / loop_perf["mfu"] if loop_perf.get("mfu") else None
        emit(**base, mode="varlen_over_loop", speedup=round(packed_tps / loop_tps, 3),
             bound=round(speedup_bound, 3) if speedup_bound else None,
             bound_is="matmul-ceiling MFU / loop MFU")  # fmt: skip
        guarded("varlen_check", base, lambda: compare_varlen(model, packed_batches[0], step))
    if args.attn_replay:  # one row's attention calls through each kernel that runs here (blocks still eager)
        row = packed_batches[0].to(device)
        guarded("attn_replay", base, lambda: attention_replay(step, row, args.attn_replay))
    if args.profile:  # the step as run above, and the per-segment loop (the "before") where compared
        kernels = ("varlen", "loop") if varlen and args.compare_loop else ("varlen" if varlen else "loop",)
        for kernel in kernels:
            table = f"{args.profile_table}.{kernel}.txt" if args.profile_table else None
            path = functools.partial(step, varlen=kernel == "varlen")
            guarded("profile", base, lambda p=path, t=table: profile_step(p, packed_batches[1], model, t),
                    attention=kernel)  # fmt: skip
    for length in args.memory_sweep:
        rows = pack_stream(r.new_segment, length, args.packing_buffer, 2)[0]
        for checkpointing in (False, True):
            measure = lambda rows=rows, c=checkpointing: peak_memory(model, rows, c, device, coord_ids, run)  # noqa: E731
            guarded("memory", base, measure, packing_length=length, gradient_checkpointing=checkpointing)
    if args.liger:  # last: the patch cannot be undone; the same packed rows, loss of the first row compared
        loss_before = float(step(packed_batches[0]).detach())
        model.zero_grad(set_to_none=True)
        patched = apply_liger(model)
        liger_tps, liger_info = train_tokens_per_s(
            model, packed_batches, coord_ids, device, warmup, flash, varlen=varlen, **run
        )
        loss_after = float(step(packed_batches[0]).detach())
        model.zero_grad(set_to_none=True)
        emit(**base, mode="packed_liger", patched=patched, tokens_per_s=round(liger_tps, 1),
             speedup=round(liger_tps / packed_tps, 3), loss_before=round(loss_before, 5),
             loss_after=round(loss_after, 5), **perf(liger_info), **liger_info)  # fmt: skip
        if args.profile:  # where the patched step's time goes (the next lever after Liger)
            table = f"{args.profile_table}.liger.txt" if args.profile_table else None
            guarded("profile", base, lambda: profile_step(step, packed_batches[1], model, table),
                    attention="varlen+liger")  # fmt: skip
    if args.compile:  # last (after Liger where given): compiled blocks cannot be undone either
        compiled = {}
        guarded("packed_compiled", base, lambda: compiled.setdefault("info", compiled_phase(
            args, model, packed_batches, warmup, step, coord_ids, device, flash, varlen, run, perf,
            liger_tps if args.liger else packed_tps)))  # fmt: skip
        for options in args.inductor_options if "info" in compiled else []:
            guarded("packed_compiled_tuned", base, lambda o=options: tuned_phase(
                json.loads(o), args, model, packed_batches, warmup, coord_ids, device, flash, varlen, run,
                perf, compiled["info"]))  # fmt: skip
    if args.ab_kernel and cuda:  # the varlen kernels against each other on the same rows
        guarded("ab_kernel", base, lambda: ab_kernel(args.ab_kernel, packed_batches, step, model, device))
    if args.ab_copy and cuda:  # the batch's host -> GPU copy inside the step, as the trainer has it
        guarded("ab_copy", base, lambda: ab_copy(args.ab_copy, packed_batches, step, model, device))
    if args.phases:  # where the step's GPU idle sits (the compiled step with --compile)
        rows = [b.to(device) for b in packed_batches[: args.phases + 1]]
        guarded("phases", base, lambda: phase_split(step, rows, model),
                attention=f"varlen+compile-{args.compile}" if args.compile else "varlen")  # fmt: skip
    if args.compile:
        if args.profile:
            table = f"{args.profile_table}.compiled.txt" if args.profile_table else None
            guarded("profile", base, lambda: profile_step(step, packed_batches[1], model, table),
                    attention=f"varlen{'+liger' if args.liger else ''}+compile-{args.compile}")  # fmt: skip
