"""`ServerRolloutSource`: the learner's rollouts from one or more rollout servers.

See docs/ALGORITHM.md#chunking-and-retries and docs/ARCHITECTURE.md#determinism.

`ServerRolloutSource` is the `RolloutSource` over one or more servers: deterministic chunking, concurrent
calls, the retry policy, reassembly by index; its weight syncs go to every server through
`learner.weights.server_sync.ServerSync`. It talks to each server through `RolloutClient`
(`learner.rollout.client`, one method per route); both, and the typed errors of `learner.rollout.errors`, are
importable from here.

Example:
    >>> with ServerRolloutSource(["http://127.0.0.1:8000"], timeout_s=240) as source:  # doctest: +SKIP
    ...     source.wait_healthy()
    ...     results = source.infer(batch)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import httpx

from learner.rollout.base import ResultMismatchError, check_results, staleness
from learner.rollout.client import LAUNCH_HINT, RolloutClient, normalize_base_url
from learner.rollout.errors import (
    InferFailed,
    RolloutClientError,
    ServerConflict,
    ServerError,
    ServerNotReady,
    ServerUnreachable,
    format_indices,
)
from learner.weights.server_sync import ServerSync
from learner.weights.types import SyncError, SyncRejected, SyncReport, WeightUpdate
from learner.yaml_loader import ConfigError
from shared_schemas.chunking import plan_chunks
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferResult
from shared_schemas.sync import TransportName

if TYPE_CHECKING:
    from learner.config import RolloutConfig

logger = logging.getLogger(__name__)

__all__ = [
    "LAUNCH_HINT",
    "InferFailed",
    "InferStats",
    "RolloutClient",
    "RolloutClientError",
    "ServerConflict",
    "ServerError",
    "ServerNotReady",
    "ServerRolloutSource",
    "ServerUnreachable",
    "SyncError",
    "SyncRejected",
    "learner_gpu_uuids",
    "refuse_shared_gpu",
    "normalize_base_url",
]


@dataclass
class InferStats:
    """What the last `ServerRolloutSource.infer` took.

    Attributes:
        calls: HTTP `/infer/` calls made (first tries, retries and split halves).
        retries: calls repeated on a fresh connection.
        splits: chunks split in half after failing twice.
        staleness: per result, learner weight version − the version that produced it (0 = on-policy).
        seconds: wall time of the whole call.
    """

    calls: int = 0
    retries: int = 0
    splits: int = 0
    staleness: list[int] = field(default_factory=list)
    seconds: float = 0.0


class ServerRolloutSource:
    """`RolloutSource` over one or more rollout servers (docs/ALGORITHM.md#chunking-and-retries).

    `infer` splits a batch with `plan_chunks` (contiguous ranges of `ceil(N/S)`, empty parts skipped,
    N == 0 → no call), runs the chunks concurrently (one worker thread per server) and reassembles by
    index, checked against request ids. Retry policy, per chunk and declared only here:

    - 4xx caller errors (bad request, prompt too long, 409, 401, ...) raise at once, never retried;
    - any other failure is retried ONCE on a fresh connection (per-request seeds make it reproduce the
      same tokens);
    - a second failure splits the chunk in half and treats each half the same way, recursively; a single
      request failing twice raises `InferFailed` naming the server URL and the global index;
    - except when the server is down (connection refused) or not ready (503): no request is at fault,
      so splitting cannot help and `InferFailed` is raised after the retry.

    Every call is bounded by the client timeouts, so a failure is raised, never a hang, never a drop.
    `sync_weights` sends every bucket to EVERY server through one weight-sync transport (`http`, `shm`,
    `gloo`, `nccl`): the multi-server protocol is `learner.weights.server_sync.ServerSync` (`weight_sync`).

    Args:
        servers: server base URLs, one per server process (a DP server is one entry).
        timeout_s: connect timeout cap and health deadline (`rollout.timeout_s`).
        infer_timeout_s: read timeout of one call (`rollout.infer_timeout_s`, default `timeout_s`).
        auth_token: bearer token (`rollout.auth_token`).
        transport: `http`, `shm`, `gloo` or `nccl` (`rollout.sync.transport`).
        shm_dir: staging directory for `shm` (`rollout.sync.shm_dir`, = the servers' `server.shm_dir`).
        bucket_mb: bucket size bound in MiB (`rollout.sync.bucket_mb`).
        collective_address: `gloo`/`nccl`: this host's address as the servers reach it
            (`rollout.sync.collective_address`); None = `127.0.0.1`, allowed only when every server is local.
        collective_timeout_s: `gloo`/`nccl`: limit of each group rendezvous and each broadcast
            (`rollout.sync.collective_timeout_s`).
        transport_factory: httpx transport factory for tests (see `RolloutClient`).

    Raises:
        ValueError: no server, an unknown transport, `shm` without `shm_dir` or with a server on another
            host, or `gloo`/`nccl` with a server on another host and no `collective_address`.
    """

    def __init__(
        self,
        servers: Sequence[str],
        *,
        timeout_s: float = 240.0,
        infer_timeout_s: float | None = None,
        auth_token: str | None = None,
        transport: TransportName = "http",
        shm_dir: str | Path | None = None,
        bucket_mb: float = 512,
        collective_address: str | None = None,
        collective_timeout_s: float = 120.0,
        transport_factory: Callable[[], httpx.BaseTransport] | None = None,
    ) -> None:
        if not servers:
            raise ValueError("ServerRolloutSource needs at least one server base_url (rollout.servers)")
        if bucket_mb <= 0:
            raise ValueError(f"rollout.sync.bucket_mb must be > 0, got {bucket_mb}")
        urls = [normalize_base_url(url) for url in servers]
        self.transport = transport
        self._clients = [
            RolloutClient(
                url,
                timeout_s=timeout_s,
                infer_timeout_s=infer_timeout_s,
                auth_token=auth_token,
                transport_factory=transport_factory,
            )
            for url in urls
        ]
        self._pool = ThreadPoolExecutor(max_workers=len(self._clients), thread_name_prefix="rollout-server")
        try:
            self.weight_sync = ServerSync(
                self._clients,
                self._pool,
                transport=transport,
                bucket_bytes=int(bucket_mb * 2**20),
                shm_dir=shm_dir,
                collective_address=collective_address,
                collective_timeout_s=collective_timeout_s,
            )
            """Weight syncs to every server (`learner.weights.server_sync`), through `transport`."""
        except ValueError:
            self._pool.shutdown(wait=False)
            for client in self._clients:
                client.close()
            raise
        self.weight_version: int | None = None
        """Version of the last sync this source committed (None before the first)."""
        self.last_infer = InferStats()
        """Counters of the last `infer` call to FINISH (metrics: staleness, retries), replaced whole (never
        mutated). With overlapped rollouts (`rollout.async`) a background call and a foreground one can finish
        in either order: read the staleness of a batch from its results' `weight_version` instead."""

    @classmethod
    def from_config(cls, rollout: RolloutConfig) -> ServerRolloutSource:
        """The source for `rollout:` in server mode (servers, timeouts, token, `rollout.sync` transport)."""
        return cls(
            [entry.base_url for entry in rollout.servers],
            timeout_s=rollout.timeout_s,
            infer_timeout_s=rollout.read_timeout_s,
            auth_token=rollout.auth_token,
            transport=rollout.sync.transport,
            shm_dir=rollout.sync.shm_dir,
            bucket_mb=rollout.sync.bucket_mb,
            collective_address=rollout.sync.collective_address,
            collective_timeout_s=rollout.sync.collective_timeout_s,
        )

    @property
    def last_sync_stages(self) -> dict[str, float]:
        """Seconds per stage of the last sync (`ServerSync.last_stages`), for profiling."""
        return self.weight_sync.last_stages

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Server base URLs, in chunk order."""
        return tuple(c.base_url for c in self._clients)

    def close(self) -> None:
        """Closes every connection pool and the worker threads; idempotent."""
        self._pool.shutdown(wait=True)
        self.weight_sync.close()
        for client in self._clients:
            client.close()

    def __enter__(self) -> ServerRolloutSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- health ------------------------------------------------------------------------------------
    def health(self) -> Health:
        """Combined status: `ok` only when every server is; `lora_enabled` only when every server has
        LoRA; `weight_version` the highest (the next sync must exceed it everywhere); `dp` summed."""
        bodies = list(self._pool.map(RolloutClient.health, self._clients))
        first = bodies[0]
        worst = next((h for h in bodies if h.status != "ok"), first)
        return first.model_copy(
            update={
                "status": worst.status,
                "detail": worst.detail,
                "weight_version": max(h.weight_version for h in bodies),
                "lora_enabled": all(h.lora_enabled for h in bodies),
                "dp": sum(h.dp for h in bodies),
                "max_model_len": min(h.max_model_len for h in bodies),
                "uptime_s": min(h.uptime_s for h in bodies),
            }
        )

    def wait_healthy(self, deadline_s: float | None = None) -> Health:
        """Waits (concurrently, one overall deadline) until every server reports `ok`.

        With `transport: nccl`, also refuses a server on this learner's GPU (`refuse_shared_gpu`), so the run
        stops at start rather than at its first sync.

        Raises:
            ServerUnreachable / ServerNotReady: naming the first server that did not come up.
            ConfigError: `nccl` with a server on the learner's GPU.
        """
        list(self._pool.map(lambda c: c.wait_healthy(deadline_s), self._clients))
        if self.transport == "nccl":
            servers = list(self._pool.map(lambda c: (c.base_url, c.health().gpu_uuids), self._clients))
            refuse_shared_gpu(learner_gpu_uuids(), dict(servers))
        return self.health()

    # -- infer -------------------------------------------------------------------------------------
    def infer(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request over the servers; `results[i]` answers `batch.infer_requests[i]`.

        Raises:
            ServerError: a 4xx caller error (never retried).
            InferFailed: requests that still failed after the retry policy (names server and indices).
            ResultMismatchError: reassembly found a missing, duplicated or extra result.
        """
        started = time.perf_counter()
        stats = InferStats()
        n = len(batch.infer_requests)
        if n == 0:
            self.last_infer = stats
            return []
        chunks = [c for c in plan_chunks(n, len(self._clients)) if not c.empty]
        futures = [
            self._pool.submit(self._infer_chunk, self._clients[c.part], batch.slice(c.start, c.stop))
            for c in chunks
        ]
        # The first failed chunk fails the call at once: a dead server is reported when it is found, not
        # after the surviving servers finish their chunks (whose results the failed call could not use).
        done, _ = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            for future in futures:
                future.cancel()  # chunks not started yet; running ones finish in the pool and are dropped
            raise failed[0].exception()  # the failed chunk of the lowest server index among those done
        parts: list[InferResult] = []
        for future in futures:
            results, counts = future.result()
            parts.extend(results)
            stats.calls += counts.calls
            stats.retries += counts.retries
            stats.splits += counts.splits
        ordered = check_results(batch, parts)
        learner_version = self.weight_version
        if learner_version is None:
            learner_version = max(r.weight_version for r in ordered)
        stats.staleness = staleness(learner_version, ordered)
        stats.seconds = time.perf_counter() - started
        self.last_infer = stats
        return ordered

    def _infer_chunk(self, client: RolloutClient, sub: InferBatch) -> tuple[list[InferResult], InferStats]:
        counts = InferStats()
        return self._infer_with_retries(client, sub, counts), counts

    def _infer_with_retries(
        self, client: RolloutClient, sub: InferBatch, counts: InferStats
    ) -> list[InferResult]:
        n = len(sub.infer_requests)
        indices = range(sub.first_index, sub.first_index + n)
        error: Exception | None = None
        for attempt in range(2):
            if attempt:
                counts.retries += 1
                client.reconnect()
            counts.calls += 1
            try:
                return client.infer(sub)
            except ServerError as exc:
                if exc.is_caller_error:
                    raise
                error = exc
            except (ServerUnreachable, ResultMismatchError) as exc:
                error = exc
            logger.warning(
                "rollout server %s failed %s (attempt %d of 2): %s",
                client.base_url,
                format_indices(indices),
                attempt + 1,
                error,
            )
        server_down = isinstance(error, ServerNotReady) or (
            isinstance(error, ServerUnreachable) and error.connect_failed
        )
        if n == 1 or server_down:
            raise InferFailed(
                f"rollout server {client.base_url} failed request {format_indices(indices)} twice ({error});"
                " see that server's log",
                url=client.base_url,
                indices=indices,
            ) from error
        counts.splits += 1
        mid = n // 2
        left = self._infer_with_retries(client, sub.slice(0, mid), counts)
        return left + self._infer_with_retries(client, sub.slice(mid, n), counts)

    # -- weight sync -------------------------------------------------------------------------------
    def sync_weights(self, update: WeightUpdate) -> SyncReport:
        """Sends `update` to every server through `weight_sync` (`ServerSync.send`: begin on all → each
        bucket to all → commit on all; any failure aborts every server that has not committed, and no server
        commits before every server holds every bucket); never retried.

        Raises:
            SyncRejected: a server refused the update (409: adapter sync without LoRA, stale version).
            SyncError: anything else (names the server and the cause).
        """
        try:
            report = self.weight_sync.send(update)
        except SyncError:
            raise
        except (ServerError, ServerUnreachable) as exc:
            hint = ""
            if isinstance(exc, ServerError) and exc.type == "shm_file_not_found":
                hint = "; rollout.sync.shm_dir must equal the server's server.shm_dir"
            raise SyncError(
                f"weight sync v{update.version} ({update.mode}) to {exc.url} failed: {exc}{hint}"
            ) from exc
        self.weight_version = update.version
        return report


def learner_gpu_uuids() -> list[str]:
    """UUID of the GPU this learner process computes on (`[]` on CPU)."""
    import torch

    from shared_schemas.torch_common.gpu_ids import gpu_uuids

    return gpu_uuids([torch.cuda.current_device()] if torch.cuda.is_available() else None)


def refuse_shared_gpu(learner: Sequence[str], servers: dict[str, Sequence[str]]) -> None:
    """Refuses a `nccl` weight sync whose group would put the learner and a server on one GPU.

    Args:
        learner: the learner's GPU UUIDs (`learner_gpu_uuids`).
        servers: each server's base URL → the GPU UUIDs its `/health` reports (`Health.gpu_uuids`).

    Raises:
        ConfigError: a server computes on one of the learner's GPUs (names the server, the GPU, the reason and
            the fixes).
    """
    mine = set(learner)
    for url, gpus in servers.items():
        shared = sorted(mine.intersection(gpus))
        if shared:
            raise ConfigError(
                f"rollout.sync.transport: nccl with rollout server {url} on this learner's GPU {shared[0]}:"
                " NCCL cannot put two ranks on one GPU (the first sync would fail with 'Duplicate GPU"
                " detected'); set rollout.sync.transport: shm (or http) for a server on the learner's GPU, or"
                " start the server on another GPU (its CUDA_VISIBLE_DEVICES)"
            )
