"""The one interface of the weight-sync transports (`rollout.sync.transport`), and their registry.

A transport moves a full or adapter sync's buckets from the learner to every server between the sync's
`begin` and its `commit`, which `learner.weights.server_sync.ServerSync` drives over HTTP for every transport
alike. It answers five questions, one method each (the shape of vLLM's `distributed/weight_transfer` engines,
sender side: init info, then send):

- `rendezvous(clients)`: what each server's `begin` must carry (its part of the collective group; None
  otherwise);
- `joined(sessions)`: what to do once every server has answered its `begin` (form the group);
- `send(sessions, manifest, items, stages)`: move every bucket, in manifest order (a collective transport also
  waits until every server holds every bucket, so that no server commits unless all can);
- `committed(update)`: what to do once every server has committed (`shm`: share the learner's parameters);
- `failed(urls)` / `close()`: forget per-server state after a failure, release everything at the end.

Implementations register under their configuration name (`register`); `build_transport(name, ...)` makes one.
`http` (`transports.http`), `shm` (`transports.shm`), `gloo` and `nccl` (`transports.gloo_nccl`) are
registered when this package is imported. The server side mirrors the names
(`rollout_server.weights.receivers`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, ClassVar

import torch

from learner.weights.sync_stream import BucketParts, bucket_payloads, prefetched
from shared_schemas.registry import registrar
from shared_schemas.sync import TRANSPORT_NAMES, BucketSpec, CollectiveSpec, SyncManifest

if TYPE_CHECKING:
    from learner.weights.session import SyncClient, SyncSession
    from learner.weights.types import WeightUpdate

__all__ = ["TRANSPORTS", "Sessions", "Stages", "Transport", "TransportOptions", "build_transport", "register"]

TensorItems = Iterator[tuple[str, torch.Tensor]]
Sessions = Sequence["SyncSession"]
"""The sync's sessions, one per server, in order."""
Stages = dict[str, float]
"""Seconds (and bytes) of a sync's stages, by name (`SyncReport` timings)."""


@dataclass(frozen=True)
class TransportOptions:
    """What a transport may need, from `rollout.sync` and the source (each takes what it uses).

    Attributes:
        urls: the servers' base URLs, in order.
        pool: the source's worker threads (one per server), for concurrent per-server calls.
        shm_dir: `shm`: the servers' staging directory.
        collective_address: `gloo`/`nccl`: this host's address as the servers reach it.
        collective_timeout_s: `gloo`/`nccl`: limit of each rendezvous and broadcast.
    """

    urls: tuple[str, ...]
    pool: ThreadPoolExecutor
    shm_dir: str | Path | None = None
    collective_address: str | None = None
    collective_timeout_s: float = 120.0


class Transport:
    """One weight-sync transport (see the module docstring). Subclasses set `name` and implement `send`."""

    name: ClassVar[str] = ""
    full_only: ClassVar[bool] = False
    """True when adapter syncs cannot use it (they then go over `http`)."""

    def __init__(self, options: TransportOptions) -> None:
        self.options = options

    def rendezvous(self, clients: Sequence[SyncClient]) -> list[CollectiveSpec | None]:
        """The collective group each server's begin carries, in `clients` order (None: buckets come over
        HTTP/shm).

        Raises:
            SyncError / ServerUnreachable / ServerError: the group could not be planned (names the server).
        """
        return [None] * len(clients)

    def joined(self, sessions: Sequence[SyncSession]) -> None:
        """Called once every server has answered its begin."""

    def send(self, sessions: Sessions, manifest: SyncManifest, items: TensorItems, stages: Stages) -> None:
        """Moves every bucket of `manifest` (tensors from `items`, in manifest order) to every session.

        Adds its seconds to `stages["produce_s"]` (waiting for the export) and `stages["upload_s"]`.

        Raises:
            SyncError: a bucket could not be delivered (names the server); `ServerError`/`ServerUnreachable`
                from the HTTP calls pass through.
        """
        raise NotImplementedError

    def committed(self, update: WeightUpdate) -> None:
        """Called once every server has committed `update` (its tensors are no longer read by any server)."""

    def failed(self, urls: Sequence[str]) -> None:
        """Forgets whatever state the servers may now be out of step with (the next sync starts afresh)."""

    def close(self) -> None:
        """Releases threads, groups, files."""


class PartsTransport(Transport):
    """A transport that sends each bucket as safetensors parts (header + tensor bytes on the host), built one
    bucket ahead on a helper thread (`sync_stream.prefetched`); subclasses implement `send_bucket`."""

    def send(self, sessions: Sessions, manifest: SyncManifest, items: TensorItems, stages: Stages) -> None:
        mark = time.perf_counter()
        payloads = prefetched(bucket_payloads(manifest.buckets, items))
        try:
            for bucket, parts in payloads:
                now = time.perf_counter()
                stages["produce_s"] += now - mark  # waiting for the export, net of the overlap
                self.send_bucket(sessions, manifest, bucket, parts)
                mark = time.perf_counter()
                stages["upload_s"] += mark - now
        finally:
            payloads.close()
        stages.update(self.sent_stages())

    def sent_stages(self) -> dict[str, float]:
        """The transport's own figures of the sync just sent, added to its stages (none by default)."""
        return {}

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        raise NotImplementedError


TRANSPORTS: dict[str, type[Transport]] = {}
"""Transport classes by `rollout.sync.transport` name."""


register = registrar(TRANSPORTS, "weight-sync transport", TRANSPORT_NAMES)
"""Class decorator: `@register(name)` adds a class to `TRANSPORTS` under `name` (once)."""


def build_transport(name: str, options: TransportOptions) -> Transport:
    """The transport registered as `name`, checked against `options` (e.g. `shm` needs local servers).

    Raises:
        ValueError: an unknown name, or options the transport cannot work with (names the knob).
    """
    try:
        cls = TRANSPORTS[name]
    except KeyError:
        known = ", ".join(repr(n) for n in sorted(TRANSPORTS))
        raise ValueError(f"rollout.sync.transport must be one of {known}, got {name!r}") from None
    return cls(options)
