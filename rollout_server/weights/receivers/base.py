"""The one interface of the server's weight-sync receivers (`rollout.sync.transport`), and their registry.

A receiver is how one transport's bytes reach this server; `SyncStaging` (`weights.staging`) owns the state
machine around it (one staged sync at a time, the lock, timeouts, version checks, metrics) and asks the sync's
receiver, never the transport's name, for every transport-specific step. Five verbs, one per phase (the server
side of the shape of vLLM's `distributed/weight_transfer` engines, mirroring the learner's
`learner.weights.transports`):

- `begin(request, engine)`: checks the begin against the transport and the engine (nothing staged changes
  yet), starts receiving, and returns the sync's `Transfer`;
- `receive(staging, sync_id, index, payload)`: a bucket that came in through this receiver's route (the file
  receivers: `http` bodies, `shm` files); a collective sync receives every bucket from its begin on;
- `prepare(sync)`: waits (outside the staging lock, bounded) until every byte is in;
- `commit(sync)`: waits (bounded) until every byte is in, and returns what the engine applies;
- `abort(sync, outcome)`: releases what the sync holds, whatever ended it.

What one sync received answers the staging's generic checks (`Transfer.missing`, `Transfer.staging_stages`).
Implementations register under their transport name (`register`, names from `shared_schemas.sync`): `http`
and `shm` (`receivers.http`, `receivers.shm`, both on `receivers.files`), `gloo` and `nccl`
(`receivers.gloo_nccl`).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from rollout_server.engines.base import Engine, StagedUpdate
from rollout_server.weights.receivers.file_store import StagedFiles
from shared_schemas.registry import registrar
from shared_schemas.sync import TRANSPORT_NAMES, BucketAck, SyncBeginRequest, SyncManifest

__all__ = [
    "RECEIVERS",
    "Receiver",
    "ReceiverOptions",
    "StagedSync",
    "StagingAccess",
    "Transfer",
    "register",
]

BucketBody = bytes | bytearray | memoryview | AsyncIterator[bytes]
"""An HTTP bucket body: whole, or streamed as it arrives."""


@dataclass(frozen=True)
class ReceiverOptions:
    """What a receiver may need (each takes what it uses).

    Attributes:
        files: the server's staged bucket files (private sync directories, body pool).
        collective_staging: `server.sync_staging`, handed to the engine's receivers with each collective sync.
    """

    files: StagedFiles
    collective_staging: Literal["auto", "device", "host"] = "auto"


class Transfer:
    """What one sync received, made by its receiver's `begin` (subclasses add their own state)."""

    transport: str = ""
    """How the bytes came in (the sync's metrics label)."""
    collective_ranks: int = 0
    """The begin answer's `collective_ranks`: this server's receivers in the learner's group (0: none)."""
    collective_joining: bool = False
    """The begin answer's `collective_joining`: the receivers join the group (not already in it)."""

    def missing(self, manifest: SyncManifest) -> list[int]:
        """Manifest buckets not received yet (none for a transport without buckets)."""
        return []

    def staging_stages(self, manifest: SyncManifest) -> dict[str, float]:
        """Where the sync's bytes waited for the commit, in bytes, when the engine does not say: the bucket
        files (host tmpfs) by default."""
        return {"staging_device_bytes": 0.0, "staging_host_bytes": float(manifest.nbytes)}


@dataclass
class StagedSync:
    """One staged sync, as the staging's state machine keeps it."""

    sync_id: str
    manifest: SyncManifest
    timeout_s: float
    deadline: float
    began: float
    """Clock reading at begin (for the sync's duration)."""
    receiver: Receiver
    """The receiver that began it, asked for every transport-specific step."""
    transfer: Transfer
    receive_s: float = 0.0
    """Seconds spent taking the bytes in (bucket bodies or files and their header checks; the receive)."""


class StagingAccess(Protocol):
    """What a bucket route's receiver may do with the staged sync (`SyncStaging` implements it)."""

    @property
    def lock(self) -> asyncio.Lock:
        """The staging's one lock, held around every look at the staged sync."""
        ...

    def staged(self, sync_id: str) -> StagedSync:
        """The staged sync `sync_id` (its idle deadline renewed); call under `lock`.

        Raises:
            UnknownSyncError: no such sync staged (404).
        """
        ...

    def discard(self, sync: StagedSync, reason: str, outcome: str) -> None:
        """Drops `sync` if it is still the staged one (its receiver's `abort` releases it); call under
        `lock`."""
        ...


class Receiver:
    """One transport's way in (see the module docstring). `name` is the `rollout.sync.transport` it serves.

    `begin` and `commit` are abstract; the defaults of the others are those of a transport without a bucket
    route, without a wait before the commit and without anything to release.
    """

    name: ClassVar[str] = ""

    def __init__(self, options: ReceiverOptions) -> None:
        self.options = options

    def begin(self, request: SyncBeginRequest, engine: Engine) -> Transfer:
        """Checks `request` against this transport and `engine` (nothing staged changes yet), then starts
        receiving; returns the sync's transfer state.

        Raises:
            SyncValidationError: the transport cannot carry this sync to this engine.
        """
        raise NotImplementedError

    async def receive(self, staging: StagingAccess, sync_id: str, index: int, payload: Any) -> BucketAck:
        """Stages bucket `index` of sync `sync_id`, which came in through this receiver's bucket route
        (`payload`: what that route carries), checked against the manifest before the ack.

        Raises:
            RolloutServerError: the bucket was refused (the sync's own errors: 404, 409, 400).
        """
        raise NotImplementedError(f"the {self.name} transport has no bucket route")

    async def prepare(self, sync: StagedSync) -> None:
        """Waits, outside the staging lock and bounded by the transport's timeout, until every byte is in.

        Raises:
            SyncValidationError: the receive failed or timed out (the staging discards the sync).
        """

    async def commit(self, sync: StagedSync) -> StagedUpdate:
        """Waits (bounded) until every byte of the complete `sync` is in; returns what the engine applies.

        Raises:
            SyncValidationError: the receive failed or timed out.
        """
        raise NotImplementedError

    def abort(self, sync: StagedSync, outcome: str) -> None:
        """Releases what `sync` holds, whatever ended it (`outcome`: see `SyncStaging._finish`)."""


RECEIVERS: dict[str, type[Receiver]] = {}
"""Receiver classes by transport name (the learner's `learner.weights.transports.TRANSPORTS`, mirrored)."""


register = registrar(RECEIVERS, "weight-sync receiver", TRANSPORT_NAMES)
"""Class decorator: `@register(name)` adds a class to `RECEIVERS` under `name` (once)."""
