"""`gloo` and `nccl`: each bucket is ONE broadcast over a process group the learner forms with each server
(`learner.rollout.collective.CollectiveSender`; the receivers are `rollout_server.engines.collective`).

`gloo` (CPU hosts) packs each bucket on the host from its safetensors parts (`flat_bucket`), one bucket ahead
on a helper thread, and broadcasts it with a host wait per bucket.

`nccl` never moves a byte through host memory: each bucket is packed on the learner's GPU straight from the
exported tensors into one of TWO preallocated device buffers (`copy_` of `uint8` views, on the current CUDA
stream), and its broadcast is enqueued at once on each group's NCCL stream, which waits for the packing
(stream order) — so bucket k + 1 is packed while bucket k is on the wire. Before a buffer is packed again the
stream waits (`Work.wait()`, an event wait, not a host wait) for the broadcasts that read it two buckets ago.
A bucket that is a single contiguous GPU tensor (an embedding larger than `bucket_mb`) is broadcast from the
tensor itself, no copy. The host waits once, after the last bucket is enqueued, bounded by
`rollout.sync.collective_timeout_s`. The learner's extra GPU memory during a sync is the two buffers (two
buckets), plus the export's own temporaries (a dtype cast, a ZeRO-3 gather of one bucket, a LoRA merge of
one tensor), which live only until their bucket is packed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from learner.rollout.base import SyncError
from learner.rollout.collective import CollectiveSender, flat_bucket
from learner.rollout.sync_stream import BucketParts, is_loopback_url
from learner.rollout.transports.base import PartsTransport, TensorItems, Transport, TransportOptions, register
from shared_schemas.sync import BucketSpec, CollectiveSpec, SyncBeginResponse, SyncManifest

if TYPE_CHECKING:
    from learner.rollout.server_api import SyncSession

__all__ = ["DeviceBucketPacker", "GlooTransport", "NcclTransport"]


class _Collective(Transport):
    """What both collective transports share: the groups, the address check, the failure handling."""

    full_only = True

    def __init__(self, options: TransportOptions) -> None:
        super().__init__(options)
        address = options.collective_address
        if address is None:
            remote = [url for url in options.urls if not is_loopback_url(url)]
            if remote:
                raise ValueError(
                    f"rollout.sync.transport {self.name!r} with server {remote[0]} on another host needs"
                    " rollout.sync.collective_address: this host's address as the servers reach it"
                )
            address = "127.0.0.1"
        self.sender = CollectiveSender(self.name, address, options.collective_timeout_s)  # type: ignore[arg-type]

    def rendezvous(self, url: str) -> CollectiveSpec | None:
        return self.sender.spec(url)

    def joined(self, urls: Sequence[str], begins: Sequence[SyncBeginResponse]) -> None:
        self.sender.connect(urls, begins)

    def failed(self, urls: Sequence[str]) -> None:
        for url in urls:  # a group may be out of step with its server now: form new ones next time
            self.sender.drop(url)

    def close(self) -> None:
        self.sender.close()


@register("gloo")
class GlooTransport(_Collective, PartsTransport):
    """Host path: each bucket flattened on the host and broadcast over gloo."""

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        self.sender.broadcast(self.options.urls, flat_bucket(parts, bucket.nbytes), bucket.index)


class DeviceBucketPacker:
    """Packs buckets into two alternating device buffers (see the module docstring).

    Args:
        device: the learner's GPU.
        widest: bytes of the largest bucket that will be packed (the buffers' size).
    """

    def __init__(self, device: torch.device, widest: int) -> None:
        self.device = device
        self.widest = widest
        self._buffers: list[torch.Tensor | None] = [None, None]
        self._readers: list[list[Any]] = [[], []]
        self._next = 0

    @property
    def allocated_bytes(self) -> int:
        """Device bytes the buffers hold now."""
        return sum(b.numel() for b in self._buffers if b is not None)

    def pack(self, tensors: Sequence[torch.Tensor], nbytes: int) -> tuple[torch.Tensor, int | None]:
        """The bucket's bytes back to back on the device, and the buffer slot they occupy (None: no copy,
        the bucket is one contiguous GPU tensor and is sent from its own memory).

        Raises:
            SyncError: the tensors do not add up to the manifest's `nbytes`.
        """
        if len(tensors) == 1 and tensors[0].device == self.device and tensors[0].is_contiguous():
            flat = tensors[0].detach().reshape(-1).view(torch.uint8)
            if flat.numel() != nbytes:
                raise SyncError(f"bucket holds {flat.numel()} bytes of tensors, the manifest says {nbytes}")
            return flat, None
        slot = self._next
        self._next ^= 1
        for work in self._readers[slot]:
            work.wait()  # the current stream waits for the broadcasts that still read this buffer
        self._readers[slot] = []
        buffer = self._buffers[slot]
        if buffer is None or buffer.numel() < nbytes:
            buffer = self._buffers[slot] = None  # free the smaller one first
            buffer = self._buffers[slot] = torch.empty(
                max(nbytes, self.widest), dtype=torch.uint8, device=self.device
            )
        flat = buffer[:nbytes]
        offset = 0
        for tensor in tensors:
            raw = tensor.detach().contiguous().reshape(-1).view(torch.uint8)
            size = raw.numel()
            if offset + size > nbytes:
                raise SyncError(f"bucket holds more than the {nbytes} bytes of tensors the manifest says")
            flat[offset : offset + size].copy_(raw, non_blocking=True)
            offset += size
        if offset != nbytes:
            raise SyncError(f"bucket holds {offset} bytes of tensors, the manifest says {nbytes}")
        return flat, slot

    def reading(self, slot: int | None, works: Sequence[Any]) -> None:
        """Records the broadcasts that read buffer `slot` (waited for before it is packed again)."""
        if slot is not None:
            self._readers[slot] = list(works)


def learner_device(tensor: torch.Tensor) -> torch.device:
    """Where NCCL buckets are packed: the tensor's GPU, or this process's current GPU for CPU tensors."""
    if tensor.is_cuda:
        return tensor.device
    return torch.device("cuda", torch.cuda.current_device())


@register("nccl")
class NcclTransport(_Collective):
    """Device path: buckets packed on the learner's GPU, double-buffered, broadcast over NCCL."""

    def send(
        self,
        sessions: Sequence[SyncSession],
        manifest: SyncManifest,
        items: TensorItems,
        stages: dict[str, float],
    ) -> None:
        urls = self.options.urls
        packer: DeviceBucketPacker | None = None
        works: list[Any] = []
        iterator = iter(items)
        mark = time.perf_counter()
        for bucket in manifest.buckets:
            tensors = []
            for spec in bucket.tensors:
                name, tensor = next(iterator, (None, None))
                if name != spec.name or tensor is None:
                    raise SyncError(f"bucket {bucket.index}: expected tensor {spec.name!r}, got {name!r}")
                tensors.append(tensor)
            now = time.perf_counter()
            stages["produce_s"] += now - mark  # the export (casts, merges, gathers), enqueued on the stream
            if packer is None:
                packer = DeviceBucketPacker(learner_device(tensors[0]), _widest_packed(manifest))
            flat, slot = packer.pack(tensors, bucket.nbytes)
            works = self.sender.start_broadcast(urls, flat, bucket.index)
            packer.reading(slot, works)
            mark = time.perf_counter()
            stages["pack_enqueue_s"] = stages.get("pack_enqueue_s", 0.0) + mark - now
            stages["upload_s"] += mark - now
        leftover = next(iterator, None)
        if leftover is not None:
            raise SyncError(f"tensor {leftover[0]!r} is not in the sync manifest")
        if works:
            self.sender.finish(urls, works, len(manifest.buckets) - 1)
        done = time.perf_counter()
        stages["wire_wait_s"] = done - mark
        stages["upload_s"] += done - mark
        if packer is not None:
            stages["learner_buffer_bytes"] = float(packer.allocated_bytes)


def _widest_packed(manifest: SyncManifest) -> int:
    """Bytes of the largest bucket of several tensors (single-tensor buckets are sent in place)."""
    sizes = [b.nbytes for b in manifest.buckets if len(b.tensors) > 1]
    return max(sizes, default=0)
