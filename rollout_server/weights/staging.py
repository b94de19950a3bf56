"""Weight-sync staging: begin → buckets → commit (or abort / timeout), applied all or nothing.

One sync is staged at a time; a new `begin` supersedes (discards) a staged one, so a learner that died
mid-sync never blocks the next. Every phase runs under one lock, so a commit never races a bucket. Any
rejected bucket or commit discards the staged sync: nothing reaches the engine until every bucket has
arrived and matched the manifest, and the engine's `apply_update` is itself all or nothing.

Buckets arrive as HTTP body bytes or as the NAME of a file inside the configured staging directory; such
a file is memory-mapped, checked from its header, then copied, so the learner may reuse it after the ack.
"""

from __future__ import annotations

import asyncio
import logging
import mmap
import os
import secrets
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from rollout_server.engines.base import AdapterUpdate, Engine, FullUpdate, StagedUpdate
from rollout_server.errors import (
    ConflictError,
    EngineError,
    NotFoundError,
    RolloutServerError,
    StaleVersionError,
    SyncValidationError,
    UnknownSyncError,
)
from rollout_server.weights.validate import check_manifest
from shared_schemas.buckets import BucketMismatchError, check_bucket, decode_bucket, encode_bucket
from shared_schemas.sync import (
    BucketAck,
    ShmBucketRef,
    SyncAbortResponse,
    SyncBeginRequest,
    SyncBeginResponse,
    SyncCommitResponse,
    SyncManifest,
)

logger = logging.getLogger(__name__)

__all__ = ["SyncStaging", "read_shm_bucket"]


@dataclass
class _Pending:
    sync_id: str
    manifest: SyncManifest
    timeout_s: float
    deadline: float
    buckets: dict[int, bytes] = field(default_factory=dict)


def read_shm_bucket(shm_dir: Path, file_name: str) -> bytes:
    """Reads a bucket file by NAME from the staging directory, refusing anything outside it.

    Args:
        shm_dir: the configured staging directory.
        file_name: a plain file name (already checked to hold no separator).

    Returns:
        The file's bytes (memory-mapped, then copied).

    Raises:
        SyncValidationError: the name escapes the directory, is a symlink or not a regular file.
        NotFoundError: no such file.
    """
    root = shm_dir.resolve()
    path = root / file_name
    if path.parent != root or file_name in {"", ".", ".."}:
        raise SyncValidationError(
            f"shm file name {file_name!r} is not inside the staging dir", type="bad_shm_name"
        )
    try:
        # O_NOFOLLOW: a symlink planted in the staging dir must not lead outside it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise NotFoundError(
            f"shm bucket file {file_name!r} not found in the staging dir; write it there before posting its name",
            type="shm_file_not_found",
        ) from exc
    except OSError as exc:
        raise SyncValidationError(
            f"shm bucket file {file_name!r} cannot be opened ({exc.strerror}); it must be a regular file,"
            " not a symlink",
            type="bad_shm_name",
        ) from exc
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise SyncValidationError(f"shm bucket {file_name!r} is not a regular file", type="bad_shm_name")
        if info.st_size == 0:
            return b""
        with mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ) as mapped:
            return bytes(mapped)
    finally:
        os.close(fd)


class SyncStaging:
    """The staged-sync state machine of one server.

    Args:
        shm_dir: staging directory for same-host bucket files; None disables the shm transport.
        default_timeout_s: idle seconds after which a staged sync is discarded.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(
        self, shm_dir: Path | None, default_timeout_s: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._shm_dir = shm_dir
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._pending: _Pending | None = None
        self._lock = asyncio.Lock()

    @property
    def active_sync_id(self) -> str | None:
        """Id of the staged sync, if any (expired ones included until the next sweep)."""
        return self._pending.sync_id if self._pending else None

    def sweep(self) -> None:
        """Discards the staged sync when it has been idle past its timeout."""
        pending = self._pending
        if pending is not None and self._clock() > pending.deadline:
            logger.warning(
                "sync %s (version %d) timed out after %.0f s idle; discarded",
                pending.sync_id,
                pending.manifest.version,
                pending.timeout_s,
            )
            self._pending = None

    def _get(self, sync_id: str) -> _Pending:
        self.sweep()
        pending = self._pending
        if pending is None or not secrets.compare_digest(pending.sync_id, sync_id):
            raise UnknownSyncError(
                f"no staged sync {sync_id!r} (never begun, superseded, committed, aborted or timed out);"
                " start again with begin"
            )
        pending.deadline = self._clock() + pending.timeout_s
        return pending

    def _discard(self, pending: _Pending, reason: str) -> None:
        if self._pending is pending:
            self._pending = None
            logger.warning("sync %s discarded: %s", pending.sync_id, reason)

    async def begin(self, request: SyncBeginRequest, engine: Engine) -> SyncBeginResponse:
        """Validates the manifest against the engine and stages an empty sync."""
        async with self._lock:
            self.sweep()
            manifest = request.manifest
            check_manifest(
                manifest,
                current_version=engine.weight_version,
                lora_enabled=engine.lora_enabled,
                specs=engine.parameter_specs() if manifest.mode == "full" else {},
            )
            if self._pending is not None:
                self._discard(self._pending, "superseded by a new begin")
            timeout_s = request.timeout_s or self._default_timeout_s
            pending = _Pending(
                sync_id=secrets.token_hex(16),
                manifest=manifest,
                timeout_s=timeout_s,
                deadline=self._clock() + timeout_s,
            )
            self._pending = pending
            logger.info(
                "sync %s begun: mode %s, version %d, %d buckets, %d tensors, %.1f MiB",
                pending.sync_id,
                manifest.mode,
                manifest.version,
                len(manifest.buckets),
                len(manifest.tensors),
                manifest.nbytes / 2**20,
            )
            return SyncBeginResponse(
                sync_id=pending.sync_id,
                current_version=engine.weight_version,
                num_buckets=len(manifest.buckets),
                expires_in_s=timeout_s,
            )

    async def put_bucket(self, sync_id: str, index: int, data: bytes) -> BucketAck:
        """Stages one bucket received as HTTP body bytes."""
        async with self._lock:
            pending = self._get(sync_id)
            return await self._stage(pending, index, data)

    async def put_shm_bucket(self, sync_id: str, index: int, ref: ShmBucketRef) -> BucketAck:
        """Stages one bucket named by file inside the staging directory."""
        async with self._lock:
            if self._shm_dir is None:
                raise ConflictError(
                    "shm transport is disabled on this server; send buckets as HTTP bodies"
                    " (rollout.sync.transport: http) or set server.shm_dir",
                    type="shm_disabled",
                )
            pending = self._get(sync_id)
            self._check_index(pending, index)
            data = await asyncio.to_thread(read_shm_bucket, self._shm_dir, ref.file_name)
            return await self._stage(pending, index, data)

    def _check_index(self, pending: _Pending, index: int) -> None:
        count = len(pending.manifest.buckets)
        if not 0 <= index < count:
            raise SyncValidationError(
                f"bucket index {index} out of range; the manifest of sync {pending.sync_id} has buckets"
                f" 0..{count - 1}",
                type="bucket_out_of_range",
            )

    async def _stage(self, pending: _Pending, index: int, data: bytes) -> BucketAck:
        self._check_index(pending, index)
        try:
            await asyncio.to_thread(check_bucket, data, pending.manifest.buckets[index])
        except BucketMismatchError as exc:
            self._discard(pending, f"bucket {index} rejected")
            raise SyncValidationError(
                f"{exc}; sync {pending.sync_id} discarded, begin again", type="bucket_mismatch"
            ) from exc
        if index in pending.buckets:
            logger.warning("sync %s: bucket %d received again; keeping the latest", pending.sync_id, index)
        pending.buckets[index] = data
        return BucketAck(
            sync_id=pending.sync_id,
            index=index,
            received=len(pending.buckets),
            expected=len(pending.manifest.buckets),
        )

    async def commit(self, sync_id: str, engine: Engine) -> SyncCommitResponse:
        """Applies a complete sync through `engine.apply_update`; any failure discards it."""
        async with self._lock:
            pending = self._get(sync_id)
            manifest = pending.manifest
            # Whatever happens below, this sync is finished: applied, or rejected and discarded.
            self._pending = None
            missing = [i for i in range(len(manifest.buckets)) if i not in pending.buckets]
            if missing:
                logger.warning("sync %s discarded at commit: buckets %s missing", sync_id, missing)
                raise SyncValidationError(
                    f"sync {sync_id} is missing buckets {missing[:10]} of {len(manifest.buckets)}; nothing"
                    " applied, begin again and send every bucket",
                    type="missing_bucket",
                    detail={"missing": missing[:100]},
                )
            if manifest.version <= engine.weight_version:
                raise StaleVersionError(
                    f"sync version {manifest.version} <= current weight_version {engine.weight_version}"
                    " (another sync committed first); nothing applied"
                )
            update = await asyncio.to_thread(_staged_update, manifest, pending.buckets)
            started = time.perf_counter()
            try:
                await engine.apply_update(update)
            except RolloutServerError:
                raise
            except Exception as exc:
                logger.exception("sync %s: engine failed to apply version %d", sync_id, manifest.version)
                raise EngineError(
                    f"engine failed to apply sync version {manifest.version} ({type(exc).__name__});"
                    " the previous weights are still served"
                ) from exc
            apply_s = time.perf_counter() - started
            logger.info(
                "sync %s committed: version %d (%s) in %.2f s",
                sync_id,
                manifest.version,
                manifest.mode,
                apply_s,
            )
            return SyncCommitResponse(
                sync_id=sync_id,
                mode=manifest.mode,
                weight_version=engine.weight_version,
                num_tensors=len(manifest.tensors),
                nbytes=manifest.nbytes,
                apply_s=apply_s,
            )

    async def abort(self, sync_id: str) -> SyncAbortResponse:
        """Discards the staged sync `sync_id`; aborting an unknown id is not an error."""
        async with self._lock:
            pending = self._pending
            if pending is not None and secrets.compare_digest(pending.sync_id, sync_id):
                self._discard(pending, "aborted by the client")
                return SyncAbortResponse(sync_id=sync_id, aborted=True)
            return SyncAbortResponse(sync_id=sync_id, aborted=False)


def _staged_update(manifest: SyncManifest, buckets: dict[int, bytes]) -> StagedUpdate:
    ordered = tuple(buckets[i] for i in range(len(manifest.buckets)))
    if manifest.mode == "full":
        return FullUpdate(version=manifest.version, buckets=ordered)
    assert manifest.adapter_name is not None and manifest.adapter_config is not None
    if len(ordered) == 1:
        blob = ordered[0]
    else:
        # Adapters are small; one blob keeps the engine side simple.
        tensors = [
            t for spec, data in zip(manifest.buckets, ordered, strict=True) for t in decode_bucket(data, spec)
        ]
        blob = encode_bucket(tensors)
    return AdapterUpdate(
        version=manifest.version,
        adapter_name=manifest.adapter_name,
        adapter_config=dict(manifest.adapter_config),
        adapter_safetensors=blob,
    )
