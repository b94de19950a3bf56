"""The server side of the weight-sync transports (`rollout.sync.transport`), mirroring the learner's
`learner.weights.transports`: one receiver per transport name, registered in `RECEIVERS`.

A receiver is how one sync's bytes reach the server's staging; `SyncStaging` (`weights.staging`) owns the
state machine around it (begin, one staged sync at a time, commit/abort, timeouts, metrics) and asks the
sync's receiver for the bytes:

- `http` (`HttpReceiver`): each bucket is the body of `PUT .../buckets/{k}`, streamed into a staging file;
- `shm` (`ShmReceiver`): each bucket is a file the learner wrote into `server.shm_dir`, adopted by hard link;
- `gloo` / `nccl` (`CollectiveReceiver`): no bucket route; the begin carries a rendezvous (the learner's group
  over every server, and this server's ranks in it), the engine joins it and receives every bucket
  (`CollectiveEngine.receive_collective`, staged where `server.sync_staging` says), and `prepare` / the commit
  wait for that receive, bounded by the group's timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Coroutine
from pathlib import Path
from typing import Any, ClassVar, Literal

from rollout_server.engines.base import BucketLayout, CollectiveEngine, Engine, Rendezvous
from rollout_server.errors import EngineError, SyncValidationError
from rollout_server.weights.bucket_files import adopt_shm_bucket, write_stream
from shared_schemas.registry import registrar
from shared_schemas.sync import ShmBucketRef, SyncBeginRequest, SyncManifest

__all__ = [
    "RECEIVERS",
    "CollectiveReceiver",
    "FileReceiver",
    "GlooReceiver",
    "HttpReceiver",
    "NcclReceiver",
    "Receiver",
    "ShmReceiver",
    "register",
]


class Receiver:
    """One transport's way in (see the module docstring). `name` is the `rollout.sync.transport` it serves."""

    name: ClassVar[str] = ""


RECEIVERS: dict[str, type[Receiver]] = {}
"""Receiver classes by transport name (the learner's `learner.weights.transports.TRANSPORTS`, mirrored)."""


register = registrar(RECEIVERS, "weight-sync receiver")
"""Class decorator: `@register(name)` adds a class to `RECEIVERS` under `name` (once)."""


class FileReceiver(Receiver):
    """A transport whose buckets arrive one request at a time and are staged as files."""


@register("http")
class HttpReceiver(FileReceiver):
    """Bucket bodies, written into `path` as they arrive (no whole-body buffer)."""

    async def take(self, path: Path, body: bytes | bytearray | memoryview | AsyncIterator[bytes]) -> None:
        if isinstance(body, bytes | bytearray | memoryview):
            await asyncio.to_thread(path.write_bytes, bytes(body))
        else:
            await write_stream(path, body)


@register("shm")
class ShmReceiver(FileReceiver):
    """Bucket files in `shm_dir` (the learner's `rollout.sync.shm_dir`), adopted into `path` by hard link."""

    def __init__(self, shm_dir: Path) -> None:
        self.shm_dir = shm_dir

    async def take(self, path: Path, ref: ShmBucketRef) -> None:
        await asyncio.to_thread(adopt_shm_bucket, self.shm_dir, ref.file_name, path)


class CollectiveReceiver(Receiver):
    """The learner's process group: the engine receives every bucket between begin and commit.

    The group spans the learner and every server of the sync; this server's receivers are the ranks the begin
    names (`CollectiveSpec.rank_offset` onwards, in a group of `world_size`). Receives run one after another:
    a receive whose sync was abandoned (the learner failed, another server died) cannot be interrupted inside
    a broadcast and runs out on its own, bounded by the group's timeout; the next sync's receive starts after
    it, so two receives never share the engine's group state.

    Args:
        staging: `server.sync_staging`, handed to the engine's receivers with each sync.
    """

    def __init__(self, staging: Literal["auto", "device", "host"] = "auto") -> None:
        self.staging = staging
        self._last: asyncio.Task[None] | None = None

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

    def start(self, engine: Engine, rendezvous: Rendezvous, manifest: SyncManifest) -> asyncio.Task[None]:
        """Starts the engine's receive of every bucket (it runs while the learner broadcasts), after the
        previous receive has ended."""
        assert isinstance(engine, CollectiveEngine)
        layout: BucketLayout = [[(t.name, t.dtype, t.shape) for t in b.tensors] for b in manifest.buckets]
        receive = engine.receive_collective(rendezvous, rendezvous.first_rank, layout)
        task = asyncio.create_task(_after(self._last, receive))
        task.add_done_callback(_retrieve)
        self._last = task
        return task

    async def finish(self, task: asyncio.Task[None], rendezvous: Rendezvous) -> None:
        """Waits, bounded by the group's timeout, until the engine has received every bucket.

        Raises:
            TimeoutError: not every broadcast arrived in time; the receive's own error otherwise.
        """
        await asyncio.wait_for(asyncio.shield(task), rendezvous.timeout_s)


@register("gloo")
class GlooReceiver(CollectiveReceiver):
    """`gloo` (CPU hosts): see `CollectiveReceiver`."""


@register("nccl")
class NcclReceiver(CollectiveReceiver):
    """`nccl` (GPUs; received into device buffers): see `CollectiveReceiver`."""


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
