"""`gloo` / `nccl`: no bucket route; the begin carries a rendezvous (the learner's group over every server,
and this server's ranks in it), the engine joins it and receives every bucket
(`CollectiveEngine.receive_collective`, staged where `server.sync_staging` says), and `prepare` / `commit`
wait for that receive, bounded by the group's timeout.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any

from rollout_server.engines.base import (
    BucketLayout,
    CollectiveEngine,
    Engine,
    ReceivedUpdate,
    Rendezvous,
    StagedUpdate,
)
from rollout_server.errors import EngineError, SyncValidationError
from rollout_server.weights.receivers.base import Receiver, ReceiverOptions, StagedSync, Transfer, register
from shared_schemas.sync import SyncBeginRequest, SyncManifest

__all__ = ["CollectiveReceiver", "CollectiveTransfer", "GlooReceiver", "NcclReceiver"]

logger = logging.getLogger(__name__)


class CollectiveReceiver(Receiver):
    """The learner's process group: the engine receives every bucket between begin and commit.

    The group spans the learner and every server of the sync; this server's receivers are the ranks the begin
    names (`CollectiveSpec.rank_offset` onwards, in a group of `world_size`). Receives run one after another:
    a receive whose sync was abandoned (the learner failed, another server died) cannot be interrupted inside
    a broadcast and runs out on its own, bounded by the group's timeout; the next sync's receive starts after
    it, so two receives never share the engine's group state.
    """

    def __init__(self, options: ReceiverOptions) -> None:
        super().__init__(options)
        self.staging = options.collective_staging
        self._last: asyncio.Task[None] | None = None

    def begin(self, request: SyncBeginRequest, engine: Engine) -> CollectiveTransfer:
        """Checks the group the begin names (`rendezvous`), then starts the engine's receive of every bucket
        (after the previous receive has ended)."""
        rendezvous = self.rendezvous(request, engine)
        assert isinstance(engine, CollectiveEngine)
        transfer = CollectiveTransfer(rendezvous)
        transfer.collective_joining = not engine.holds_group(rendezvous.group)
        transfer.collective_ranks = engine.collective_ranks
        transfer.receiving = self._receive(engine, rendezvous, request.manifest)
        logger.info(
            "sync receives over %s group %s as ranks %d..%d of %d (%s)",
            rendezvous.backend,
            rendezvous.group,
            rendezvous.first_rank,
            rendezvous.first_rank + transfer.collective_ranks - 1,
            rendezvous.world_size,
            "joining" if transfer.collective_joining else "joined before",
        )
        return transfer

    def rendezvous(self, request: SyncBeginRequest, engine: Engine) -> Rendezvous:
        """The group a begin names, checked against its manifest (full syncs only) and the engine."""
        spec = request.collective
        assert spec is not None
        if request.manifest.mode != "full":
            raise SyncValidationError(
                "the collective transport carries full syncs only; send adapters over http",
                type="collective_adapter",
            )
        try:
            if not isinstance(engine, CollectiveEngine):
                raise EngineError(
                    f"this server's engine cannot receive over {spec.backend}; use transport http or shm"
                )
            ranks = engine.collective_ranks
        except EngineError as exc:
            raise SyncValidationError(str(exc), type="collective_unsupported") from exc
        world_size = spec.world_size if spec.world_size is not None else 1 + ranks
        if spec.rank_offset + ranks > world_size:
            raise SyncValidationError(
                f"this server has {ranks} weight-sync receivers, but the learner gave it ranks"
                f" {spec.rank_offset}..{world_size - 1} of a {world_size}-rank group (it counted fewer: was"
                " the server restarted with another data/tensor parallel size?); the learner asks again at"
                " its next sync",
                type="collective_ranks",
            )
        return Rendezvous(
            backend=spec.backend,
            master_address=spec.master_address,
            master_port=spec.master_port,
            group=spec.group,
            world_size=world_size,
            timeout_s=spec.timeout_s,
            staging=self.staging,
            first_rank=spec.rank_offset,
        )

    def _receive(
        self, engine: CollectiveEngine, rendezvous: Rendezvous, manifest: SyncManifest
    ) -> asyncio.Task[None]:
        """Starts the engine's receive of every bucket (it runs while the learner broadcasts), after the
        previous receive has ended."""
        layout: BucketLayout = [[(t.name, t.dtype, t.shape) for t in b.tensors] for b in manifest.buckets]
        receive = engine.receive_collective(rendezvous, rendezvous.first_rank, layout)
        task = asyncio.create_task(_after(self._last, receive))
        task.add_done_callback(_retrieve)
        self._last = task
        return task

    async def prepare(self, sync: StagedSync) -> None:
        transfer = collective_transfer(sync)
        task = transfer.receiving
        assert task is not None
        started = time.perf_counter()
        await asyncio.wait({task}, timeout=transfer.rendezvous.timeout_s)
        reason = None
        if not task.done():
            reason = f"not every broadcast arrived within {transfer.rendezvous.timeout_s:.0f} s"
        elif task.cancelled():
            reason = "the receive was cancelled"
        elif task.exception() is not None:
            reason = str(task.exception())
        if reason is not None:
            raise _failure(sync, reason)
        sync.receive_s = time.perf_counter() - started

    async def commit(self, sync: StagedSync) -> StagedUpdate:
        """Waits, bounded by the group's timeout, until the engine has received every bucket; the engine then
        loads what its receivers staged."""
        transfer = collective_transfer(sync)
        assert transfer.receiving is not None
        started = time.perf_counter()
        try:
            await asyncio.wait_for(asyncio.shield(transfer.receiving), transfer.rendezvous.timeout_s)
        except Exception as exc:
            reason = (
                f"not every broadcast arrived within {transfer.rendezvous.timeout_s:.0f} s"
                if isinstance(exc, TimeoutError)
                else str(exc)
            )
            raise _failure(sync, reason) from exc
        if not sync.receive_s:  # already measured by the prepare, which waited for it
            sync.receive_s = time.perf_counter() - started
        manifest = sync.manifest
        return ReceivedUpdate(version=manifest.version, names=tuple(t.name for t in manifest.tensors))

    def abort(self, sync: StagedSync, outcome: str) -> None:
        """A receive still running is left to run out (a thread blocked in a broadcast cannot be interrupted;
        its engine drops the group when the learner's side stays quiet past the group's timeout, and the next
        sync's receive starts after it); it is cancelled only at shutdown (`closed`)."""
        task = collective_transfer(sync).receiving
        if outcome == "closed" and task is not None and not task.done():
            task.cancel()


@register("gloo")
class GlooReceiver(CollectiveReceiver):
    """`gloo` (CPU hosts): see `CollectiveReceiver`."""


@register("nccl")
class NcclReceiver(CollectiveReceiver):
    """`nccl` (GPUs; received into device buffers): see `CollectiveReceiver`."""


@dataclass
class CollectiveTransfer(Transfer):
    """One collective sync: the group its buckets are broadcast over, and the engine receiving them."""

    rendezvous: Rendezvous
    receiving: asyncio.Task[None] | None = None
    """The engine receiving the broadcasts, started at begin, awaited at prepare and commit."""

    def __post_init__(self) -> None:
        self.transport = self.rendezvous.backend

    def staging_stages(self, manifest: SyncManifest) -> dict[str, float]:
        """The configured place (`server.sync_staging`): device, host, or `auto` (not known here)."""
        nbytes = float(manifest.nbytes)
        if self.rendezvous.staging == "device":
            return {"staging_device_bytes": nbytes, "staging_host_bytes": 0.0}
        if self.rendezvous.staging == "auto":
            return {"staging_auto_bytes": nbytes}
        return super().staging_stages(manifest)


def collective_transfer(sync: StagedSync) -> CollectiveTransfer:
    assert isinstance(sync.transfer, CollectiveTransfer)
    return sync.transfer


def _failure(sync: StagedSync, reason: str) -> SyncValidationError:
    """The error of a receive that failed for `reason` (nothing applied; the sync is discarded)."""
    return SyncValidationError(
        f"sync {sync.sync_id}: receiving over the {collective_transfer(sync).rendezvous.backend} group"
        f" failed ({reason}); nothing applied, begin again",
        type="collective_failed",
    )


async def _after(previous: asyncio.Task[None] | None, receive: Coroutine[Any, Any, None]) -> None:
    """Runs `receive` once `previous` (an earlier sync's receive, maybe still running out) has ended."""
    try:
        if previous is not None and not previous.done():
            await asyncio.wait({previous})
    except BaseException:
        receive.close()  # cancelled before it started (server shutdown)
        raise
    await receive


def _retrieve(task: asyncio.Task[None]) -> None:
    """Marks a finished receive's failure as seen (the commit or the discard reports it)."""
    if not task.cancelled():
        task.exception()
