"""Where this server's staged bucket files live (`StagedFiles`): per-sync private directories in
`server.shm_dir`, and the pool of HTTP body files, recycled after a committed sync. The file receivers
(`receivers.files`) keep one sync's files in its `FileTransfer`; this store only makes and removes them.
"""

from __future__ import annotations

import os
import secrets
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

__all__ = ["STAGED_DIR_PREFIX", "StagedFiles"]

STAGED_DIR_PREFIX = ".rollmatch-staged-"
"""Prefix of the private directory (in `server.shm_dir`) that holds one sync's staged bucket files."""


class StagedFiles:
    """Where this server's staged bucket files live: per-sync private directories (in `shm_dir`, so that
    learner files are adopted by hard link) and the pool of body files, recycled after a committed sync.

    Args:
        shm_dir: `server.shm_dir`; None disables the `shm` route.
    """

    def __init__(self, shm_dir: Path | None) -> None:
        self.shm_dir = shm_dir
        self.pool: Path | None = None
        """Directory of the pooled body files (None until the first body)."""
        self._spare: list[Path] = []

    def private_dir(self, sync_id: str) -> Path:
        """A new private directory for one sync's adopted files, on the filesystem of `shm_dir` so learner
        files are adopted by hard link (removed with the sync: `release`)."""
        if self.shm_dir is not None:
            self.shm_dir.mkdir(parents=True, exist_ok=True)
            parent: str | None = str(self.shm_dir)
        else:
            parent = _dev_shm()
        return Path(tempfile.mkdtemp(prefix=f"{STAGED_DIR_PREFIX}{sync_id[:8]}-", dir=parent))

    def body_file(self) -> Path:
        """A pool file for one HTTP body: a spare one from the last committed sync (its pages already
        allocated), else a new name in the pool directory."""
        if self._spare:
            return self._spare.pop()
        if self.pool is None:
            self.pool = Path(tempfile.mkdtemp(prefix="rollmatch-sync-pool-", dir=_dev_shm()))
        return self.pool / f"body-{secrets.token_hex(8)}.safetensors"

    def release(self, private_dir: Path | None, owned: Iterable[Path], *, recycle: bool) -> None:
        """Removes a finished sync's files (its private directory, the pool files it `owned`); after a commit
        (`recycle`) its pool files become the spares."""
        if private_dir is not None:
            shutil.rmtree(private_dir, ignore_errors=True)
        if recycle:
            for path in self._spare:
                path.unlink(missing_ok=True)
            self._spare = [path for path in owned if path.exists()]
        else:
            for path in owned:
                path.unlink(missing_ok=True)

    def close(self) -> None:
        """Drops the spares and the pool directory (server shutdown)."""
        self._spare = []
        if self.pool is not None:
            shutil.rmtree(self.pool, ignore_errors=True)
            self.pool = None


def _dev_shm() -> str | None:
    return "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
