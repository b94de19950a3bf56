"""`shm`: each bucket is written once into the servers' shared staging directory; the servers adopt it."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from learner.rollout.sync_stream import BucketParts, ShmStager, is_loopback_url
from learner.rollout.transports.base import PartsTransport, TransportOptions, register
from shared_schemas.sync import BucketSpec, SyncManifest

if TYPE_CHECKING:
    from learner.rollout.base import WeightUpdate
    from learner.rollout.client import SyncSession

__all__ = ["ShmTransport"]


@register("shm")
class ShmTransport(PartsTransport):
    """Bucket files in `rollout.sync.shm_dir` (= the servers' `server.shm_dir`); every server on this host.

    Bucket k's file is rewritten in place by the next sync once no server holds it, and after a committed
    sync the learner's CPU parameters move into the files when `share_parameters` (`ShmStager.share`).

    Raises:
        ValueError: no `shm_dir`, or a server that is not on a loopback address.
    """

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        if options.shm_dir is None:
            raise ValueError(
                "rollout.sync.transport 'shm' needs rollout.sync.shm_dir, the servers' server.shm_dir"
                " (/health does not expose it)"
            )
        remote = [url for url in options.urls if not is_loopback_url(url)]
        if remote:
            raise ValueError(
                f"rollout.sync.transport 'shm' needs every server on this host, but {remote[0]} is not a"
                " loopback address; use transport 'http'"
            )
        self.stager = ShmStager(options.shm_dir)
        self._reused_before = 0
        self._shared_before = 0

    def joined(self, sessions: Sequence[SyncSession]) -> None:
        self._reused_before = self.stager.reused_bytes
        self._shared_before = self.stager.shared_bytes

    def sent_stages(self) -> dict[str, float]:
        """`shm_reused_bytes`: bytes this sync wrote into files an earlier sync left (no new tmpfs pages);
        `shm_shared_bytes`: tensor bytes not written at all (the learner's parameters live in the files)."""
        return {
            "shm_reused_bytes": float(self.stager.reused_bytes - self._reused_before),
            "shm_shared_bytes": float(self.stager.shared_bytes - self._shared_before),
        }

    def committed(self, update: WeightUpdate) -> None:
        if update.parameters:
            self.stager.share(update.parameters)

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        with self.stager.staged(manifest.version, bucket.index, parts) as file_name:
            list(self.options.pool.map(lambda s: s.upload_shm(bucket.index, file_name), sessions))

    def failed(self, urls: Sequence[str]) -> None:
        # A server may still hold (and read) a file: the learner's parameters leave the files, and the next
        # sync writes new ones.
        self.stager.discard()

    def close(self) -> None:
        self.stager.close()
