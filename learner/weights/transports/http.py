"""`http`: each bucket is the body of `PUT /sync_weights/{id}/buckets/{k}`, streamed from tensor memory."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from learner.weights.sync_stream import BucketParts
from learner.weights.transports.base import PartsTransport, register
from shared_schemas.sync import BucketSpec, SyncManifest

if TYPE_CHECKING:
    from learner.weights.session import SyncSession

__all__ = ["HttpTransport"]


@register("http")
class HttpTransport(PartsTransport):
    """Buckets as HTTP bodies, to every server concurrently (the first failure in server order is raised)."""

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        list(self.options.pool.map(lambda s: s.upload(bucket.index, parts), sessions))
