"""CPU: the carry buffer's fill ratio and §14.3 selection at steady state, for log-normal segment lengths and
rows of ``--packing-length`` tokens, over several inflow rates (segments inserted per micro-step)."""

from __future__ import annotations

import argparse
import random
import statistics

from learner.batching.packing import CarryBuffer
from learner.stage2.targets.segment import SegmentMeta

from .common import emit, lognormal_lengths


class _LenOnly:
    """Minimal stand-in for a Segment: the carry buffer reads only ``meta``."""

    def __init__(self, length: int, step: int) -> None:
        self.meta = SegmentMeta(length, length, length, 1, (), 0, 0, (), (), (), (), step)


def run_fill(args: argparse.Namespace) -> None:
    mean_len = args.mean_len
    per_row = args.packing_length / mean_len
    for factor in args.inflow:
        rng = random.Random(args.seed)
        lens = lognormal_lengths(rng, mean_len, args.sigma, args.min_len, args.max_len)
        # Fractional inflow: carry the remainder so the mean is exactly factor * per_row segments.
        credit = 0.0
        buf = CarryBuffer(args.packing_length, args.packing_buffer)
        fills: list[float] = []
        overflow_at = None
        max_buffer = 0
        for step in range(args.steps):
            credit += factor * per_row
            n_new = int(credit)
            credit -= n_new
            try:
                buf.insert([_LenOnly(next(lens), step) for _ in range(n_new)])  # type: ignore[misc]
            except Exception as err:  # noqa: BLE001 - overflow is a result here, reported below
                overflow_at = f"step {step}: {type(err).__name__}"
                break
            segs, stats = buf.take(step)
            max_buffer = max(max_buffer, len(buf))
            if stats is not None and step >= args.warmup:
                fills.append(stats.fill)
        fills.sort()
        emit(
            bench="packing_fill",
            packing_length=args.packing_length,
            mean_len=mean_len,
            inflow_tokens_per_row=factor,
            segments_per_micro_step=round(factor * per_row, 2),
            steps=len(fills),
            fill_mean=round(statistics.fmean(fills), 4) if fills else None,
            fill_p10=round(fills[len(fills) // 10], 4) if fills else None,
            buffer_final=len(buf),
            buffer_max=max_buffer,
            overflow=overflow_at,
        )
