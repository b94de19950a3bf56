"""Weight-sync staging: begin → buckets → [prepare] → commit (or abort / timeout), applied all or nothing.

One sync is staged at a time; a new `begin` supersedes (discards) a staged one, so a learner that died
mid-sync never blocks the next. Every phase runs under one lock, so a commit never races a bucket. Any
rejected bucket or commit discards the staged sync: nothing reaches the engine until every bucket has arrived
and matched the manifest, and the engine's `apply_update` is itself all or nothing. `prepare` answers once
every bucket is in (a collective sync: once its receive has finished), so that a learner with several servers
commits none of them before all hold the update.

How each transport's bytes come in (a body or an adopted file, staged as files whose headers are checked
against the manifest before the ack; or the engine's receive over the learner's group) is `weights.receivers`:
one receiver per `rollout.sync.transport` name behind five verbs (begin, receive, prepare, commit, abort),
mirroring `learner.weights.transports`. This module never asks which transport a sync uses; it asks the sync's
receiver, and hands a bucket route's receiver this staging (`receivers.StagingAccess`: the lock, the staged
sync, its discard).
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

from rollout_server.engines.base import Engine
from rollout_server.errors import (
    EngineError,
    RolloutServerError,
    StaleVersionError,
    SyncValidationError,
    UnknownSyncError,
)
from rollout_server.weights.receivers import STAGED_DIR_PREFIX, Receivers, StagedSync
from rollout_server.weights.validate import check_manifest
from shared_schemas.sync import (
    BucketAck,
    SyncAbortResponse,
    SyncBeginRequest,
    SyncBeginResponse,
    SyncCommitResponse,
    SyncPrepareResponse,
)

logger = logging.getLogger(__name__)

__all__ = ["STAGED_DIR_PREFIX", "SyncStaging"]


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
        self._receivers = Receivers(shm_dir, collective_staging)
        self._default_timeout_s = default_timeout_s
        self._clock = clock
        self._pending: StagedSync | None = None
        self._lock = asyncio.Lock()
        self.applying = False
        """True while a commit applies an update to the engine (the probe listener's readiness)."""

    @property
    def _pool(self) -> Path | None:
        """Directory of the pooled HTTP body files (None until the first body)."""
        return self._receivers.files.pool

    def _finish(self, pending: StagedSync, *, outcome: str, stages: dict[str, float] | None = None) -> None:
        """Ends a sync: reports its `outcome` (`committed`, `rejected`, `aborted`, `expired`, `superseded`,
        `failed`, `closed`) and has its receiver release what it holds (`Receiver.abort`: its files, after a
        commit kept for the next sync's bodies; a collective receive still running runs out)."""
        if self._on_finish is not None and outcome != "closed":
            extra = {"stages": stages} if stages is not None else {}
            self._on_finish(
                mode=pending.manifest.mode,
                transport=pending.transfer.transport,
                outcome=outcome,
                nbytes=pending.manifest.nbytes,
                seconds=self._clock() - pending.began,
                **extra,
            )
        pending.receiver.abort(pending, outcome)

    def close(self) -> None:
        """Drops the staged sync and every staging file (server shutdown)."""
        if self._pending is not None:
            self._finish(self._pending, outcome="closed")
            self._pending = None
        self._receivers.close()

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

    @property
    def lock(self) -> asyncio.Lock:
        """The one lock every phase holds while it looks at the staged sync (`receivers.StagingAccess`)."""
        return self._lock

    def staged(self, sync_id: str) -> StagedSync:
        """The staged sync `sync_id`, its idle deadline renewed; call under `lock`.

        Raises:
            UnknownSyncError: no such sync staged.
        """
        self.sweep()
        pending = self._pending
        if pending is None or not secrets.compare_digest(pending.sync_id, sync_id):
            raise UnknownSyncError(
                f"no staged sync {sync_id!r} (never begun, superseded, committed, aborted or timed out);"
                " start again with begin"
            )
        pending.deadline = self._clock() + pending.timeout_s
        return pending

    def discard(self, pending: StagedSync, reason: str, outcome: str) -> None:
        """Drops `pending` if it is still the staged sync (its receiver releases it); call under `lock`."""
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
            receiver = self._receivers.for_begin(request)
            transfer = receiver.begin(request, engine)  # checks, then starts receiving
            if self._pending is not None:
                self.discard(self._pending, "superseded by a new begin", "superseded")
            timeout_s = request.timeout_s or self._default_timeout_s
            pending = StagedSync(
                sync_id=secrets.token_hex(16),
                manifest=manifest,
                timeout_s=timeout_s,
                deadline=self._clock() + timeout_s,
                began=self._clock(),
                receiver=receiver,
                transfer=transfer,
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
                collective_ranks=transfer.collective_ranks,
                collective_joining=transfer.collective_joining,
            )

    async def receive(self, sync_id: str, index: int, payload: Any, via: str) -> BucketAck:
        """Stages bucket `index` of sync `sync_id` that came in through the bucket route of receiver `via`
        (`payload`: what that route carries), checked against the manifest before the ack
        (`Receiver.receive`, under this staging's lock)."""
        return await self._receivers[via].receive(self, sync_id, index, payload)

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
            pending = self.staged(sync_id)
        failure: SyncValidationError | None = None
        try:
            await pending.receiver.prepare(pending)
        except SyncValidationError as exc:
            failure = exc
        async with self._lock:
            self.staged(sync_id)  # 404 when it was aborted, superseded or timed out meanwhile
            if failure is not None:
                self.discard(pending, f"receive failed at prepare ({failure.message})", "failed")
                raise failure
            missing = pending.transfer.missing(pending.manifest)
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

    async def commit(self, sync_id: str, engine: Engine) -> SyncCommitResponse:
        """Applies a complete sync through `engine.apply_update`; any failure discards it."""
        async with self._lock:
            pending = self.staged(sync_id)
            manifest = pending.manifest
            receiver = pending.receiver
            # Whatever happens below, this sync is finished: applied, or rejected and discarded.
            self._pending = None
            missing = pending.transfer.missing(manifest)
            if missing:
                self._finish(pending, outcome="rejected")
                logger.warning("sync %s discarded at commit: buckets %s missing", sync_id, missing)
                raise SyncValidationError(
                    f"sync {sync_id} is missing buckets {missing[:10]} of {len(manifest.buckets)}; nothing"
                    " applied, begin again and send every bucket",
                    type="missing_bucket",
                    detail={"missing": missing[:100]},
                )
            applied = False
            outcome = "failed"
            stages: dict[str, float] = {}
            try:
                update = await receiver.commit(pending)  # every byte in, or SyncValidationError
                if manifest.version <= engine.weight_version:
                    outcome = "rejected"
                    raise StaleVersionError(
                        f"sync version {manifest.version} <= current weight_version {engine.weight_version}"
                        " (another sync committed first); nothing applied"
                    )
                started = time.perf_counter()
                self.applying = True
                try:
                    await engine.apply_update(update)
                finally:
                    self.applying = False
                applied = True
                stages = {"receive_s": pending.receive_s, "apply_s": time.perf_counter() - started}
                stages.update(getattr(engine, "last_update_stages", None) or {})
                if "staging_device_bytes" not in stages and "staging_host_bytes" not in stages:
                    # The engine did not say (HF does): where the receiver kept the bytes.
                    stages.update(pending.transfer.staging_stages(manifest))
            except RolloutServerError:
                raise
            except Exception as exc:
                logger.exception("sync %s: engine failed to apply version %d", sync_id, manifest.version)
                raise EngineError(
                    f"engine failed to apply sync version {manifest.version} ({type(exc).__name__});"
                    " the previous weights are still served"
                ) from exc
            finally:
                self._finish(
                    pending, outcome="committed" if applied else outcome, stages=stages if applied else None
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

    async def abort(self, sync_id: str) -> SyncAbortResponse:
        """Discards the staged sync `sync_id`; aborting an unknown id is not an error."""
        async with self._lock:
            pending = self._pending
            if pending is not None and secrets.compare_digest(pending.sync_id, sync_id):
                self.discard(pending, "aborted by the client", "aborted")
                return SyncAbortResponse(sync_id=sync_id, aborted=True)
            return SyncAbortResponse(sync_id=sync_id, aborted=False)
