"""Staged bucket files of a weight sync: taking over an shm bucket by name, streaming an HTTP body into a
file (`receivers.shm`, `receivers.http`), checking a file's safetensors header against its manifest entry
(`staging.SyncStaging`).

Every function here is file I/O only: no sync state, no engine.
"""

from __future__ import annotations

import asyncio
import mmap
import os
import shutil
import stat
import struct
from collections.abc import AsyncIterator
from pathlib import Path

from rollout_server.errors import NotFoundError, SyncValidationError
from shared_schemas.buckets import check_bucket
from shared_schemas.sync import BucketSpec

__all__ = ["adopt_shm_bucket", "check_file", "read_shm_bucket", "write_stream"]

_MAX_HEADER_READ = 100_000_000
"""Largest safetensors header read from a staged file (safetensors' own limit)."""

_WRITE_BATCH = 8 << 20
"""Bytes of HTTP body gathered before one `writev` into the staging file."""


def _open_shm(shm_dir: Path, file_name: str) -> tuple[int, os.stat_result]:
    """Opens a bucket file by NAME inside the staging directory, refusing anything outside it.

    Returns:
        An open read-only descriptor (the caller closes it) and its `fstat`.

    Raises:
        SyncValidationError: the name escapes the directory, is a symlink or not a regular file.
        NotFoundError: no such file.
    """
    root = shm_dir.resolve()
    path = root / file_name
    if path.parent != root or file_name in {"", ".", ".."}:
        raise SyncValidationError(
            f"shm file name {file_name!r} is not inside the staging dir", type="bad_shm_name"
        )
    try:
        # O_NOFOLLOW: a symlink planted in the staging dir must not lead outside it.
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except FileNotFoundError as exc:
        raise NotFoundError(
            f"shm bucket file {file_name!r} not found in the staging dir;"
            " write it there before posting its name",
            type="shm_file_not_found",
        ) from exc
    except OSError as exc:
        raise SyncValidationError(
            f"shm bucket file {file_name!r} cannot be opened ({exc.strerror}); it must be a regular file,"
            " not a symlink",
            type="bad_shm_name",
        ) from exc
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode):
        os.close(fd)
        raise SyncValidationError(f"shm bucket {file_name!r} is not a regular file", type="bad_shm_name")
    return fd, info


def read_shm_bucket(shm_dir: Path, file_name: str) -> bytes:
    """A bucket file's bytes, read by NAME from the staging directory (see `_open_shm` for the checks)."""
    fd, info = _open_shm(shm_dir, file_name)
    try:
        if info.st_size == 0:
            return b""
        with mmap.mmap(fd, info.st_size, access=mmap.ACCESS_READ) as mapped:
            return bytes(mapped)
    finally:
        os.close(fd)


def adopt_shm_bucket(shm_dir: Path, file_name: str, dest: Path) -> None:
    """Takes a learner-written bucket file over without copying it: a hard link `dest` to the SAME inode that
    was opened (without following links) and checked, so a name swapped in between is never adopted.

    Falls back to a copy where the filesystem has no hard links.

    Raises:
        SyncValidationError / NotFoundError: as `_open_shm`.
    """
    fd, info = _open_shm(shm_dir, file_name)
    try:
        try:
            os.link(shm_dir.resolve() / file_name, dest, follow_symlinks=False)
            linked = os.stat(dest, follow_symlinks=False)
            same = stat.S_ISREG(linked.st_mode) and (linked.st_dev, linked.st_ino) == (
                info.st_dev,
                info.st_ino,
            )
        except OSError:
            same = False  # no hard links here (or the name vanished): copy from the descriptor instead
        if not same:
            dest.unlink(missing_ok=True)
            with os.fdopen(os.dup(fd), "rb") as src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out, 16 << 20)
    finally:
        os.close(fd)


def check_file(path: Path, expected: BucketSpec) -> None:
    """`check_bucket` on a staged file from its header alone (reads 8 bytes + the header, never the data)."""
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        prefix = f.read(8)
        if len(prefix) == 8:
            (header_len,) = struct.unpack("<Q", prefix)
            prefix += f.read(min(header_len, _MAX_HEADER_READ))
    check_bucket(prefix, expected, total_size=size)


async def write_stream(path: Path, chunks: AsyncIterator[bytes]) -> None:
    """Streams an HTTP body into a (new or reused) file: `writev` per ~8 MiB on a worker thread, overlapped
    with receiving the next ~8 MiB (one write in flight, in order), so the loop stays free and the socket
    keeps flowing."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o600)  # a pool file is overwritten in place
    writing: asyncio.Future[None] | None = None
    try:
        batch: list[bytes] = []
        size = total = 0
        async for chunk in chunks:
            if chunk:
                batch.append(chunk)
                size += len(chunk)
                total += len(chunk)
            if size >= _WRITE_BATCH:
                if writing is not None:
                    await writing
                writing = asyncio.ensure_future(asyncio.to_thread(_write_all, fd, batch))
                batch, size = [], 0
        if writing is not None:
            await writing
            writing = None
        if batch:
            await asyncio.to_thread(_write_all, fd, batch)
        os.ftruncate(fd, total)  # a reused pool file may have been longer
    finally:
        if writing is not None:  # the body failed mid-way: let the write in flight finish before closing
            await asyncio.gather(writing, return_exceptions=True)
        os.close(fd)


def _write_all(fd: int, chunks: list[bytes]) -> None:
    views = [memoryview(c) for c in chunks]
    while views:
        written = os.writev(fd, views[:1024])
        while views and written >= views[0].nbytes:
            written -= views[0].nbytes
            views.pop(0)
        if written:
            views[0] = views[0][written:]
