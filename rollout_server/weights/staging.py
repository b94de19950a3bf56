"""Weight-sync staging: begin → buckets → [prepare] → commit (or abort / timeout), applied all or nothing.

One sync is staged at a time; a new `begin` supersedes (discards) a staged one, so a learner that died
mid-sync never blocks the next. Every phase runs under one lock, so a commit never races a bucket. Any
rejected bucket or commit discards the staged sync: nothing reaches the engine until every bucket has arrived
and matched the manifest, and the engine's `apply_update` is itself all or nothing. `prepare` answers once
every bucket is in (a collective sync: once its receive has finished), so that a learner with several servers
commits none of them before all hold the update.

Every staged bucket is a FILE, never bytes in the server's heap: an HTTP body streams into a file of the
server's private pool directory (on `/dev/shm`; after a committed sync its files are kept and overwritten by
the next sync's bodies, so their tmpfs pages are not allocated and zeroed again — steady-state cost: one
model's worth of tmpfs per server, which a sync needs anyway), an shm bucket is adopted into a per-sync
private directory inside `server.shm_dir` (`.rollmatch-staged-*`, removed with the sync). Either way the
engine's worker processes map it by name at commit and load from the mapping (`engines.vllm.worker`), so
bucket bytes never travel through the engine's RPC. An HTTP body is written as it arrives (no whole-body
buffer); an shm bucket — the NAME of a file the learner wrote into `server.shm_dir` — is opened without
following links, checked to be a regular file, and taken over with a hard link of the server's own (the
learner's name may go after the ack; with several servers each keeps its own link to the one file). Each
bucket's header is checked against the manifest before its ack; the files of a discarded, superseded,
timed-out or finished sync are removed.

How each transport's bytes come in (a body, an adopted file, the engine's receive over the learner's group) is
`weights.receivers`, one receiver per `rollout.sync.transport` name, mirroring `learner.weights.transports`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import tempfile
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from rollout_server.engines.base import (
    AdapterUpdate,
    CollectiveEngine,
    Engine,
    FullUpdate,
    ReceivedUpdate,
    Rendezvous,
    StagedUpdate,
)
from rollout_server.errors import (
    ConflictError,
    EngineError,
    RolloutServerError,
    StaleVersionError,
    SyncValidationError,
    UnknownSyncError,
)
from rollout_server.weights.bucket_files import check_file
from rollout_server.weights.receivers import RECEIVERS, CollectiveReceiver, HttpReceiver, ShmReceiver
from rollout_server.weights.validate import check_manifest
from shared_schemas.buckets import BucketMismatchError, decode_bucket, encode_bucket
from shared_schemas.sync import (
    BucketAck,
    ShmBucketRef,
    SyncAbortResponse,
    SyncBeginRequest,
    SyncBeginResponse,
    SyncCommitResponse,
    SyncManifest,
    SyncPrepareResponse,
)

logger = logging.getLogger(__name__)

__all__ = ["STAGED_DIR_PREFIX", "SyncStaging"]

STAGED_DIR_PREFIX = ".rollmatch-staged-"
"""Prefix of the private directory (in `server.shm_dir`) that holds one sync's staged bucket files."""


@dataclass
class _Pending:
    sync_id: str
    manifest: SyncManifest
    timeout_s: float
    deadline: float
    buckets: dict[int, Path] = field(default_factory=dict)
    dir: Path | None = None
    """Private directory of this sync's staged bucket files (created with the first bucket)."""
    owned: set[Path] = field(default_factory=set)
    """Pool files holding this sync's HTTP bodies (recycled after a successful commit, else removed)."""
    receive_s: float = 0.0
    """Seconds spent taking buckets in (body or file read, header check)."""
    began: float = 0.0
    """Clock reading at begin (for the sync's duration)."""
    transport: str = "http"
    """How the buckets arrived: `http`, or `shm` once a bucket came as a file (collective: the group's
    backend)."""
    collective: Rendezvous | None = None
    """Collective transport: the group the buckets are broadcast over (no HTTP/shm buckets then)."""
    receiving: asyncio.Task[None] | None = None
    """Collective transport: the engine receiving the broadcasts, started at begin, awaited at commit."""


class SyncStaging:
    """The staged-sync state machine of one server.

    Args:
        shm_dir: staging directory for same-host bucket files; None disables the shm transport.
        default_timeout_s: idle seconds after which a staged sync is discarded.
        clock: monotonic clock (injectable for tests).
        on_finish: called once per sync that ends (`metrics.ServerMetrics.sync_finished`'s keywords: mode,
            transport, outcome, nbytes, seconds; committed syncs add `stages`, which carry the staging bytes).
        collective_staging: `server.sync_staging`, handed to the engine's receivers with each collective sync.
    """

    def __init__(
        self,
        shm_dir: Path | None,
        default_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        on_finish: Callable[..., None] | None = None,
        collective_staging: Literal["auto", "device", "host"] = "auto",
    ) -> None:
        self._on_finish = on_finish
        # How the bytes come in, one receiver per transport (`weights.receivers`, the learner's mirrored).
        self._http = HttpReceiver()
        self._shm = ShmReceiver(shm_dir) if shm_dir is not None else None
        self._collective: dict[str, CollectiveReceiver] = {
            name: cls(collective_staging)  # type: ignore[call-arg]
            for name, cls in RECEIVERS.items()
            if issubclass(cls, CollectiveReceiver)
        }
        self._shm_dir = shm_dir
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._pending: _Pending | None = None
        self._lock = asyncio.Lock()
        self._pool: Path | None = None
        self._spare: list[Path] = []
        self.applying = False
        """True while a commit applies an update to the engine (the probe listener's readiness)."""

    def _new_file(self, pending: _Pending, index: int) -> Path:
        """A fresh file name in the sync's private directory (created on first use, on the filesystem of
        `server.shm_dir` so learner files are adopted by hard link; removed with the sync)."""
        if pending.dir is None:
            if self._shm_dir is not None:
                self._shm_dir.mkdir(parents=True, exist_ok=True)
                parent: str | None = str(self._shm_dir)
            else:
                parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
            pending.dir = Path(
                tempfile.mkdtemp(prefix=f"{STAGED_DIR_PREFIX}{pending.sync_id[:8]}-", dir=parent)
            )
        return pending.dir / f"b{index}-{secrets.token_hex(4)}.safetensors"

    def _body_file(self, pending: _Pending) -> Path:
        """A pool file for one HTTP body: a spare one from the last committed sync (its pages already
        allocated), else a new name in the pool directory."""
        if self._spare:
            path = self._spare.pop()
        else:
            if self._pool is None:
                parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
                self._pool = Path(tempfile.mkdtemp(prefix="rollmatch-sync-pool-", dir=parent))
            path = self._pool / f"body-{secrets.token_hex(8)}.safetensors"
        pending.owned.add(path)
        return path

    def _finish(self, pending: _Pending, *, outcome: str, stages: dict[str, float] | None = None) -> None:
        """Ends a sync: removes its files (after a commit its pool files become the spares) and reports its
        `outcome` (`committed`, `rejected`, `aborted`, `expired`, `superseded`, `failed`, `closed`).
        A collective receive still running is left to run out (a thread blocked in a broadcast cannot be
        interrupted; its engine drops the group when the learner's side stays quiet past the group's timeout,
        and the next sync's receive starts after it: `CollectiveReceiver.start`); it is cancelled only at
        shutdown."""
        recycle = outcome == "committed"
        if self._on_finish is not None and outcome != "closed":
            extra = {"stages": stages} if stages is not None else {}
            self._on_finish(
                mode=pending.manifest.mode,
                transport=pending.collective.backend if pending.collective else pending.transport,
                outcome=outcome,
                nbytes=pending.manifest.nbytes,
                seconds=self._clock() - pending.began,
                **extra,
            )
        if outcome == "closed" and pending.receiving is not None and not pending.receiving.done():
            pending.receiving.cancel()
        if pending.dir is not None:
            shutil.rmtree(pending.dir, ignore_errors=True)
        if recycle:
            for path in self._spare:
                path.unlink(missing_ok=True)
            self._spare = [path for path in pending.owned if path.exists()]
        else:
            for path in pending.owned:
                path.unlink(missing_ok=True)
        pending.owned = set()

    def close(self) -> None:
        """Drops the staged sync and every staging file (server shutdown)."""
        if self._pending is not None:
            self._finish(self._pending, outcome="closed")
            self._pending = None
        self._spare = []
        if self._pool is not None:
            shutil.rmtree(self._pool, ignore_errors=True)
            self._pool = None

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
            self._finish(pending, outcome="expired")
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

    def _discard(self, pending: _Pending, reason: str, outcome: str) -> None:
        if self._pending is pending:
            self._pending = None
            self._finish(pending, outcome=outcome)
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
            receiver = (
                self._collective[request.collective.backend] if request.collective is not None else None
            )
            rendezvous = receiver.rendezvous(request, engine) if receiver is not None else None
            if self._pending is not None:
                self._discard(self._pending, "superseded by a new begin", "superseded")
            timeout_s = request.timeout_s or self._default_timeout_s
            pending = _Pending(
                sync_id=secrets.token_hex(16),
                manifest=manifest,
                timeout_s=timeout_s,
                deadline=self._clock() + timeout_s,
                began=self._clock(),
                collective=rendezvous,
            )
            joining = False
            receivers = 0
            if rendezvous is not None:
                assert isinstance(engine, CollectiveEngine)
                joining = not engine.holds_group(rendezvous.group)
                receivers = engine.collective_ranks
                assert receiver is not None
                pending.receiving = receiver.start(engine, rendezvous, manifest)
                logger.info(
                    "sync receives over %s group %s as ranks %d..%d of %d (%s)",
                    rendezvous.backend,
                    rendezvous.group,
                    rendezvous.first_rank,
                    rendezvous.first_rank + receivers - 1,
                    rendezvous.world_size,
                    "joining" if joining else "joined before",
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
                collective_ranks=receivers,
                collective_joining=joining,
            )

    async def put_bucket(self, sync_id: str, index: int, body: bytes | AsyncIterator[bytes]) -> BucketAck:
        """Stages one bucket received as the HTTP body, streamed into its staging file as it arrives.

        The body is written outside the lock (other phases go on); a sync superseded or aborted meanwhile
        loses the file and answers 404.
        """
        try:
            async with self._lock:
                pending = self._get(sync_id)
                self._check_index(pending, index)
                path = self._body_file(pending)
        except RolloutServerError:
            if not isinstance(body, bytes | bytearray | memoryview):
                async for _ in body:  # read the body out: an oversize one answers 413 first, as before
                    pass
            raise
        started = time.perf_counter()
        try:
            await self._http.take(path, body)
        except OSError:
            path.unlink(missing_ok=True)
            async with self._lock:
                self._get(sync_id)  # 404 when the sync was discarded (its directory removed) meanwhile
            raise
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        async with self._lock:
            try:
                pending = self._get(sync_id)
            except UnknownSyncError:
                path.unlink(missing_ok=True)
                raise
            return await self._stage(pending, index, path, started)

    async def put_shm_bucket(self, sync_id: str, index: int, ref: ShmBucketRef) -> BucketAck:
        """Stages one bucket named by file inside the staging directory (taken over by hard link, no copy)."""
        async with self._lock:
            if self._shm is None:
                raise ConflictError(
                    "shm transport is disabled on this server; send buckets as HTTP bodies"
                    " (rollout.sync.transport: http) or set server.shm_dir",
                    type="shm_disabled",
                )
            pending = self._get(sync_id)
            self._check_index(pending, index)
            pending.transport = "shm"
            started = time.perf_counter()
            path = self._new_file(pending, index)
            try:
                await self._shm.take(path, ref)
            except BaseException:
                path.unlink(missing_ok=True)
                raise
            return await self._stage(pending, index, path, started)

    def _check_index(self, pending: _Pending, index: int) -> None:
        if pending.collective is not None:
            raise ConflictError(
                f"sync {pending.sync_id} sends its buckets over the {pending.collective.backend} group, not"
                " as HTTP or shm buckets; broadcast them, then commit",
                type="collective_sync",
            )
        count = len(pending.manifest.buckets)
        if not 0 <= index < count:
            raise SyncValidationError(
                f"bucket index {index} out of range; the manifest of sync {pending.sync_id} has buckets"
                f" 0..{count - 1}",
                type="bucket_out_of_range",
            )

    async def _stage(self, pending: _Pending, index: int, path: Path, started: float) -> BucketAck:
        try:
            self._check_index(pending, index)
            await asyncio.to_thread(check_file, path, pending.manifest.buckets[index])
        except BucketMismatchError as exc:
            path.unlink(missing_ok=True)
            pending.owned.discard(path)
            self._discard(pending, f"bucket {index} rejected", "rejected")
            raise SyncValidationError(
                f"{exc}; sync {pending.sync_id} discarded, begin again", type="bucket_mismatch"
            ) from exc
        except BaseException:
            path.unlink(missing_ok=True)
            raise
        previous = pending.buckets.get(index)
        if previous is not None:
            logger.warning("sync %s: bucket %d received again; keeping the latest", pending.sync_id, index)
            previous.unlink(missing_ok=True)
            pending.owned.discard(previous)
        pending.buckets[index] = path
        pending.receive_s += time.perf_counter() - started
        return BucketAck(
            sync_id=pending.sync_id,
            index=index,
            received=len(pending.buckets),
            expected=len(pending.manifest.buckets),
        )

    async def prepare(self, sync_id: str) -> SyncPrepareResponse:
        """Answers once the staged sync holds every bucket, so that the commit will only apply: a collective
        sync waits (bounded by the group's timeout, outside the lock: an abort goes through meanwhile) for its
        receive to finish. A learner with several servers prepares every one before it commits any.

        Raises:
            SyncValidationError: the receive failed or timed out (`collective_failed`; the sync is
                discarded), or HTTP/shm buckets are missing (`missing_bucket`; the sync stays staged).
            UnknownSyncError: no such sync (or it was aborted or superseded while waiting).
        """
        started = time.perf_counter()
        async with self._lock:
            pending = self._get(sync_id)
            task = pending.receiving
        if task is not None and pending.collective is not None:
            await asyncio.wait({task}, timeout=pending.collective.timeout_s)
        async with self._lock:
            self._get(sync_id)  # 404 when it was aborted, superseded or timed out meanwhile
            if task is not None and pending.collective is not None:
                reason = None
                if not task.done():
                    reason = f"not every broadcast arrived within {pending.collective.timeout_s:.0f} s"
                elif task.cancelled():
                    reason = "the receive was cancelled"
                elif task.exception() is not None:
                    reason = str(task.exception())
                if reason is not None:
                    self._discard(pending, f"receive failed at prepare ({reason})", "failed")
                    raise _collective_failed(pending, reason)
                pending.receive_s = time.perf_counter() - started
            missing = self._missing(pending)
            if missing:
                raise SyncValidationError(
                    f"sync {sync_id} is missing buckets {missing[:10]} of {len(pending.manifest.buckets)};"
                    " send them before the commit",
                    type="missing_bucket",
                    detail={"missing": missing[:100]},
                )
            return SyncPrepareResponse(
                sync_id=sync_id,
                received=len(pending.manifest.buckets),
                receive_s=time.perf_counter() - started,
            )

    def _missing(self, pending: _Pending) -> list[int]:
        """Manifest buckets not received yet (none for a collective sync: its receive brings them all)."""
        if pending.collective is not None:
            return []
        return [i for i in range(len(pending.manifest.buckets)) if i not in pending.buckets]

    async def commit(self, sync_id: str, engine: Engine) -> SyncCommitResponse:
        """Applies a complete sync through `engine.apply_update`; any failure discards it."""
        async with self._lock:
            pending = self._get(sync_id)
            manifest = pending.manifest
            # Whatever happens below, this sync is finished: applied, or rejected and discarded.
            self._pending = None
            if pending.receiving is not None:
                await self._await_receive(pending)
            missing = self._missing(pending)
            if missing:
                self._finish(pending, outcome="rejected")
                logger.warning("sync %s discarded at commit: buckets %s missing", sync_id, missing)
                raise SyncValidationError(
                    f"sync {sync_id} is missing buckets {missing[:10]} of {len(manifest.buckets)}; nothing"
                    " applied, begin again and send every bucket",
                    type="missing_bucket",
                    detail={"missing": missing[:100]},
                )
            if manifest.version <= engine.weight_version:
                self._finish(pending, outcome="rejected")
                raise StaleVersionError(
                    f"sync version {manifest.version} <= current weight_version {engine.weight_version}"
                    " (another sync committed first); nothing applied"
                )
            started = time.perf_counter()
            applied = False
            stages: dict[str, float] = {}
            try:
                update = (
                    ReceivedUpdate(version=manifest.version, names=tuple(t.name for t in manifest.tensors))
                    if pending.collective is not None
                    else await asyncio.to_thread(_staged_update, manifest, pending.buckets)
                )
                self.applying = True
                try:
                    await engine.apply_update(update)
                finally:
                    self.applying = False
                applied = True
                stages = {"receive_s": pending.receive_s, "apply_s": time.perf_counter() - started}
                stages.update(getattr(engine, "last_update_stages", None) or {})
                stages.update(_staging_stages(pending, stages))
            except RolloutServerError:
                raise
            except Exception as exc:
                logger.exception("sync %s: engine failed to apply version %d", sync_id, manifest.version)
                raise EngineError(
                    f"engine failed to apply sync version {manifest.version} ({type(exc).__name__});"
                    " the previous weights are still served"
                ) from exc
            finally:
                # Applied: the workers have loaded and dropped their mappings, so pool files may be reused.
                self._finish(
                    pending, outcome="committed" if applied else "failed", stages=stages if applied else None
                )
            apply_s = time.perf_counter() - started
            logger.info(
                "sync %s committed: version %d (%s) in %.2f s",
                sync_id,
                manifest.version,
                manifest.mode,
                apply_s,
            )
            stages["apply_s"] = apply_s
            return SyncCommitResponse(
                sync_id=sync_id,
                mode=manifest.mode,
                weight_version=engine.weight_version,
                num_tensors=len(manifest.tensors),
                nbytes=manifest.nbytes,
                apply_s=apply_s,
                stages=stages,
            )

    async def _await_receive(self, pending: _Pending) -> None:
        """Waits (bounded by the group's timeout) for the engine to have received every broadcast."""
        assert pending.receiving is not None and pending.collective is not None
        started = time.perf_counter()
        try:
            await self._collective[pending.collective.backend].finish(pending.receiving, pending.collective)
        except Exception as exc:
            self._finish(pending, outcome="failed")
            reason = (
                f"not every broadcast arrived within {pending.collective.timeout_s:.0f} s"
                if isinstance(exc, TimeoutError)
                else str(exc)
            )
            raise _collective_failed(pending, reason) from exc
        if not pending.receive_s:  # already measured by the prepare, which waited for it
            pending.receive_s = time.perf_counter() - started

    async def abort(self, sync_id: str) -> SyncAbortResponse:
        """Discards the staged sync `sync_id`; aborting an unknown id is not an error."""
        async with self._lock:
            pending = self._pending
            if pending is not None and secrets.compare_digest(pending.sync_id, sync_id):
                self._discard(pending, "aborted by the client", "aborted")
                return SyncAbortResponse(sync_id=sync_id, aborted=True)
            return SyncAbortResponse(sync_id=sync_id, aborted=False)


def _collective_failed(pending: _Pending, reason: str) -> SyncValidationError:
    assert pending.collective is not None
    return SyncValidationError(
        f"sync {pending.sync_id}: receiving over the {pending.collective.backend} group failed ({reason});"
        " nothing applied, begin again",
        type="collective_failed",
    )


def _staging_stages(pending: _Pending, stages: dict[str, float]) -> dict[str, float]:
    """Where the sync's bytes waited for the commit, in bytes: the engine's own figures when it reports them
    (the HF engine), else HTTP/shm: the bucket files (host tmpfs), collective: the configured place."""
    if "staging_device_bytes" in stages or "staging_host_bytes" in stages:
        return {}
    nbytes = float(pending.manifest.nbytes)
    if pending.collective is not None and pending.collective.staging == "device":
        return {"staging_device_bytes": nbytes, "staging_host_bytes": 0.0}
    if pending.collective is not None and pending.collective.staging == "auto":
        return {"staging_auto_bytes": nbytes}
    return {"staging_device_bytes": 0.0, "staging_host_bytes": nbytes}


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
