"""`shm`: each bucket is a file the learner wrote into `server.shm_dir`, named in `POST .../buckets/{k}/shm`.

The name is opened without following links, checked to be a regular file, and taken over with a hard link of
the server's own into the sync's private directory (the learner's name may go after the ack; with several
servers each keeps its own link to the one file): `bucket_files.adopt_shm_bucket`.
"""

from __future__ import annotations

import asyncio
import secrets
from pathlib import Path

from rollout_server.errors import ConflictError
from rollout_server.weights.bucket_files import adopt_shm_bucket
from rollout_server.weights.receivers.base import StagedSync, register
from rollout_server.weights.receivers.files import FileReceiver, FileTransfer
from shared_schemas.sync import ShmBucketRef

__all__ = ["ShmReceiver"]


@register("shm")
class ShmReceiver(FileReceiver):
    """Bucket files in `server.shm_dir` (the learner's `rollout.sync.shm_dir`), adopted by hard link under the
    staging lock."""

    def open(self) -> None:
        if self.files.shm_dir is None:
            raise ConflictError(
                "shm transport is disabled on this server; send buckets as HTTP bodies"
                " (rollout.sync.transport: http) or set server.shm_dir",
                type="shm_disabled",
            )

    def slot(self, sync: StagedSync, transfer: FileTransfer, index: int) -> Path:
        transfer.transport = self.name
        if transfer.dir is None:
            transfer.dir = self.files.private_dir(sync.sync_id)
        return transfer.dir / f"b{index}-{secrets.token_hex(4)}.safetensors"

    async def take(self, path: Path, payload: ShmBucketRef) -> None:
        assert self.files.shm_dir is not None
        await asyncio.to_thread(adopt_shm_bucket, self.files.shm_dir, payload.file_name, path)
