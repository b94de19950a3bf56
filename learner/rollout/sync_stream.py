"""Streaming a weight update as safetensors buckets: bucket assembly, the shm staging file, the host check.

A `WeightUpdate` is consumed once, in manifest order; each bucket is encoded as soon as its last tensor
arrives (so under ZeRO-3 only one bucket of gathered parameters is alive at a time) and sent to every
server before the next is built.
"""

from __future__ import annotations

import ipaddress
import os
import uuid
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx
import torch

from learner.rollout.base import SyncError
from learner.weights.codec import raw_tensor
from shared_schemas.buckets import RawTensor, encode_bucket
from shared_schemas.sync import BucketSpec

__all__ = ["ShmStager", "encoded_buckets", "is_loopback_url"]


def is_loopback_url(base_url: str) -> bool:
    """True when `base_url` points at this host (`localhost`, `127.0.0.0/8`, `::1`)."""
    host = httpx.URL(base_url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def encoded_buckets(
    buckets: Sequence[BucketSpec], items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[BucketSpec, bytes]]:
    """Groups `items` (in manifest order) into the planned buckets and encodes each as safetensors.

    Args:
        buckets: the manifest's buckets; their tensors concatenated are the order of `items`.
        items: `(name, tensor)` pairs, already checked against the manifest (`WeightUpdate.iter_tensors`).

    Yields:
        `(bucket, safetensors bytes)`, one per bucket, as soon as its last tensor has arrived.

    Raises:
        SyncError: a tensor name that is not the next one the manifest expects.
    """
    iterator = iter(items)
    for bucket in buckets:
        raws: list[RawTensor] = []
        for spec in bucket.tensors:
            name, tensor = next(iterator, (None, None))
            if name != spec.name or tensor is None:
                raise SyncError(f"bucket {bucket.index}: expected tensor {spec.name!r}, got {name!r}")
            raws.append(raw_tensor(name, tensor))
        yield bucket, encode_bucket(raws)
    leftover = next(iterator, None)
    if leftover is not None:
        raise SyncError(f"tensor {leftover[0]!r} is not in the sync manifest")


class ShmStager:
    """Writes bucket files into the servers' shared staging directory, and removes them.

    The directory must be the one the servers are configured with (`server.shm_dir`); `/health` does not
    expose it, so the learner takes it from `rollout.sync.shm_dir`. Files appear atomically (written under
    a hidden temporary name, then renamed), so a server never maps a half-written bucket.

    Args:
        shm_dir: the staging directory (created when missing).
    """

    def __init__(self, shm_dir: str | Path) -> None:
        self.shm_dir = Path(shm_dir).expanduser()
        self._tag = uuid.uuid4().hex[:12]

    @contextmanager
    def staged(self, version: int, index: int, data: bytes) -> Iterator[str]:
        """Writes one bucket, yields its plain file name, and removes the file on exit.

        The servers copy a bucket before acknowledging it, so the file may go as soon as every server
        has acknowledged.
        """
        self.shm_dir.mkdir(parents=True, exist_ok=True)
        name = f"rollmatch-{self._tag}-v{version}-b{index}.safetensors"
        final = self.shm_dir / name
        tmp = self.shm_dir / f".{name}.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, final)
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            raise SyncError(
                f"cannot write bucket {index} into shm staging dir {self.shm_dir} ({exc.strerror});"
                " check rollout.sync.shm_dir (it must equal the server's server.shm_dir) and free space"
            ) from exc
        try:
            yield name
        finally:
            final.unlink(missing_ok=True)
