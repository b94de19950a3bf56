"""Step planning for rollout-matching SFT (docs/ALGORITHM.md#training-step): rollouts → segments → packed
micro-batches.

The planner is the thin I/O layer between the trainer and the pure stage-2 modules: it builds the step's
requests with their per-request seeds (§5.3), asks the `RolloutSource` (server client or colocated engine —
the same code path), turns every result into a teacher-forced segment (`learner.stage2.pipeline`), and packs
or pads each micro-batch (§14). It never raises on a bad sample (§0.3): drops are counted.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from learner.batching.packed_batch import pack_segments, pad_segments
from learner.batching.packing import CarryBuffer
from learner.config import DecodingConfig, RunConfig, Stage2Config
from learner.metrics import StepMetrics
from learner.rollout.base import RolloutSource
from learner.rollout.seeds import request_seed
from learner.stage2.pipeline import (
    RolloutEval,
    SampleContext,
    evaluate_rollout,
    followed_order,
    parse_and_match,
    prepare_segment,
)
from learner.trainers.overlap import Rollouts
from shared_schemas.infer import (
    Choice,
    InferBatch,
    InferRequest,
    InferResult,
    RepeatTerminateConfig,
    RequestConfig,
)

__all__ = ["PlannedStep", "StepPlanner", "build_request_config"]

logger = logging.getLogger(__name__)


def build_request_config(
    decoding: DecodingConfig,
    *,
    max_new_tokens: int | None = None,
    temperature: float | None = None,
    adapter: str | None = None,
    logprobs: bool = False,
) -> RequestConfig:
    """The wire `request_config` for the learner's decoding knobs (greedy = temperature 0); `logprobs` asks
    for the log-probability of every generated token (`Choice.logprobs`)."""
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
        logprobs=logprobs,
    )


@dataclass
class PlannedStep:
    """Prepared micro-batches of one optimizer step with its rank-local supervision counts."""

    prepared: list[dict[str, Any]]
    n_ce: int
    n_coord: int
    n_fp: int = 0


@dataclass
class StepPlanner:
    """Plans E-steps and runs rollout-only evaluation with one `RolloutSource`.

    Attributes:
        source: where rollouts come from (server client or colocated engine).
        ctx: tokenizer, coord vocabulary and stage-2 knobs used per sample.
        stage2: the `stage2:` config.
        decoding: the `rollout.decoding:` config.
        seed: `training.seed`.
        rank: this learner's DP rank.
        per_device_batch_size: samples per micro-batch on this rank.
        pad_id: padding id for unpacked rows.
        adapter_name: callable giving the adapter name requests must reference (adapter sync), else None.
        carry: the packing carry buffer (built from `stage2.packing` when None and packing is on).
        pin_memory: micro-batches built in page-locked memory (a CUDA learner: the trainer's copy to the
            GPU then neither blocks the host nor waits for the previous micro-step's backward).
    """

    source: RolloutSource
    ctx: SampleContext
    stage2: Stage2Config
    decoding: DecodingConfig
    seed: int
    rank: int
    per_device_batch_size: int
    pad_id: int
    adapter_name: Callable[[], str | None] = lambda: None
    carry: CarryBuffer | None = None
    pin_memory: bool = False

    def __post_init__(self) -> None:
        if self.stage2.packing.enabled and self.carry is None:
            self.carry = CarryBuffer.from_config(self.stage2.packing, self.stage2.encode.global_max_length)

    @classmethod
    def from_config(
        cls,
        cfg: RunConfig,
        source: RolloutSource,
        ctx: SampleContext,
        *,
        batch_size: int,
        rank: int = 0,
        adapter_name: Callable[[], str | None] | None = None,
        pin_memory: bool = False,
    ) -> StepPlanner:
        """The planner of a run: `stage2`, `rollout.decoding` and `training.seed` from `cfg`, the padding id
        from `ctx`'s tokenizer (0 when it has none).

        Args:
            cfg: the run's config.
            source: where rollouts come from (None for a caller that only builds batches).
            ctx: the run's `SampleContext`.
            batch_size: samples per micro-batch on this rank.
            rank: this learner's DP rank (evaluation: 0, rank 0's view).
            adapter_name: the adapter name requests must reference (adapter sync), else None.
            pin_memory: build micro-batches in page-locked memory (a CUDA learner).
        """
        return cls(
            source=source,
            ctx=ctx,
            stage2=cfg.stage2,
            decoding=cfg.rollout.decoding,
            seed=cfg.training_view.seed,
            rank=rank,
            per_device_batch_size=batch_size,
            pad_id=int(ctx.tokenizer.pad_token_id or 0),
            adapter_name=adapter_name or (lambda: None),
            pin_memory=pin_memory,
        )

    # -- rollouts -------------------------------------------------------------------------------
    def rollout(
        self,
        samples: Sequence[dict[str, Any]],
        seeds: Sequence[int],
        request_config: RequestConfig,
        first_index: int,
    ) -> tuple[list[InferResult], float]:
        """One batched call for all `samples` (never packed); returns results and seconds spent."""
        if not samples:
            return [], 0.0
        requests = [
            InferRequest(messages=self.ctx.rollout_messages(s), request_id=f"{s['sample_id']}:{i}")
            for i, s in enumerate(samples)
        ]
        batch = InferBatch(
            infer_requests=requests, request_config=request_config, first_index=first_index, seeds=list(seeds)
        )
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
    def new_window(self) -> None:
        """Starts a rollout-buffer window's prompt cache: call before the E-step's rollout, so that prompts
        (decoded images) are encoded once for its rollout (a colocated HF engine encodes with the same
        encoder) and teacher forcing; its M-steps replay the prepared batches and encode nothing."""
        self.ctx.encoder.new_window()

    def step_batch(self, raws: Sequence[Sequence[dict[str, Any]]], global_step: int) -> InferBatch | None:
        """The one rollout call of the optimizer step `global_step` over `raws` (§5.3 seeds, §17), or None
        when the step rolls out nothing (stage-1 warm-up, or no samples).

        A synchronous run asks for it when the step starts; an overlapped one (`rollout.async`) a step or more
        ahead — the same requests, seeds and chunking either way, so the server returns the same tokens.
        """
        flat = [s for raw in raws for s in raw]
        if not flat or global_step < self.stage2.sft_warmup_steps:
            return None
        requests = [
            InferRequest(messages=self.ctx.rollout_messages(s), request_id=f"{s['sample_id']}:{i}")
            for i, s in enumerate(flat)
        ]
        return InferBatch(
            infer_requests=requests,
            request_config=build_request_config(self.decoding, adapter=self.adapter_name()),
            first_index=self.rank * self.per_device_batch_size * max(len(raws), 1),
            seeds=self.step_seeds(raws, global_step),
        )

    def build(
        self,
        raws: Sequence[Sequence[dict[str, Any]]],
        rollouts: Rollouts | None,
        *,
        global_step: int,
        metrics: StepMetrics,
    ) -> PlannedStep:
        """Parse, match, encode and pack every micro-batch of one optimizer step (§17) from its rollouts.

        Args:
            raws: the step's raw micro-batches (lists of sample dicts).
            rollouts: the results of `step_batch(raws, global_step)`, with their staleness; None on a step
                without requests (stage-1 warm-up: an empty rollout makes Y_train the whole GT).
            global_step: optimizer step about to run.
            metrics: the step's accumulator (rollout counters, lengths, timers, packing telemetry).
        """
        flat = [s for raw in raws for s in raw]
        warmup = rollouts is None
        if rollouts is None:
            # Stage-1 warm-up: plain SFT with the stage-2 loss; no request, so no weight sync either.
            results, lags = [self._empty_result(s, i) for i, s in enumerate(flat)], [0] * len(flat)
        else:
            results, lags = rollouts.results, rollouts.staleness
            rollouts.add_metrics(metrics)
        metrics.add(
            {
                "rollout/decode_greedy": float(self.decoding.decode_mode == "greedy"),
                "rollout/decode_beam": float(self.decoding.decode_mode == "beam"),
            }
        )

        prepared: list[dict[str, Any]] = []
        n_ce = n_coord = n_fp = 0
        cursor = 0
        t_pack = 0.0
        t0 = time.perf_counter()
        # Every sample is parsed and matched first: `reorder` teaches the order the STEP's rollouts follow.
        matched = [parse_and_match(s, r, self.ctx) for s, r in zip(flat, results, strict=True)]
        followed = None if warmup else followed_order(matched, self.ctx)
        t_prep = time.perf_counter() - t0
        for raw in raws:
            t0 = time.perf_counter()
            segments = []
            for sample in raw:
                # The generating policy's step: packing staleness (§15.4) counts from it.
                seg, outcome = prepare_segment(
                    sample,
                    results[cursor],
                    self.ctx,
                    rollout_step=global_step - lags[cursor],
                    matched=matched[cursor],
                    followed=followed,
                )
                cursor += 1
                if not warmup:  # an empty warm-up rollout says nothing about the policy
                    metrics.add_rollout_counters(outcome.counters)
                for name, value in outcome.lengths.items():
                    metrics.observe(name, [value])
                if seg is not None:
                    segments.append(seg)
            t1 = time.perf_counter()
            batch = self._pack(segments, global_step, metrics)
            t_pack += time.perf_counter() - t1
            t_prep += t1 - t0
            n_ce += int(batch["n_ce"])
            n_coord += int(batch["n_coord"])
            n_fp += int(batch["n_fp"])
            prepared.append(batch)
        metrics.add_time("time/rollout_parse_match_s", t_prep)
        metrics.add_time("time/post_rollout_pack_s", t_pack)
        return PlannedStep(prepared, n_ce, n_coord, n_fp)

    def _empty_result(self, sample: dict[str, Any], index: int) -> InferResult:
        """What an engine would return for a rollout of zero tokens (warm-up steps)."""
        return InferResult(
            index=index,
            request_id=None,
            prompt_token_ids=self.ctx.prompt_ids(sample),
            choices=[Choice(token_ids=[], text="", finish_reason="length")],
            weight_version=0,
        )

    def _pack(self, segments: list, global_step: int, metrics: StepMetrics) -> dict[str, Any]:
        if self.carry is not None:
            self.carry.insert(segments)
            chosen, stats = self.carry.take(global_step)
            if stats is not None:
                metrics.add(stats.metric_values())
            segments = chosen
            packed = pack_segments(segments, pin_memory=self.pin_memory) if segments else None
        else:
            packed = pad_segments(segments, self.pad_id, pin_memory=self.pin_memory) if segments else None
        if packed is None:
            return {"empty": True, "n_ce": 0, "n_coord": 0, "n_fp": 0, "samples": 0}
        return {
            "empty": False,
            "batch": packed,
            "n_ce": packed.n_ce,
            "n_coord": packed.n_coord,
            "n_fp": packed.n_fp,
            "samples": len(segments),
        }

    # -- evaluation -----------------------------------------------------------------------------
    def evaluate(
        self,
        samples: Sequence[dict[str, Any]],
        *,
        batch_size: int,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        logprobs: bool = False,
        on_sample: Callable[[int, InferResult, RolloutEval], None] | None = None,
    ) -> dict[str, float]:
        """Rollout → parse → match only (§18); returns summed counts (the caller reduces and rates them).

        Request `i` of `samples` has index `i` and seed `request_seed(seed, 0, 0, i)` whatever `batch_size`
        is, so the chunking changes no token.

        Args:
            samples: held-out sample dicts.
            batch_size: requests per `RolloutSource.infer` call.
            max_new_tokens, temperature: `stage2.eval` overrides (None: `rollout.decoding`'s).
            logprobs: ask for per-token log-probabilities (`python -m learner.evaluate` scores objects
                with them); the tokens are the same either way.
            on_sample: called as `on_sample(i, result, evaluation)` for every sample, in order (the
                evaluation command records predictions; the trainer draws its gallery).
        """
        sums: dict[str, float] = {}
        request_config = build_request_config(
            self.decoding,
            max_new_tokens=max_new_tokens,
            temperature=temperature,
            adapter=self.adapter_name(),
            logprobs=logprobs,
        )
        for start in range(0, len(samples), batch_size):
            chunk = list(samples[start : start + batch_size])
            seeds = [request_seed(self.seed, 0, 0, start + i) for i in range(len(chunk))]
            results, _ = self.rollout(chunk, seeds, request_config, first_index=start)
            for i, (sample, result) in enumerate(zip(chunk, results, strict=True)):
                evaluation = evaluate_rollout(sample, result, self.ctx)
                _accumulate(sums, evaluation.counts)
                if on_sample is not None:
                    on_sample(start + i, result, evaluation)
        return sums


def _accumulate(into: dict[str, float], values: dict[str, float]) -> None:
    for key, value in values.items():
        into[key] = into.get(key, 0.0) + float(value)
