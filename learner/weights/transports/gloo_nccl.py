"""`gloo` and `nccl`: each bucket is ONE broadcast over ONE process group that spans the learner and every
server (`learner.weights.group_send.CollectiveSender`; the receivers are
`rollout_server.weights.group_receive`).

The group is planned when the sender has none over these servers: each server's `/health` says how many
receivers it brings (`collective_ranks`), and each begin carries the group's world size and the server's first
rank. After the last bucket every server is asked to `prepare` (it answers once its receive has finished), and
only then does any server commit: a server that died mid-broadcast fails the sync on every server, none
applies it. A single server skips that round: its commit waits for its own receive and discards a failed one.
A failure names the server that no longer answers (its `/health` is probed) and drops the group; the next sync
plans a new one with every configured server.

`gloo` (CPU hosts) packs each bucket on the host from its safetensors parts (`flat_bucket`), one bucket ahead
on a helper thread, and broadcasts it with a host wait per bucket.

`nccl` never moves a byte through host memory: each bucket is packed on the learner's GPU straight from the
exported tensors into one of TWO preallocated device buffers (`copy_` of `uint8` views, on the current CUDA
stream), and its ONE broadcast is enqueued at once on the group's NCCL stream, which waits for the packing
(stream order) — so bucket k + 1 is packed while bucket k is on the wire. Before a buffer is packed again the
stream waits (`Work.wait()`, an event wait, not a host wait) for the broadcast that read it two buckets ago.
A bucket that is a single contiguous GPU tensor (an embedding larger than `bucket_mb`) is broadcast from the
tensor itself, no copy. The host waits once, after the last bucket is enqueued, bounded by
`rollout.sync.collective_timeout_s`. The learner's extra GPU memory during a sync is the two buffers (two
buckets), plus the export's own temporaries (a dtype cast, a ZeRO-3 gather of one bucket, a LoRA merge of
one tensor), which live only until their bucket is packed — whatever the number of servers.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from typing import TYPE_CHECKING, Any

import torch

from learner.weights.group_send import CollectiveError, CollectiveSender, flat_bucket
from learner.weights.sync_stream import BucketParts, is_loopback_url
from learner.weights.transports.base import (
    PartsTransport,
    Sessions,
    Stages,
    TensorItems,
    Transport,
    TransportOptions,
    register,
)
from learner.weights.types import SyncError
from shared_schemas.sync import BucketSpec, CollectiveSpec, SyncManifest

if TYPE_CHECKING:
    from learner.weights.session import SyncClient, SyncSession

__all__ = ["DeviceBucketPacker", "GlooTransport", "NcclTransport"]


PREPARE_MARGIN_S = 10.0
"""Seconds a server's `prepare` may take beyond the group's timeout (which bounds its own wait)."""


class _Collective(Transport):
    """What both collective transports share: the group, the address check, the prepare round, the failure
    handling. Subclasses define `send_buckets` (`send`'s arguments): every bucket, one broadcast each."""

    full_only = True
    send_buckets: Callable[[Sessions, SyncManifest, TensorItems, Stages], None]

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

    def rendezvous(self, clients: Sequence[SyncClient]) -> list[CollectiveSpec | None]:
        urls = [client.base_url for client in clients]
        ranks = None if self.sender.holds(urls) else self._receiver_counts(clients)
        return list(self.sender.specs(urls, ranks))

    def _receiver_counts(self, clients: Sequence[SyncClient]) -> list[int | None]:
        """Every server's receivers, from its `/health` (asked concurrently)."""
        healths = _each(lambda client: client.health(), clients)
        counts = [health.collective_ranks for health in healths]
        if len(clients) > 1:
            for client, health in zip(clients, healths, strict=True):
                if health.collective_ranks is None:
                    detail = f": {health.detail}" if health.detail else ""
                    raise SyncError(
                        f"rollout server {client.base_url} reports no {self.name} weight-sync receivers in"
                        f" /health (status {health.status}{detail}): its engine cannot receive over"
                        f" {self.name}, or the server predates one weight-sync group for every server; use"
                        " rollout.sync.transport http or shm, or restart that server from this checkout"
                    )
        return counts

    def joined(self, sessions: Sequence[SyncSession]) -> None:
        try:
            self.sender.connect([s.client.base_url for s in sessions], [s.begin for s in sessions])
        except CollectiveError as exc:  # the rendezvous: a server may be gone
            raise self.blame(exc, sessions) from exc

    def send(self, sessions: Sessions, manifest: SyncManifest, items: TensorItems, stages: Stages) -> None:
        try:
            self.send_buckets(sessions, manifest, items, stages)
            if len(sessions) > 1:
                # One server needs no prepare round: its commit waits for the receive itself and discards the
                # sync when it failed (one HTTP round trip less: ~5 % of a 7-8 B model's nccl sync).
                self.prepare(sessions, stages)
        except CollectiveError as exc:
            raise self.blame(exc, sessions) from exc
        if self.sender.fleet is not None and self.sender.fleet.world_size is not None:
            stages["collective_world_size"] = float(self.sender.fleet.world_size)

    def prepare(self, sessions: Sequence[SyncSession], stages: dict[str, float]) -> None:
        """Asks every server concurrently to confirm it holds every bucket (`/sync_weights/prepare`: its
        receive has finished); returns when all have, so the commits that follow only apply. Bounded by the
        group's timeout plus `PREPARE_MARGIN_S`; the first failure ends the wait.

        Raises:
            CollectiveError: a server's receive failed, or a server did not answer in time.
        """
        started = time.perf_counter()
        limit = self.options.collective_timeout_s + PREPARE_MARGIN_S
        # Threads of its own, left behind after a failure (a survivor's prepare may wait out its timeout).
        pool = ThreadPoolExecutor(max_workers=max(len(sessions), 1), thread_name_prefix="weight-sync-prepare")
        try:
            futures = {
                pool.submit(s.client.sync_prepare, s.sync_id, timeout_s=limit): s.client.base_url
                for s in sessions
            }
            done, running = wait(futures, timeout=limit + PREPARE_MARGIN_S, return_when=FIRST_EXCEPTION)
        finally:
            pool.shutdown(wait=False)
        failures = [(futures[f], f.exception()) for f in done if f.exception() is not None]
        if failures or running:
            self.sender.drop()
            if failures:
                url, error = failures[0]
                raise CollectiveError(
                    f"rollout server {url} could not confirm every bucket of the {self.name} sync ({error})"
                ) from error
            late = ", ".join(futures[f] for f in running)
            raise CollectiveError(
                f"rollout server {late} did not confirm every bucket of the {self.name} sync within"
                f" {limit:.0f} s"
            )
        stages["prepare_s"] = time.perf_counter() - started

    def blame(self, exc: SyncError, sessions: Sequence[SyncSession]) -> SyncError:
        """`exc` with the servers that no longer answer `/health` named first (probed concurrently), and the
        fix."""
        if not sessions:
            return exc

        def answers(client: SyncClient) -> bool:
            try:
                client.health()
            except client.errors:
                return False
            return True

        clients = [s.client for s in sessions]
        down = [c.base_url for c, ok in zip(clients, _each(answers, clients), strict=True) if not ok]
        if down:
            return SyncError(
                f"rollout server {', '.join(down)} no longer answers (died or hangs) during a {self.name}"
                f" weight sync: {exc}. No server applied this sync (every server's staged copy is aborted;"
                " the old weights keep serving). Restart that server (scripts/start_rollout_server.sh, check"
                " its log) or remove it from rollout.servers, then restart the learner (from its last"
                " checkpoint); the next sync forms a new group with every configured server"
            )
        return SyncError(
            f"{exc}; every server still answers /health: a receiver failed or timed out — see the servers'"
            " logs (rollout.sync.collective_timeout_s bounds each wait)"
        )

    def failed(self, urls: Sequence[str]) -> None:
        self.sender.drop()  # it may be out of step with a server now: the next sync plans a new group

    def close(self) -> None:
        self.sender.close()


def _each(call: Callable[[SyncClient], Any], clients: Sequence[SyncClient]) -> list[Any]:
    """`call(client)` for every client at once (threads of its own: the source's pool may be busy with a
    background rollout, the last sync's prepare threads with a dead server)."""
    with ThreadPoolExecutor(max_workers=max(len(clients), 1), thread_name_prefix="weight-sync-probe") as pool:
        return list(pool.map(call, clients))


@register("gloo")
class GlooTransport(_Collective, PartsTransport):
    """Host path: each bucket flattened on the host and broadcast over gloo."""

    send_buckets = PartsTransport.send  # one broadcast per bucket (`send_bucket`), packed one bucket ahead

    def send_bucket(
        self, sessions: Sequence[SyncSession], manifest: SyncManifest, bucket: BucketSpec, parts: BucketParts
    ) -> None:
        self.sender.broadcast(flat_bucket(parts, bucket.nbytes), bucket.index)


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

    def send_buckets(
        self, sessions: Sessions, manifest: SyncManifest, items: TensorItems, stages: Stages
    ) -> None:
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
            works = self.sender.start_broadcast(flat, bucket.index)
            packer.reading(slot, works)
            mark = time.perf_counter()
            stages["pack_enqueue_s"] = stages.get("pack_enqueue_s", 0.0) + mark - now
            stages["upload_s"] += mark - now
        leftover = next(iterator, None)
        if leftover is not None:
            raise SyncError(f"tensor {leftover[0]!r} is not in the sync manifest")
        if works:
            self.sender.finish(works, len(manifest.buckets) - 1)
        done = time.perf_counter()
        stages["wire_wait_s"] = done - mark
        stages["upload_s"] += done - mark
        if packer is not None:
            stages["learner_buffer_bytes"] = float(packer.allocated_bytes)


def _widest_packed(manifest: SyncManifest) -> int:
    """Bytes of the largest bucket of several tensors (single-tensor buckets are sent in place)."""
    sizes = [b.nbytes for b in manifest.buckets if len(b.tensors) > 1]
    return max(sizes, default=0)
