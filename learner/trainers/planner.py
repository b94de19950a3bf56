"""Step planning for rollout-matching SFT (spec/STAGE2.md §17): rollouts → segments → packed micro-batches.

The planner is the thin I/O layer between the trainer and the pure stage-2 modules: it builds the step's
requests with their per-request seeds (§5.3), asks the `RolloutSource` (server client or colocated engine —
the same code path), turns every result into a teacher-forced segment (`learner.stage2.pipeline`), and packs
or pads each micro-batch (§14). It never raises on a bad sample (§0.3): drops are counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from learner.config import DecodingConfig, Stage2Config
from learner.rollout.base import RolloutSource
from learner.stage2.packing import CarryBuffer, pack_segments, pad_segments
from learner.stage2.pipeline import SampleContext, prepare_segment, score_rollout
from learner.stage2.seeds import request_seed
from shared_schemas.infer import InferBatch, InferRequest, InferResult, RepeatTerminateConfig, RequestConfig

__all__ = ["PlannedStep", "StepPlanner", "build_request_config"]

logger = logging.getLogger(__name__)


def build_request_config(decoding: DecodingConfig, *, max_new_tokens: int | None = None,
                         temperature: float | None = None, adapter: str | None = None) -> RequestConfig:
    """The wire `request_config` for the learner's decoding knobs (greedy = temperature 0)."""
    rt = decoding.repeat_terminate
    return RequestConfig(
        n=1,
        max_tokens=max_new_tokens or decoding.max_new_tokens,
        temperature=decoding.temperature if temperature is None else temperature,
        top_p=decoding.top_p,
        top_k=decoding.top_k,
        repetition_penalty=decoding.repetition_penalty,
        repeat_terminate=RepeatTerminateConfig(**rt.model_dump()) if rt.enabled else None,
        adapter=adapter,
    )


@dataclass
class PlannedStep:
    """Prepared micro-batches of one optimizer step plus the rank-local metric sums of the planning."""

    prepared: list[dict[str, Any]]
    n_ce: int
    n_coord: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class StepPlanner:
    """Plans E-steps and runs rollout-only evaluation with one `RolloutSource`.

    Attributes:
        source: where rollouts come from (server client or colocated engine).
        ctx: tokenizer, coord vocabulary and stage-2 knobs used per sample.
        stage2: the `stage2:` config.
        decoding: the `rollout.decoding:` config.
        seed: `training.seed`.
        rank: this learner's DP rank; world_size: number of ranks.
        per_device_batch_size: samples per micro-batch on this rank.
        pad_id: padding id for unpacked rows.
        adapter_name: callable giving the adapter name requests must reference (adapter sync), else None.
    """

    source: RolloutSource
    ctx: SampleContext
    stage2: Stage2Config
    decoding: DecodingConfig
    seed: int
    rank: int
    world_size: int
    per_device_batch_size: int
    pad_id: int
    adapter_name: Callable[[], str | None] = lambda: None
    carry: CarryBuffer | None = None

    def __post_init__(self) -> None:
        if self.stage2.packing.enabled and self.carry is None:
            self.carry = CarryBuffer.from_config(self.stage2.packing, self.stage2.encode.global_max_length)

    # -- rollouts -------------------------------------------------------------------------------
    def rollout(self, samples: Sequence[dict[str, Any]], seeds: Sequence[int], request_config: RequestConfig,
                first_index: int) -> tuple[list[InferResult], float]:
        """One batched call for all `samples` (never packed); returns results and seconds spent."""
        if not samples:
            return [], 0.0
        requests = [
            InferRequest(messages=self.ctx.rollout_messages(s), request_id=f"{s['sample_id']}:{i}")
            for i, s in enumerate(samples)
        ]
        batch = InferBatch(infer_requests=requests, request_config=request_config, first_index=first_index,
                           seeds=list(seeds))
        t0 = time.perf_counter()
        results = self.source.infer(batch)
        return results, time.perf_counter() - t0

    def step_seeds(self, raws: Sequence[Sequence[dict[str, Any]]], global_step: int) -> list[int]:
        """§5.3 seeds for every request of the step, micro-batch by micro-batch."""
        return [
            request_seed(self.seed, global_step, micro, self.rank * self.per_device_batch_size + i)
            for micro, raw in enumerate(raws)
            for i in range(len(raw))
        ]

    # -- training step --------------------------------------------------------------------------
    def plan(self, raws: Sequence[Sequence[dict[str, Any]]], *, global_step: int,
             before_rollout: Callable[[], float] | None = None) -> PlannedStep:
        """Rollout, parse, match, encode and pack every micro-batch of one optimizer step (§17).

        Args:
            raws: the step's raw micro-batches (lists of sample dicts).
            global_step: optimizer step about to run (seeds, staleness).
            before_rollout: called right before the rollout iff there is at least one request — the lazy
                weight sync of §5.6; returns the seconds it took.
        """
        metrics: dict[str, float] = {}
        flat = [s for raw in raws for s in raw]
        sync_s = before_rollout() if (flat and before_rollout is not None) else 0.0
        request_config = build_request_config(self.decoding, adapter=self.adapter_name())
        first_index = self.rank * self.per_device_batch_size * max(len(raws), 1)
        results, gen_s = self.rollout(flat, self.step_seeds(raws, global_step), request_config, first_index)
        metrics["time/weight_sync_s"] = sync_s
        metrics["time/rollout_generate_s"] = gen_s
        new_tokens = sum(len(r.choices[0].token_ids) for r in results)
        metrics["rollout/gen_new_tokens_total"] = float(new_tokens)
        metrics["rollout/gen_tokens_per_s"] = new_tokens / gen_s if gen_s > 0 else 0.0

        prepared: list[dict[str, Any]] = []
        n_ce = n_coord = 0
        cursor = 0
        t_prep = 0.0
        t_pack = 0.0
        for raw in raws:
            t0 = time.perf_counter()
            segments = []
            for sample in raw:
                seg, counters = prepare_segment(sample, results[cursor], self.ctx, rollout_step=global_step)
                cursor += 1
                _accumulate(metrics, counters)
                if seg is not None:
                    segments.append(seg)
            t1 = time.perf_counter()
            batch = self._pack(segments, global_step, metrics)
            t_pack += time.perf_counter() - t1
            t_prep += t1 - t0
            n_ce += int(batch["n_ce"])
            n_coord += int(batch["n_coord"])
            prepared.append(batch)
        metrics["time/rollout_parse_match_s"] = t_prep
        metrics["time/post_rollout_pack_s"] = t_pack
        return PlannedStep(prepared, n_ce, n_coord, metrics)

    def _pack(self, segments: list, global_step: int, metrics: dict[str, float]) -> dict[str, Any]:
        if self.carry is not None:
            self.carry.insert(segments)
            chosen, stats = self.carry.take(global_step)
            if stats is not None:
                _accumulate(metrics, stats.metric_values())
            segments = chosen
            packed = pack_segments(segments) if segments else None
        else:
            packed = pad_segments(segments, self.pad_id) if segments else None
        if packed is None:
            return {"empty": True, "n_ce": 0, "n_coord": 0, "samples": 0}
        n_ce = int((packed.labels != -100).sum())
        return {"empty": False, "batch": packed, "n_ce": n_ce, "n_coord": int(packed.coord_pos.numel()),
                "samples": len(segments)}

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(self, samples: Sequence[dict[str, Any]], *, batch_size: int, max_new_tokens: int | None = None,
                 temperature: float | None = None) -> dict[str, float]:
        """Rollout → parse → match only (§18); returns summed counts (the caller reduces and rates them)."""
        sums: dict[str, float] = {}
        request_config = build_request_config(self.decoding, max_new_tokens=max_new_tokens,
                                              temperature=temperature, adapter=self.adapter_name())
        for start in range(0, len(samples), batch_size):
            chunk = list(samples[start:start + batch_size])
            seeds = [request_seed(self.seed, 0, 0, start + i) for i in range(len(chunk))]
            results, _ = self.rollout(chunk, seeds, request_config, first_index=start)
            for sample, result in zip(chunk, results, strict=True):
                _accumulate(sums, score_rollout(sample, result, self.ctx))
        return sums


def _accumulate(into: dict[str, float], values: dict[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + float(value)


def to_device(batch: Any, device: torch.device) -> Any:
    """Moves every tensor attribute of a packed/padded batch dataclass to `device` (a new object)."""
    import dataclasses

    if dataclasses.is_dataclass(batch):
        changes = {f.name: getattr(batch, f.name).to(device) for f in dataclasses.fields(batch)
                   if isinstance(getattr(batch, f.name), torch.Tensor)}
        return dataclasses.replace(batch, **changes)
    return batch
