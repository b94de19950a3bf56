"""`ColocateRolloutSource`: rollouts from an engine inside the learner process.

See docs/ARCHITECTURE.md#rollout-source, #weight-sync; docs/ALGORITHM.md#rollout, #offload.

The same `RolloutSource` seam as `ServerRolloutSource`, with the same schema objects in and out, and no HTTP:

- backend `vllm` (`learner.rollout.colocate.vllm`): the rollout server's own `VllmEngine` class, built in
  this process and driven from one long-lived event-loop thread; weight updates are handed over in-process.
  This is the one allowed learner → server import (docs/ARCHITECTURE.md#the-two-services), and it is lazy:
  `rollout_server` and vLLM are imported only when a colocated vLLM engine is built.
- backend `hf` (`learner.rollout.colocate.hf`): generation with the training model itself (no copy), so its
  weights are always current and a sync only records the version. It reuses the server's pure decode loop
  (`rollout_server.engines.hf_decode`, also imported lazily).

`from_config` is what `learner.trainers.build.build_rollout_source` calls in colocate mode.

Example:
    >>> source = ColocateRolloutSource.from_config(cfg, model=model, tokenizer=tokenizer)  # doctest: +SKIP
    >>> results = source.infer(batch)  # results[i] answers batch.infer_requests[i]
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from learner.rollout.base import check_results, staleness
from learner.rollout.colocate.backend import ColocateBackend
from learner.weights.types import SyncReport, WeightUpdate
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferResult

if TYPE_CHECKING:
    from torch import nn

    from learner.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["ColocateRolloutSource"]


class ColocateRolloutSource:
    """`RolloutSource` over an in-process backend (same schemas as the server client, no HTTP).

    Invariants: an empty batch returns `[]` without touching the engine; every result list is checked with
    `check_results` (one result per request, by index and request id); `weight_version` is the version of the
    last applied sync. The attribute `last_staleness` holds the per-result staleness of the last `infer`.

    Args:
        backend: the generation backend (`vllm.VllmColocateBackend` or
            `hf.HfColocateBackend`).
    """

    def __init__(self, backend: ColocateBackend) -> None:
        self._backend = backend
        self._started = time.monotonic()
        self._closed = False
        self.weight_version: int | None = None
        """Version of the last applied sync (None before the first)."""
        self.last_staleness: list[int] = []
        """Per result of the last `infer`: learner version − producing version."""

    @classmethod
    def from_config(
        cls, cfg: RunConfig, *, model: nn.Module, tokenizer: Any, encoder: Any | None = None
    ) -> ColocateRolloutSource:
        """The colocated source of `cfg.rollout` (`backend: vllm | hf`, `mode: colocate`).

        Args:
            cfg: the validated run config (`rollout.*`, `model.path`, `training.seed`).
            model: the training model (the `hf` backend generates with it; the `vllm` backend re-reads it
                when a level-2 sleep discarded the engine's weights).
            tokenizer: the training tokenizer (chat template included).
            encoder: the run's `PromptEncoder` (the `hf` backend encodes prompts, images included, with it).

        Raises:
            ConfigError: `rollout.vllm.tensor_parallel_size` does not divide the world size, a sleep level on
                a platform without vLLM sleep mode, or an `hf` backend under ZeRO-3.
            EngineStartError: the vLLM engine could not be created (suggests `rollout.backend: hf`).
        """
        if cfg.rollout.backend == "hf":
            from learner.rollout.colocate.hf import HfColocateBackend

            return cls(HfColocateBackend.from_config(cfg, model=model, tokenizer=tokenizer, encoder=encoder))
        from learner.rollout.colocate.vllm import VllmColocateBackend

        return cls(VllmColocateBackend.from_config(cfg, model=model))

    # -- RolloutSource --------------------------------------------------------------------------------------
    @property
    def endpoints(self) -> tuple[str, ...]:
        """`("colocate:vllm",)` or `("colocate:hf",)`."""
        return (f"colocate:{self._backend.name}",)

    @property
    def sends_weights(self) -> bool:
        """Whether this rank must call `sync_weights` (every engine leader must; see the TP notes in
        `vllm.py`). The trainer's sync policy should use it as its `is_rank0` in colocate mode."""
        return self._backend.sends_weights

    @property
    def backend(self) -> ColocateBackend:
        """The backend (tests and benchmarks read its counters)."""
        return self._backend

    def infer(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request in-process; `results[i]` answers `batch.infer_requests[i]`.

        Raises:
            ResultMismatchError: the backend returned a missing, duplicated or extra result.
            RuntimeError: the engine failed (the message names the colocated engine and the request).
        """
        if self._closed:
            raise RuntimeError("ColocateRolloutSource is closed")
        if not batch.infer_requests:
            self.last_staleness = []
            return []
        ordered = check_results(batch, self._backend.generate(batch))
        learner_version = self.weight_version
        if learner_version is None:
            learner_version = max(r.weight_version for r in ordered)
        self.last_staleness = staleness(learner_version, ordered)
        return ordered

    def sync_weights(self, update: WeightUpdate) -> SyncReport:
        """Hands `update` to the engine in-process (no bytes on any wire).

        Raises:
            SyncRejected: the engine refuses the mode (adapter update without LoRA).
            SyncError: anything else (bad name, shape or dtype; the engine keeps its previous weights).
        """
        if self._closed:
            raise RuntimeError("ColocateRolloutSource is closed")
        started = time.perf_counter()
        nbytes = self._backend.apply(update)
        self.weight_version = update.version
        return SyncReport(
            mode=update.mode,
            version=update.version,
            bytes=nbytes,
            seconds=time.perf_counter() - started,
            transport="in_process",
            endpoints=self.endpoints,
        )

    @property
    def last_sync_stages(self) -> dict[str, float]:
        """Seconds per phase of the last sync (the vLLM backend's `cast_s`, `handoff_s`, `commit_s`, ...;
        empty for `hf`), for profiling; the colocated `ServerRolloutSource.last_sync_stages`."""
        return dict(getattr(self._backend, "last_stages", {}))

    def health(self) -> Health:
        """Status of the colocated engine in the `/health` schema (`dp` is 1: one engine per TP group)."""
        status = self._backend.status()
        if self._closed:
            status = replace(status, ok=False, detail="source closed")
        return Health(
            status="ok" if status.ok else "error",
            engine=status.engine,
            model=status.model,
            weight_version=status.weight_version,
            dp=1,
            tp=status.tp,
            lora_enabled=status.lora_enabled,
            max_model_len=status.max_model_len,
            uptime_s=time.monotonic() - self._started,
            detail=status.detail,
        )

    def close(self) -> None:
        """Stops the engine (vLLM) or releases the model reference (hf); idempotent."""
        if self._closed:
            return
        self._closed = True
        self._backend.close()

    def __enter__(self) -> ColocateRolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
