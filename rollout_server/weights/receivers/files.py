"""Buckets that arrive one request at a time and are staged as files (`http` bodies, `shm` files).

Every staged bucket is a FILE, never bytes in the server's heap: an HTTP body streams into a file of the
server's private pool directory (on `/dev/shm`; after a committed sync its files are kept and overwritten by
the next sync's bodies, so their tmpfs pages are not allocated and zeroed again — steady-state cost: one
model's worth of tmpfs per server, which a sync needs anyway), an shm bucket is adopted into a per-sync
private directory inside `server.shm_dir` (`.rollmatch-staged-*`, removed with the sync). Either way the
engine's worker processes map it by name at commit and load from the mapping (`engines.vllm.worker`), so
bucket bytes never travel through the engine's RPC. The staging checks each bucket's header against the
manifest before its ack; the files of a discarded, superseded, timed-out or finished sync are removed.

One sync may take each bucket either way: a sync without a collective group is begun by the `http` receiver
(`receivers.Receivers.for_begin`) and its `FileTransfer` holds the buckets of both routes.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from rollout_server.engines.base import AdapterUpdate, Engine, FullUpdate, StagedUpdate
from rollout_server.errors import SyncValidationError
from rollout_server.weights.receivers.base import Receiver, StagedSync, Transfer
from shared_schemas.buckets import decode_bucket, encode_bucket
from shared_schemas.sync import SyncBeginRequest, SyncManifest

logger = logging.getLogger(__name__)

__all__ = ["STAGED_DIR_PREFIX", "FileReceiver", "FileTransfer", "StagedFiles", "file_transfer"]

STAGED_DIR_PREFIX = ".rollmatch-staged-"
"""Prefix of the private directory (in `server.shm_dir`) that holds one sync's staged bucket files."""


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


class StagedFiles:
    """Where this server's staged bucket files live: per-sync private directories (in `shm_dir`, so that
    learner files are adopted by hard link) and the pool of body files, recycled after a committed sync.

    Args:
        shm_dir: `server.shm_dir`; None disables the `shm` route.
    """

    def __init__(self, shm_dir: Path | None) -> None:
        self.shm_dir = shm_dir
        self.pool: Path | None = None
        """Directory of the pooled body files (None until the first body)."""
        self._spare: list[Path] = []

    def private_file(self, sync_id: str, transfer: FileTransfer, index: int) -> Path:
        """A fresh file name in the sync's private directory (created on first use, on the filesystem of
        `shm_dir` so learner files are adopted by hard link; removed with the sync)."""
        if transfer.dir is None:
            if self.shm_dir is not None:
                self.shm_dir.mkdir(parents=True, exist_ok=True)
                parent: str | None = str(self.shm_dir)
            else:
                parent = _dev_shm()
            transfer.dir = Path(tempfile.mkdtemp(prefix=f"{STAGED_DIR_PREFIX}{sync_id[:8]}-", dir=parent))
        return transfer.dir / f"b{index}-{secrets.token_hex(4)}.safetensors"

    def body_file(self, transfer: FileTransfer) -> Path:
        """A pool file for one HTTP body: a spare one from the last committed sync (its pages already
        allocated), else a new name in the pool directory."""
        if self._spare:
            path = self._spare.pop()
        else:
            if self.pool is None:
                self.pool = Path(tempfile.mkdtemp(prefix="rollmatch-sync-pool-", dir=_dev_shm()))
            path = self.pool / f"body-{secrets.token_hex(8)}.safetensors"
        transfer.owned.add(path)
        return path

    def release(self, transfer: FileTransfer, *, recycle: bool) -> None:
        """Removes a finished sync's files; after a commit (`recycle`) its pool files become the spares."""
        if transfer.dir is not None:
            shutil.rmtree(transfer.dir, ignore_errors=True)
        if recycle:
            for path in self._spare:
                path.unlink(missing_ok=True)
            self._spare = [path for path in transfer.owned if path.exists()]
        else:
            for path in transfer.owned:
                path.unlink(missing_ok=True)
        transfer.owned = set()

    def close(self) -> None:
        """Drops the spares and the pool directory (server shutdown)."""
        self._spare = []
        if self.pool is not None:
            shutil.rmtree(self.pool, ignore_errors=True)
            self.pool = None


class FileReceiver(Receiver):
    """A transport whose buckets arrive one request at a time and are staged as files (see the module)."""

    @property
    def files(self) -> StagedFiles:
        return self.options.files

    def begin(self, request: SyncBeginRequest, engine: Engine) -> FileTransfer:
        return FileTransfer(transport=self.name)

    def accept(self, sync: StagedSync, index: int) -> None:
        count = len(sync.manifest.buckets)
        if not 0 <= index < count:
            raise SyncValidationError(
                f"bucket index {index} out of range; the manifest of sync {sync.sync_id} has buckets"
                f" 0..{count - 1}",
                type="bucket_out_of_range",
            )

    def add(self, sync: StagedSync, index: int, path: Path) -> int:
        transfer = file_transfer(sync)
        previous = transfer.buckets.get(index)
        if previous is not None:
            logger.warning("sync %s: bucket %d received again; keeping the latest", sync.sync_id, index)
            previous.unlink(missing_ok=True)
            transfer.owned.discard(previous)
        transfer.buckets[index] = path
        return len(transfer.buckets)

    def drop(self, sync: StagedSync, path: Path) -> None:
        path.unlink(missing_ok=True)
        file_transfer(sync).owned.discard(path)

    def missing(self, sync: StagedSync) -> list[int]:
        buckets = file_transfer(sync).buckets
        return [i for i in range(len(sync.manifest.buckets)) if i not in buckets]

    async def update(self, sync: StagedSync) -> StagedUpdate:
        return await asyncio.to_thread(_staged_update, sync.manifest, file_transfer(sync).buckets)

    def end(self, sync: StagedSync, outcome: str) -> None:
        # Committed: the workers have loaded and dropped their mappings, so pool files may be reused.
        self.files.release(file_transfer(sync), recycle=outcome == "committed")


def file_transfer(sync: StagedSync) -> FileTransfer:
    assert isinstance(sync.transfer, FileTransfer)
    return sync.transfer


def _dev_shm() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None


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
