"""One weight sync on one rollout server (`SyncSession`), and the calls a sync makes on that server
(`SyncClient`) (docs/ARCHITECTURE.md#weight-sync).

`SyncClient` is the server's HTTP client as the weight sync sees it: one method per `/sync_weights/` phase
plus `/health`. `learner.rollout.client.RolloutClient` is the implementation; the weight-sync code only
names this protocol, so `learner.weights` never imports `learner.rollout`.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

from shared_schemas.health import Health
from shared_schemas.sync import (
    BucketAck,
    CollectiveSpec,
    SyncBeginResponse,
    SyncCommitResponse,
    SyncManifest,
    SyncPrepareResponse,
)

__all__ = ["SyncClient", "SyncSession"]


class SyncClient(Protocol):
    """The calls a weight sync makes on one rollout server; none is retried."""

    errors: ClassVar[tuple[type[Exception], ...]]
    """What a call raises when the server answers an error or does not answer (each carries `url`)."""
    base_url: str
    """`http(s)://host:port` of the server."""

    def health(self) -> Health:
        """`GET /health` (also answered while the server loads)."""
        ...

    def sync_begin(
        self,
        manifest: SyncManifest,
        *,
        timeout_s: float | None = None,
        collective: CollectiveSpec | None = None,
    ) -> SyncBeginResponse:
        """Opens a sync of `manifest` (with `collective`: its receivers join that group)."""
        ...

    def upload_bucket(self, sync_id: str, index: int, data: bytes | Sequence[memoryview]) -> BucketAck:
        """Sends bucket `index` as the HTTP body (one blob, or its parts in order)."""
        ...

    def upload_bucket_shm(self, sync_id: str, index: int, file_name: str) -> BucketAck:
        """Names bucket `index`, already written into the server's staging directory."""
        ...

    def sync_prepare(self, sync_id: str, *, timeout_s: float | None = None) -> SyncPrepareResponse:
        """Returns once the server holds every bucket of the sync."""
        ...

    def sync_commit(self, sync_id: str) -> SyncCommitResponse:
        """Applies the staged sync atomically."""
        ...

    def abort_quietly(self, sync_id: str) -> None:
        """Discards the staged sync, logging instead of raising when the server does not answer."""
        ...


@dataclass
class SyncSession:
    """One open weight sync on one server (yielded by `RolloutClient.weight_sync`).

    Attributes:
        client: the server's client.
        begin: the server's answer to `begin` (sync id, current version).
        manifest: what will be sent.
        committed: the commit answer, set once the server committed.
    """

    client: SyncClient
    begin: SyncBeginResponse
    manifest: SyncManifest
    committed: SyncCommitResponse | None = None

    @property
    def sync_id(self) -> str:
        """The id every phase names."""
        return self.begin.sync_id

    def upload(self, index: int, data: bytes | Sequence[memoryview]) -> BucketAck:
        """Sends bucket `index` as the HTTP body (one blob, or its parts in order)."""
        return self.client.upload_bucket(self.sync_id, index, data)

    def upload_shm(self, index: int, file_name: str) -> BucketAck:
        """Names bucket `index`, already written into the server's staging directory."""
        return self.client.upload_bucket_shm(self.sync_id, index, file_name)
