"""The learner's weight sync to one or more rollout servers: begin on every server → every bucket to every
server through one transport → [prepare] → commit on every server; any failure aborts every server that has
not committed (docs/ARCHITECTURE.md#weight-sync).

`ServerSync` drives the HTTP control of that protocol for every transport alike and leaves the bytes to the
configured transport (`learner.weights.transports`); it talks to each server through a `SyncClient`
(`learner.weights.session`). `learner.rollout.server_source.ServerRolloutSource.sync_weights` delegates to it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TypeVar

from learner.weights.session import SyncClient, SyncSession
from learner.weights.transports import Transport, TransportOptions, build_transport
from learner.weights.types import SyncError, SyncReport, WeightUpdate
from shared_schemas.buckets import plan_buckets
from shared_schemas.sync import CollectiveSpec, SyncManifest, TransportName

_T = TypeVar("_T")
_R = TypeVar("_R")

__all__ = ["ServerSync"]


class ServerSync:
    """Weight syncs to every server of a `ServerRolloutSource`, through one weight-sync transport.

    Every bucket goes to EVERY server: `http` (bucket bodies), `shm` (files in the shared staging directory,
    all servers on this host), `gloo` (one broadcast per bucket over ONE process group that spans the learner
    and every server, packed on the host: the learner's link carries one copy whatever the number of
    servers) or `nccl` (the same over NCCL, packed on the learner's GPU, never through host memory). HTTP
    always carries the control (begin, prepare, commit, abort); with a collective transport, adapter syncs go
    over `http`.

    Args:
        clients: one client per server, in order.
        pool: worker threads (one per server) for the per-server calls.
        transport: `http`, `shm`, `gloo` or `nccl` (`rollout.sync.transport`).
        bucket_bytes: bucket size bound in bytes (`rollout.sync.bucket_mb`).
        shm_dir: staging directory for `shm` (`rollout.sync.shm_dir`).
        collective_address: `gloo`/`nccl`: this host's address as the servers reach it.
        collective_timeout_s: `gloo`/`nccl`: limit of each group rendezvous and each broadcast.

    Raises:
        ValueError: an unknown transport, or options it cannot work with (see `build_transport`).
    """

    def __init__(
        self,
        clients: Sequence[SyncClient],
        pool: ThreadPoolExecutor,
        *,
        transport: TransportName,
        bucket_bytes: int,
        shm_dir: str | Path | None = None,
        collective_address: str | None = None,
        collective_timeout_s: float = 120.0,
    ) -> None:
        self._clients = list(clients)
        self._pool = pool
        self._bucket_bytes = bucket_bytes
        self._errors = tuple({error for client in self._clients for error in client.errors})
        options = TransportOptions(
            urls=tuple(client.base_url for client in self._clients),
            pool=pool,
            shm_dir=shm_dir,
            collective_address=collective_address,
            collective_timeout_s=collective_timeout_s,
        )
        self.transport: Transport = build_transport(transport, options)
        """The configured transport."""
        self.http: Transport = self.transport if transport == "http" else build_transport("http", options)
        """What carries the syncs the configured transport cannot (adapters, when it is `full_only`)."""
        self.last_stages: dict[str, float] = {}
        """Seconds per stage of the last sync: learner side (`begin_s`, `produce_s` = export + encode,
        `upload_s`, `commit_s`, and the transport's own figures, e.g. nccl's `wire_wait_s`) and the first
        server's own split (`server_*`, with its `server_staging_*_bytes`), for profiling."""

    def close(self) -> None:
        """Releases the transports' threads, groups and files."""
        self.transport.close()
        if self.http is not self.transport:
            self.http.close()

    def _on_every(
        self, items: Sequence[_T], fn: Callable[[_T], _R]
    ) -> list[tuple[_R | None, BaseException | None]]:
        """`fn` on every item at once (the per-server threads); each outcome as (result, None) or (None,
        error), in order, once all have returned."""

        def settled(item: _T) -> tuple[_R | None, BaseException | None]:
            try:
                return fn(item), None
            except BaseException as exc:  # handed back: the caller decides which error wins
                return None, exc

        return list(self._pool.map(settled, items))

    def _begin_everywhere(
        self, manifest: SyncManifest, specs: Sequence[CollectiveSpec | None]
    ) -> list[SyncSession]:
        """Begins the sync on every server at once (one round trip, not one per server). If any begin fails,
        the others are aborted and its error is raised."""
        outcomes = self._on_every(
            list(zip(self._clients, specs, strict=True)),
            lambda pair: SyncSession(pair[0], pair[0].sync_begin(manifest, collective=pair[1]), manifest),
        )
        sessions = [session for session, _ in outcomes if session is not None]
        errors = [exc for _, exc in outcomes if exc is not None]
        if errors:
            self._abort_everywhere(sessions)
            raise errors[0]
        return sessions

    def _abort_everywhere(self, sessions: Sequence[SyncSession]) -> None:
        """Aborts the sync on every server at once; an abort that fails is logged (the server also drops an
        idle sync after its timeout)."""
        self._on_every(sessions, lambda s: s.client.abort_quietly(s.sync_id))

    def _commit_everywhere(self, sessions: Sequence[SyncSession]) -> None:
        """Commits on every server at once; raises the first failure once every commit has returned (the
        others committed: the servers then disagree until the next sync, which carries a higher version)."""

        def commit(session: SyncSession) -> None:
            session.committed = session.client.sync_commit(session.sync_id)

        errors = [exc for _, exc in self._on_every(sessions, commit) if exc is not None]
        if errors:
            raise errors[0]

    def send(self, update: WeightUpdate) -> SyncReport:
        """Sends `update` to every server (begin on all → each bucket to all → commit on all).

        Any failure aborts the sync on every server that has not committed yet; sync phases are never retried.
        No server commits before every server holds every bucket (HTTP/shm: every upload acknowledged;
        gloo/nccl: every server answered `prepare` once its receive finished, so a server that dies
        mid-broadcast leaves every server on its old weights). Begins and commits go to every server at once
        (one round trip each, whatever the number of servers); when a commit itself fails while another
        succeeded the servers disagree until the next sync (which uses a higher version and fixes it). After a
        `SyncError` or a client error (`SyncClient.errors`) the transport forgets its per-server state.

        Raises:
            SyncError: the update holds no tensors, or the transport failed (names the server).
            The clients' `errors`: a server call failed (a refusal, 409, is also a `SyncRejected`).
        """
        started = time.perf_counter()
        specs = update.tensor_specs()
        if not specs:
            raise SyncError(f"weight update v{update.version} ({update.mode}) holds no tensors")
        manifest = SyncManifest(
            mode=update.mode,
            version=update.version,
            buckets=tuple(plan_buckets(specs, self._bucket_bytes)),
            adapter_name=update.adapter_name,
            adapter_config=update.adapter_config,
        )
        stages = {"begin_s": 0.0, "produce_s": 0.0, "upload_s": 0.0, "commit_s": 0.0}
        # Adapters are small and only the file transports stage them: collective transports send them
        # over HTTP.
        transport = self.http if update.mode != "full" and self.transport.full_only else self.transport
        urls = [c.base_url for c in self._clients]
        try:
            collective = transport.rendezvous(self._clients)
            sessions = self._begin_everywhere(manifest, collective)
            try:
                transport.joined(sessions)
                stages["begin_s"] = time.perf_counter() - started
                transport.send(sessions, manifest, update.iter_tensors(), stages)
            except BaseException:
                self._abort_everywhere(sessions)
                raise
            mark = time.perf_counter()
            self._commit_everywhere(sessions)
        except (SyncError, *self._errors):
            transport.failed(urls)
            raise
        stages["commit_s"] = time.perf_counter() - mark
        transport.committed(update)
        committed = sessions[0].committed
        self.last_stages = stages | {
            f"server_{k}": v for k, v in (committed.stages if committed else {}).items()
        }
        return SyncReport(
            mode=update.mode,
            version=update.version,
            bytes=manifest.nbytes,
            seconds=time.perf_counter() - started,
            transport=transport.name,  # type: ignore[arg-type]
            endpoints=tuple(urls),
        )
