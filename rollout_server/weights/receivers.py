"""The server side of the weight-sync transports (`rollout.sync.transport`), mirroring the learner's
`learner.rollout.transports`: one receiver per transport name, registered in `RECEIVERS`.

A receiver is how one sync's bytes reach the server's staging; `SyncStaging` (`weights.staging`) owns the state
machine around it (begin, one staged sync at a time, commit/abort, timeouts, metrics) and asks the sync's
receiver for the bytes:

- `http` (`HttpReceiver`): each bucket is the body of `PUT .../buckets/{k}`, streamed into a staging file;
- `shm` (`ShmReceiver`): each bucket is a file the learner wrote into `server.shm_dir`, adopted by hard link;
- `gloo` / `nccl` (`CollectiveReceiver`): no bucket route; the begin carries a rendezvous, the engine joins the
  learner's group and receives every bucket (`CollectiveEngine.receive_collective`, staged where
  `server.sync_staging` says), and the commit waits for that receive, bounded by the group's timeout.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path
from typing import ClassVar, Literal

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
"""Receiver classes by transport name (the learner's `learner.rollout.transports.TRANSPORTS`, mirrored)."""


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

    Args:
        staging: `server.sync_staging`, handed to the engine's receivers with each sync.
    """

    def __init__(self, staging: Literal["auto", "device", "host"] = "auto") -> None:
        self.staging = staging

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
        return Rendezvous(
            backend=spec.backend,
            master_address=spec.master_address,
            master_port=spec.master_port,
            group=spec.group,
            world_size=1 + ranks,
            timeout_s=spec.timeout_s,
            staging=self.staging,
        )

    def start(self, engine: Engine, rendezvous: Rendezvous, manifest: SyncManifest) -> asyncio.Task[None]:
        """Starts the engine's receive of every bucket (it runs while the learner broadcasts)."""
        assert isinstance(engine, CollectiveEngine)
        layout: BucketLayout = [[(t.name, t.dtype, t.shape) for t in b.tensors] for b in manifest.buckets]
        task = asyncio.create_task(engine.receive_collective(rendezvous, 1, layout))
        task.add_done_callback(_retrieve)
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


def _retrieve(task: asyncio.Task[None]) -> None:
    """Marks a finished receive's failure as seen (the commit or the discard reports it)."""
    if not task.cancelled():
        task.exception()
