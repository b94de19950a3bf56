"""The learner's side of the collective weight transport (`rollout.sync.transport: gloo | nccl`).

Learner rank 0 hosts a `TCPStore` and forms ONE process group with each server (learner = rank 0, the
server's receivers = ranks 1..n, n from the server's `begin` answer); HTTP carries only the control (begin
with the manifest and the rendezvous, commit, abort). Each manifest bucket is then one broadcast of a flat
`uint8` buffer — the bucket's tensors back to back in manifest order, no header (the manifest is the header) —
sent to every server's group concurrently. The group is built by `rollout_server.engines.collective.
process_group`, the same builder the receivers use; the server side is that module (the vLLM workers receive
through vLLM's weight-transfer engine API, the HF engine in its process). How buckets are packed — on the host
for gloo, on the GPU for NCCL — is `learner.rollout.transports.collective`.

A group outlives one sync (the same token is sent again, and the server reuses its group); any failure drops
it on both sides, and the next sync forms a new one. Every rendezvous and broadcast is bounded by
`rollout.sync.collective_timeout_s`, so a server that vanished fails the sync with its URL, never hangs it.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import warnings
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Literal

import torch

from learner.rollout.base import SyncError
from rollout_server.engines.collective import process_group, retire_group, wait_works
from shared_schemas.sync import CollectiveSpec, SyncBeginResponse

__all__ = ["CollectiveSender", "flat_bucket"]

logger = logging.getLogger(__name__)


def flat_bucket(parts: Sequence[memoryview], nbytes: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """The bucket's tensor bytes back to back (`parts[0]`, the safetensors header, is left out), one copy.

    Raises:
        SyncError: the parts do not add up to the manifest's `nbytes`.
    """
    flat = torch.empty(nbytes, dtype=torch.uint8)
    offset = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # "buffer is not writable": the parts are only read
        for part in parts[1:]:
            if part.nbytes == 0:
                continue
            flat[offset : offset + part.nbytes].copy_(torch.frombuffer(part, dtype=torch.uint8))
            offset += part.nbytes
    if offset != nbytes:
        raise SyncError(f"bucket holds {offset} bytes of tensors, the manifest says {nbytes}")
    return flat if str(device) == "cpu" else flat.to(device, non_blocking=False)


@dataclass
class _Group:
    token: str
    store: Any
    group: Any = None


class CollectiveSender:
    """Rank 0 of one weight-sync process group per server.

    Args:
        backend: `gloo` (CPU hosts) or `nccl` (GPUs).
        address: this host's address as the servers reach it (`rollout.sync.collective_address`).
        timeout_s: limit of every rendezvous and broadcast (`rollout.sync.collective_timeout_s`).
    """

    def __init__(self, backend: Literal["gloo", "nccl"], address: str, timeout_s: float) -> None:
        self.backend = backend
        self.address = address
        self.timeout_s = timeout_s
        self._groups: dict[str, _Group] = {}
        self._pool: ThreadPoolExecutor | None = None

    @property
    def device(self) -> str:
        """Where the flat buckets must be for a broadcast (`cuda` for NCCL)."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def spec(self, url: str) -> CollectiveSpec:
        """The rendezvous to send in `url`'s begin: its existing group, or a new store and token."""
        import torch.distributed as dist

        entry = self._groups.get(url)
        if entry is None:
            store = dist.TCPStore(
                self.address,
                0,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
            entry = self._groups[url] = _Group(token=secrets.token_hex(8), store=store)
        return CollectiveSpec(
            backend=self.backend,
            master_address=self.address,
            master_port=entry.store.port,
            group=entry.token,
            timeout_s=self.timeout_s,
        )

    def connect(self, urls: Sequence[str], begins: Sequence[SyncBeginResponse]) -> None:
        """Forms the groups the servers are joining now (concurrently: each rendezvous waits for its server).

        Raises:
            SyncError: a server lost the group it had joined (restarted), or a rendezvous failed.
        """
        todo: list[tuple[str, int]] = []
        for url, begin in zip(urls, begins, strict=True):
            entry = self._groups[url]
            if begin.collective_ranks < 1:
                raise SyncError(
                    f"{url} answered a {self.backend} sync without receivers; is it a rollmatch server?"
                )
            if entry.group is not None and begin.collective_joining:
                self.drop(url)
                raise SyncError(
                    f"{url} no longer holds weight-sync group {entry.token} (restarted?); the next sync forms a new one"
                )
            if entry.group is None:
                todo.append((url, begin.collective_ranks + 1))
        if todo:
            list(self._threads(len(todo)).map(lambda job: self._join(*job), todo))

    def start_broadcast(self, urls: Sequence[str], flat: torch.Tensor, index: int) -> list[Any]:
        """Enqueues one flat bucket's broadcast to every server's group (NCCL: asynchronous, on each group's
        own stream, ordered after the current stream's work); returns the works, one per server.

        Raises:
            SyncError: a group refused the broadcast at once (its group is dropped).
        """
        timeout = datetime.timedelta(seconds=self.timeout_s)
        works = []
        for url in urls:
            try:
                works.append(self._groups[url].group.broadcast(flat, 0, timeout))
            except Exception as exc:
                self.drop(url)
                raise SyncError(
                    f"{self.backend} broadcast of bucket {index} to {url} failed ({type(exc).__name__}: {exc})"
                ) from exc
        return works

    def finish(self, urls: Sequence[str], works: Sequence[Any], index: int) -> None:
        """Waits on the host, bounded by the timeout, until `works` (the last bucket's, per server) are done.

        Raises:
            SyncError: a broadcast failed or did not complete in time (names the server; groups dropped).
        """
        try:
            wait_works(works, self.timeout_s, [f"broadcast of bucket {index} to {url}" for url in urls])
        except Exception as exc:
            for url in urls:
                self.drop(url)
            raise SyncError(
                f"{self.backend} broadcast failed ({type(exc).__name__}: {exc}); the server's receiver died or"
                " timed out (its log says which)"
            ) from exc

    def broadcast(self, urls: Sequence[str], flat: torch.Tensor, index: int) -> None:
        """Broadcasts one flat bucket to every server's group at once, waiting on the host (gloo).

        Raises:
            SyncError: a broadcast failed or timed out (names the server; its group is dropped).
        """

        def send(url: str) -> None:
            entry = self._groups[url]
            try:
                entry.group.broadcast(flat, 0, datetime.timedelta(seconds=self.timeout_s)).wait()
            except Exception as exc:
                self.drop(url)
                raise SyncError(
                    f"{self.backend} broadcast of bucket {index} to {url} failed ({type(exc).__name__}: {exc});"
                    " the server's receiver died or timed out (its log says which)"
                ) from exc

        list(self._threads(len(urls)).map(send, urls))

    def drop(self, url: str) -> None:
        """Forgets `url`'s group (after a failure: the next sync forms a new one). The group object is retired,
        not torn down here: a broadcast to a dead server may still be pending in it (`retire_group`)."""
        entry = self._groups.pop(url, None)
        if entry is not None:
            retire_group(entry.group)

    def close(self) -> None:
        """Drops every group and the helper threads."""
        self._groups.clear()
        if self._pool is not None:
            self._pool.shutdown(wait=False)
            self._pool = None

    def _join(self, url: str, world_size: int) -> None:
        import torch.distributed as dist

        entry = self._groups[url]
        prefixed = dist.PrefixStore(entry.token, entry.store)
        try:
            entry.group = process_group(self.backend, prefixed, 0, world_size, self.timeout_s, self.address)
        except Exception as exc:
            self.drop(url)
            raise SyncError(
                f"forming the {self.backend} weight-sync group with {url} ({world_size - 1} receivers) at"
                f" {self.address}:{entry.store.port} failed ({type(exc).__name__}: {exc}); the server must reach"
                " this address: set rollout.sync.collective_address to this host's address on the servers' network"
            ) from exc
        logger.info(
            "%s weight-sync group %s formed with %s (%d ranks)", self.backend, entry.token, url, world_size
        )

    def _threads(self, n: int) -> ThreadPoolExecutor:
        if self._pool is None or self._pool._max_workers < n:  # noqa: SLF001 - grow only when needed
            self._pool = ThreadPoolExecutor(
                max_workers=max(n, 1), thread_name_prefix="weight-sync-collective"
            )
        return self._pool
