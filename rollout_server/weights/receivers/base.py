"""The one interface of the server's weight-sync receivers (`rollout.sync.transport`), and their registry.

A receiver is how one transport's bytes reach this server; `SyncStaging` (`weights.staging`) owns the state
machine around it (one staged sync at a time, the lock, timeouts, version checks, metrics) and asks the sync's
receiver, never the transport's name, for every transport-specific step (the server side of the shape of
vLLM's `distributed/weight_transfer` engines, mirroring the learner's `learner.weights.transports`):

- begin: `begin(request, engine)` checks the begin against the transport and the engine before anything
  staged is superseded, and makes the sync's `Transfer`; `start(sync, engine)` then starts receiving;
- receive: a bucket (`open`, `accept`, `slot`, `take`, `add`: a file checked against the manifest by the
  staging) or a collective (started at begin, the engine receives every bucket over the learner's group);
- prepare: `wait` (outside the lock, bounded) and `prepared`, then `missing`;
- commit: `received` (every byte in, or `SyncValidationError`), `update` (what the engine applies) and
  `staging_stages` (where the bytes waited);
- abort / any end: `end(sync, outcome)` releases the sync's files or receive.

Implementations register under their transport name (`register`, names from `shared_schemas.sync`): `http`
and `shm` (`receivers.http`, `receivers.shm`, both on `receivers.files`), `gloo` and `nccl`
(`receivers.collective`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from rollout_server.engines.base import Engine, StagedUpdate
from rollout_server.errors import SyncValidationError
from shared_schemas.registry import registrar
from shared_schemas.sync import TRANSPORT_NAMES, SyncBeginRequest, SyncManifest

if TYPE_CHECKING:
    from rollout_server.weights.receivers.files import StagedFiles

__all__ = ["RECEIVERS", "Receiver", "ReceiverOptions", "StagedSync", "Transfer", "register"]

BucketBody = bytes | bytearray | memoryview | AsyncIterator[bytes]
"""An HTTP bucket body: whole, or streamed as it arrives."""


@dataclass(frozen=True)
class ReceiverOptions:
    """What a receiver may need (each takes what it uses).

    Attributes:
        files: the server's staged bucket files (`files.StagedFiles`: private sync directories, body pool).
        collective_staging: `server.sync_staging`, handed to the engine's receivers with each collective sync.
    """

    files: StagedFiles
    collective_staging: Literal["auto", "device", "host"] = "auto"


class Transfer:
    """One sync's transport state, made by its receiver's `begin` (subclasses add their own)."""

    transport: str = ""
    """How the bytes came in (the sync's metrics label)."""


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


class Receiver:
    """One transport's way in (see the module docstring). `name` is the `rollout.sync.transport` it serves.

    The defaults are those of a transport without buckets, without a wait and without anything to release.
    """

    name: ClassVar[str] = ""
    streams: ClassVar[bool] = False
    """Bucket receivers: True when `take` runs outside the staging lock (a body that may take long to
    arrive; the staging checks afterwards that the sync is still staged)."""

    def __init__(self, options: ReceiverOptions) -> None:
        self.options = options

    # -- begin -------------------------------------------------------------------------------------------
    def begin(self, request: SyncBeginRequest, engine: Engine) -> Transfer:
        """Checks `request` against this transport and `engine` (nothing staged changes yet) and makes the
        sync's transfer state.

        Raises:
            SyncValidationError: the transport cannot carry this sync to this engine.
        """
        raise NotImplementedError

    def start(self, sync: StagedSync, engine: Engine) -> tuple[int, bool]:
        """Starts receiving once `sync` is the staged one; returns the begin answer's `collective_ranks`
        and `collective_joining`."""
        return 0, False

    # -- receive: one bucket -----------------------------------------------------------------------------
    def open(self) -> None:
        """Raises `ConflictError` when this server takes no bucket this way."""

    def accept(self, sync: StagedSync, index: int) -> None:
        """Raises unless `sync` takes bucket `index` as a file (`ConflictError`, `SyncValidationError`)."""
        raise NotImplementedError

    def slot(self, sync: StagedSync, index: int) -> Path:
        """The file bucket `index` of `sync` is taken into (this receiver's bucket route)."""
        raise NotImplementedError

    async def take(self, path: Path, payload: Any) -> None:
        """Puts the bucket `payload` into `path` (the caller removes `path` when this raises)."""
        raise NotImplementedError

    async def refused(self, payload: Any) -> None:
        """A bucket was refused before `take`: consume what is left of `payload`."""

    def add(self, sync: StagedSync, index: int, path: Path) -> int:
        """Records the checked file `path` as bucket `index` of `sync`; returns how many buckets it holds."""
        raise NotImplementedError

    def drop(self, sync: StagedSync, path: Path) -> None:
        """Removes a refused bucket file of `sync`."""
        path.unlink(missing_ok=True)

    # -- prepare -----------------------------------------------------------------------------------------
    async def wait(self, sync: StagedSync) -> None:
        """Waits (outside the staging lock, bounded by the transport's timeout) until every byte is in."""

    def prepared(self, sync: StagedSync, seconds: float) -> str | None:
        """After `wait`, `seconds` later: why the receive failed, or None."""
        return None

    def missing(self, sync: StagedSync) -> list[int]:
        """Manifest buckets not received yet."""
        return []

    def failure(self, sync: StagedSync, reason: str) -> SyncValidationError:
        """The error of a receive that failed for `reason` (`prepared`; the staging discards the sync)."""
        raise NotImplementedError

    # -- commit ------------------------------------------------------------------------------------------
    async def received(self, sync: StagedSync) -> None:
        """Waits (bounded) until every byte is in.

        Raises:
            SyncValidationError: the receive failed or timed out (`failure`).
        """

    async def update(self, sync: StagedSync) -> StagedUpdate:
        """What the engine applies for the complete `sync`."""
        raise NotImplementedError

    def staging_stages(self, sync: StagedSync) -> dict[str, float]:
        """Where the sync's bytes waited for the commit, in bytes, when the engine does not say: the bucket
        files (host tmpfs)."""
        return {"staging_device_bytes": 0.0, "staging_host_bytes": float(sync.manifest.nbytes)}

    # -- abort / end -------------------------------------------------------------------------------------
    def end(self, sync: StagedSync, outcome: str) -> None:
        """Releases what `sync` holds (`outcome`: see `SyncStaging._finish`)."""


RECEIVERS: dict[str, type[Receiver]] = {}
"""Receiver classes by transport name (the learner's `learner.weights.transports.TRANSPORTS`, mirrored)."""


register = registrar(RECEIVERS, "weight-sync receiver", TRANSPORT_NAMES)
"""Class decorator: `@register(name)` adds a class to `RECEIVERS` under `name` (once)."""
