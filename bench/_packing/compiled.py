"""``--compile``: the same packed rows once regional torch.compile compiled the model's blocks (with the
deepstack-merge A/B of ``--ab-deepstack``), and again per ``--inductor-options`` with the blocks recompiled
under those Inductor options."""

from __future__ import annotations

import time

from learner.kernels import BLOCK_LISTS, compile_blocks, index_deepstack

from .common import emit, interleaved, train_tokens_per_s


def compiled_phase(args, model, rows, warmup, step, coord_ids, device, flash, varlen, run, perf, before_tps):
    """The same packed rows once ``compile_blocks`` compiled the model's blocks: every row once untimed (the
    compilation and any recompile happen there), then the timed rows of the other phases. Returns tokens/s,
    the speed-up over ``before_tps`` (the previous phase), the first row's loss before and after, the
    seconds of the first compiled row (compilation) and dynamo's graph / graph-break counts."""
    from torch._dynamo.utils import counters

    loss_before = None
    if before_tps is not None:  # no eager step where it would not fit (--skip-eager)
        loss_before = float(step(rows[0]).detach())
        model.zero_grad(set_to_none=True)
    lists = ("visual.blocks",) if args.compile == "vision" else BLOCK_LISTS
    compiled = compile_blocks(model, lists)
    start = time.perf_counter()
    loss_after = float(step(rows[0]).detach())
    model.zero_grad(set_to_none=True)
    first_row_s = time.perf_counter() - start
    tps, info = train_tokens_per_s(model, rows + rows[warmup:], coord_ids, device, len(rows), flash,
                                   varlen=varlen, **run)  # fmt: skip
    if args.ab_deepstack:  # interleaved rounds, transformers' deepstack merge vs the index form

        def timed(indexed: int) -> float:
            index_deepstack(model, enabled=bool(indexed))
            return train_tokens_per_s(model, rows, coord_ids, device, 1, flash, varlen=varlen, **run)[0]

        emit(mode="ab_deepstack", **interleaved(args.ab_deepstack, ("mask", "index"), timed))
        index_deepstack(model, enabled=args.index_deepstack)
    return dict(compiled=args.compile, compiled_blocks=compiled, index_deepstack=args.index_deepstack,
                tokens_per_s=round(tps, 1),
                speedup=round(tps / before_tps, 3) if before_tps else None,
                loss_before=round(loss_before, 5) if loss_before is not None else None,
                loss_after=round(loss_after, 5), first_row_s=round(first_row_s, 1),
                graphs=int(counters["stats"]["unique_graphs"]),
                graph_breaks=int(sum(counters["graph_break"].values())),
                **perf(info), **info)  # fmt: skip


def tuned_phase(
    options: dict, args, model, rows, warmup, coord_ids, device, flash, varlen, run, perf, compiled: dict
) -> dict:
    """The compiled rows again with the blocks recompiled under Inductor ``options`` (e.g.
    ``{"coordinate_descent_tuning": true}``: block sizes of the fused kernels tuned; ``"max_autotune"``:
    matmuls and fused kernels benchmarked against Triton templates): every row once untimed (compilation and
    tuning), then the timed rows; tokens/s, its ratio over the plain compiled phase, the seconds the tuning
    took."""
    lists = ("visual.blocks",) if args.compile == "vision" else BLOCK_LISTS
    compile_blocks(model, lists, options=options)
    start = time.perf_counter()
    tps, info = train_tokens_per_s(model, rows + rows[warmup:], coord_ids, device, len(rows), flash,
                                   varlen=varlen, **run)  # fmt: skip
    return dict(inductor_options=options, tokens_per_s=round(tps, 1),
                speedup=round(tps / compiled["tokens_per_s"], 3),
                seconds_with_tuning=round(time.perf_counter() - start, 1), **perf(info), **info)  # fmt: skip
