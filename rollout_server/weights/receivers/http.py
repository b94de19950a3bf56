"""`http`: each bucket is the body of `PUT .../buckets/{k}`, streamed into a pool file as it arrives."""

from __future__ import annotations

import asyncio
from pathlib import Path

from rollout_server.weights.bucket_files import write_stream
from rollout_server.weights.receivers.base import BucketBody, StagedSync, register
from rollout_server.weights.receivers.files import FileReceiver, FileTransfer

__all__ = ["HttpReceiver"]


@register("http")
class HttpReceiver(FileReceiver):
    """Bucket bodies, written into a pool file as they arrive (no whole-body buffer) outside the staging
    lock, so other phases go on; a sync superseded or aborted meanwhile loses the file and answers 404."""

    streams = True

    def slot(self, sync: StagedSync, transfer: FileTransfer, index: int) -> Path:
        path = self.files.body_file()
        transfer.owned.add(path)
        return path

    async def take(self, path: Path, payload: BucketBody) -> None:
        if isinstance(payload, bytes | bytearray | memoryview):
            await asyncio.to_thread(path.write_bytes, bytes(payload))
        else:
            await write_stream(path, payload)

    async def refused(self, payload: BucketBody) -> None:
        if not isinstance(payload, bytes | bytearray | memoryview):
            async for _ in payload:  # read the body out: an oversize one answers 413 first, as before
                pass
