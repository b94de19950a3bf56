"""Buckets that arrive one request at a time and are staged as files (`http` bodies, `shm` files).

Every staged bucket is a FILE, never bytes in the server's heap: an HTTP body streams into a file of the
server's private pool directory (on `/dev/shm`; after a committed sync its files are kept and overwritten by
the next sync's bodies, so their tmpfs pages are not allocated and zeroed again — steady-state cost: one
model's worth of tmpfs per server, which a sync needs anyway), an shm bucket is adopted into a per-sync
private directory inside `server.shm_dir` (`.rollmatch-staged-*`, removed with the sync; both places:
`file_store.StagedFiles`). Either way the engine's worker processes map it by name at commit and load from
the mapping (`engines.vllm.worker`), so bucket bytes never travel through the engine's RPC. Each bucket's
header is checked against the manifest before its ack; the files of a discarded, superseded, timed-out or
finished sync are removed.

`FileReceiver.receive` is the whole bucket route: the staging's lock and lookup around the steps its two
transports define (`open`, `slot`, `take`, `refused`; `streams`). One sync may take each bucket either way: a
sync without a collective group is begun by the `http` receiver (`receivers.Receivers.for_begin`) and its
`FileTransfer` holds the buckets of both routes.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from rollout_server.engines.base import AdapterUpdate, Engine, FullUpdate, StagedUpdate
from rollout_server.errors import ConflictError, RolloutServerError, SyncValidationError, UnknownSyncError
from rollout_server.weights.bucket_files import check_file
from rollout_server.weights.receivers.base import Receiver, StagedSync, StagingAccess, Transfer
from rollout_server.weights.receivers.file_store import StagedFiles
from shared_schemas.buckets import BucketMismatchError, decode_bucket, encode_bucket
from shared_schemas.sync import BucketAck, SyncBeginRequest, SyncManifest

logger = logging.getLogger(__name__)

__all__ = ["FileReceiver", "FileTransfer"]


@dataclass
class FileTransfer(Transfer):
    """The staged bucket files of one sync."""

    transport: str = ""
    """`http`, or `shm` once a bucket came as a file."""
    buckets: dict[int, Path] = field(default_factory=dict)
    dir: Path | None = None
    """Private directory of this sync's adopted bucket files (created with the first)."""
    owned: set[Path] = field(default_factory=set)
    """Pool files holding this sync's HTTP bodies (recycled after a successful commit, else removed)."""

    def missing(self, manifest: SyncManifest) -> list[int]:
        return [i for i in range(len(manifest.buckets)) if i not in self.buckets]


class FileReceiver(Receiver):
    """A transport whose buckets arrive one request at a time and are staged as files (see the module).

    Its transports define how a bucket gets into its file: `open` (may this server take buckets this way),
    `slot` (the file), `take` (the bytes into it), `refused` (what is left of a refused payload), `streams`.
    """

    streams: ClassVar[bool] = False
    """True when `take` runs outside the staging lock (a body that may take long to arrive; the sync is
    looked up again afterwards)."""

    @property
    def files(self) -> StagedFiles:
        return self.options.files

    # -- the verbs -----------------------------------------------------------------------------------------
    def begin(self, request: SyncBeginRequest, engine: Engine) -> FileTransfer:
        return FileTransfer(transport=self.name)

    async def receive(self, staging: StagingAccess, sync_id: str, index: int, payload: Any) -> BucketAck:
        """A receiver that `streams` takes the bytes outside the lock (other phases go on); a sync superseded
        or aborted meanwhile loses the file and answers 404."""
        try:
            async with staging.lock:
                self.open()
                sync = staging.staged(sync_id)
                transfer = _accept(sync, index)
                started = time.perf_counter()
                path = self.slot(sync, transfer, index)
                if not self.streams:
                    await self._take(path, payload)
                    return await self._stage(staging, sync, index, path, started)
        except RolloutServerError:
            await self.refused(payload)
            raise
        started = time.perf_counter()
        try:
            await self.take(path, payload)
        except OSError:
            path.unlink(missing_ok=True)
            async with staging.lock:
                staging.staged(sync_id)  # 404 when the sync was discarded (its directory removed) meanwhile
            raise
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        async with staging.lock:
            try:
                sync = staging.staged(sync_id)
            except UnknownSyncError:
                path.unlink(missing_ok=True)
                raise
            return await self._stage(staging, sync, index, path, started)

    async def commit(self, sync: StagedSync) -> StagedUpdate:
        return await asyncio.to_thread(_staged_update, sync.manifest, file_transfer(sync).buckets)

    def abort(self, sync: StagedSync, outcome: str) -> None:
        # Committed: the workers have loaded and dropped their mappings, so pool files may be reused.
        transfer = file_transfer(sync)
        self.files.release(transfer.dir, transfer.owned, recycle=outcome == "committed")
        transfer.owned = set()

    # -- the steps of one bucket (the transports') -----------------------------------------------------------
    def open(self) -> None:
        """Raises `ConflictError` when this server takes no bucket this way."""

    def slot(self, sync: StagedSync, transfer: FileTransfer, index: int) -> Path:
        """The file bucket `index` of `sync` is taken into."""
        raise NotImplementedError

    async def take(self, path: Path, payload: Any) -> None:
        """Puts the bucket `payload` into `path` (the caller removes `path` when this raises)."""
        raise NotImplementedError

    async def refused(self, payload: Any) -> None:
        """A bucket was refused before `take`: consume what is left of `payload`."""

    # -- helpers -------------------------------------------------------------------------------------------
    async def _take(self, path: Path, payload: Any) -> None:
        try:
            await self.take(path, payload)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    async def _stage(
        self, staging: StagingAccess, sync: StagedSync, index: int, path: Path, started: float
    ) -> BucketAck:
        """Checks the file against the manifest (a mismatch discards the sync) and records it as bucket
        `index`."""
        try:
            transfer = _accept(sync, index)
            await asyncio.to_thread(check_file, path, sync.manifest.buckets[index])
        except BucketMismatchError as exc:
            path.unlink(missing_ok=True)
            file_transfer(sync).owned.discard(path)
            staging.discard(sync, f"bucket {index} rejected", "rejected")
            raise SyncValidationError(
                f"{exc}; sync {sync.sync_id} discarded, begin again", type="bucket_mismatch"
            ) from exc
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        previous = transfer.buckets.get(index)
        if previous is not None:
            logger.warning("sync %s: bucket %d received again; keeping the latest", sync.sync_id, index)
            previous.unlink(missing_ok=True)
            transfer.owned.discard(previous)
        transfer.buckets[index] = path
        sync.receive_s += time.perf_counter() - started
        return BucketAck(
            sync_id=sync.sync_id,
            index=index,
            received=len(transfer.buckets),
            expected=len(sync.manifest.buckets),
        )


def file_transfer(sync: StagedSync) -> FileTransfer:
    assert isinstance(sync.transfer, FileTransfer)
    return sync.transfer


def _accept(sync: StagedSync, index: int) -> FileTransfer:
    """`sync`'s files, once it takes bucket `index` as a file.

    Raises:
        ConflictError: `sync` receives over a collective group, not bucket by bucket.
        SyncValidationError: `index` is not a bucket of its manifest.
    """
    transfer = sync.transfer
    if not isinstance(transfer, FileTransfer):
        raise ConflictError(
            f"sync {sync.sync_id} sends its buckets over the {transfer.transport} group, not as HTTP or shm"
            " buckets; broadcast them, then commit",
            type="collective_sync",
        )
    count = len(sync.manifest.buckets)
    if not 0 <= index < count:
        raise SyncValidationError(
            f"bucket index {index} out of range; the manifest of sync {sync.sync_id} has buckets"
            f" 0..{count - 1}",
            type="bucket_out_of_range",
        )
    return transfer


def _staged_update(manifest: SyncManifest, buckets: dict[int, Path]) -> StagedUpdate:
    ordered = tuple(buckets[i] for i in range(len(manifest.buckets)))
    if manifest.mode == "full":
        return FullUpdate(version=manifest.version, buckets=ordered)
    assert manifest.adapter_name is not None and manifest.adapter_config is not None
    if len(ordered) == 1:
        blob = ordered[0].read_bytes()
    else:
        # Adapters are small; one blob keeps the engine side simple.
        tensors = [
            t
            for spec, path in zip(manifest.buckets, ordered, strict=True)
            for t in decode_bucket(path.read_bytes(), spec)
        ]
        blob = encode_bucket(tensors)
    return AdapterUpdate(
        version=manifest.version,
        adapter_name=manifest.adapter_name,
        adapter_config=dict(manifest.adapter_config),
        adapter_safetensors=blob,
    )
