"""Streaming a weight update as safetensors buckets: bucket assembly, prefetch, the host check.

A `WeightUpdate` is consumed once, in manifest order. A bucket is never assembled into one blob: it is its
safetensors header plus VIEWS of the tensors' own memory (`bucket_parts`), written into the shm file or sent
as the HTTP body directly from there (the only copy on the learner is the one into the file or the socket;
none with shm's shared parameters, `learner.weights.transports.shm`).
`prefetched` builds bucket k+1 (export: merge-time casts, ZeRO-3 gathers, CPU moves) on a helper thread while
bucket k travels, so at most two buckets of exported tensors are alive at a time.
"""

from __future__ import annotations

import ipaddress
import queue
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import TypeVar

import httpx
import torch

from learner.weights.codec import raw_tensor
from learner.weights.types import SyncError
from shared_schemas.buckets import RawTensor, bucket_parts
from shared_schemas.sync import BucketSpec

__all__ = ["BucketParts", "bucket_payloads", "is_loopback_url", "prefetched"]

BucketParts = list[memoryview]
"""One bucket as buffers to write or send in order: safetensors header, then each tensor's raw bytes."""

_T = TypeVar("_T")


def is_loopback_url(base_url: str) -> bool:
    """True when `base_url` points at this host (`localhost`, `127.0.0.0/8`, `::1`)."""
    host = httpx.URL(base_url).host
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def bucket_payloads(
    buckets: Sequence[BucketSpec], items: Iterable[tuple[str, torch.Tensor]]
) -> Iterator[tuple[BucketSpec, BucketParts]]:
    """Groups `items` (in manifest order) into the planned buckets, each as safetensors parts (no copy).

    Args:
        buckets: the manifest's buckets; their tensors concatenated are the order of `items`.
        items: `(name, tensor)` pairs, already checked against the manifest (`WeightUpdate.iter_tensors`).

    Yields:
        `(bucket, parts)`, one per bucket, as soon as its last tensor has arrived; the parts view the
        tensors (or their CPU copies), valid until the consumer drops them.

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
        yield bucket, bucket_parts(raws)
    leftover = next(iterator, None)
    if leftover is not None:
        raise SyncError(f"tensor {leftover[0]!r} is not in the sync manifest")


_DONE = object()


def prefetched(items: Iterator[_T], depth: int = 1) -> Iterator[_T]:
    """Yields `items`, produced `depth` ahead on a helper thread (bucket k+1 is built while k travels).

    An exception of the producer is raised at the consumer, in order. Closing the generator early (the
    consumer failed) stops the producer after the item it is building; nothing is left running.
    """
    slots: queue.Queue[object] = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            for item in items:
                while not stop.is_set():
                    try:
                        slots.put(item, timeout=0.1)
                        break
                    except queue.Full:
                        continue
                if stop.is_set():
                    return
            slots.put(_DONE)
        except BaseException as exc:  # handed to the consumer, which raises it
            slots.put(exc)

    thread = threading.Thread(target=produce, name="sync-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item = slots.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):
                raise item
            yield item  # type: ignore[misc]
    finally:
        stop.set()
        while thread.is_alive():
            try:
                slots.get_nowait()
            except queue.Empty:
                thread.join(0.1)
