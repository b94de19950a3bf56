"""The learner's side of the collective weight transport (`rollout.sync.transport: gloo | nccl`).

Learner rank 0 hosts a `TCPStore` and forms ONE process group with EVERY server of the sync (verl's and TRL's
weight-sync layout: the trainer plus every rollout worker in one group, world size 1 + every receiver): the
learner is rank 0, server k's receivers are the block of ranks after server k - 1's, its size read from the
server's `/health` (`collective_ranks`: every worker of every engine) when the group is planned. HTTP carries
only the control (begin with the manifest and the rendezvous — store, token, world size, the server's
`rank_offset` —, prepare, commit, abort). Each manifest bucket is then ONE broadcast of a flat `uint8` buffer
— the bucket's tensors back to back in manifest order, no header (the manifest is the header) — over that
group, whatever the number of servers: NCCL and gloo pipeline it along their ring or tree, so the learner's
own link carries one copy of the weights, not one per server. The group is built by
`shared_schemas.torch_common.process_group.process_group`, the same builder the receivers use; the server side
is `rollout_server.weights.group_receive` (the vLLM workers receive through vLLM's weight-transfer engine API,
the HF engine in its process). How buckets are packed — on the host for gloo, on the GPU for NCCL — is
`learner.weights.transports.gloo_nccl`.

A group outlives one sync (the same token is sent again, and every server reuses its part of it); any failure
— one server dead, restarted or timed out — drops the whole group, and the next sync plans and forms a new one
with every configured server. Every rendezvous and broadcast is bounded by
`rollout.sync.collective_timeout_s`.
"""

from __future__ import annotations

import datetime
import logging
import secrets
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from learner.weights.types import SyncError
from shared_schemas.sync import CollectiveBackend, CollectiveSpec, SyncBeginResponse
from shared_schemas.torch_common.process_group import process_group, retire_group, wait_works

__all__ = ["CollectiveError", "CollectiveSender", "flat_bucket"]

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


class CollectiveError(SyncError):
    """The group could not be formed, or a broadcast or a server's receive failed: on the wire, not in the
    update itself (the transport then names the server that no longer answers)."""


@dataclass
class _Fleet:
    """One weight-sync group over every server: who holds which ranks."""

    token: str
    store: Any
    urls: tuple[str, ...]
    ranks: tuple[int | None, ...]
    """Receivers per server, in `urls` order (None: not known before the begin — a lone server that predates
    `Health.collective_ranks`; its group is then that server alone)."""
    group: Any = None

    @property
    def world_size(self) -> int | None:
        """1 + every server's receivers (None while a count is unknown)."""
        if any(n is None for n in self.ranks):
            return None
        return 1 + sum(n for n in self.ranks if n is not None)

    def offset(self, index: int) -> int:
        """Rank of server `index`'s first receiver."""
        return 1 + sum(n or 0 for n in self.ranks[:index])

    def layout(self) -> str:
        """`url ranks a..b` for every server (what an error names)."""
        return ", ".join(
            f"{url} ranks {self.offset(i)}..{self.offset(i) + (n or 1) - 1}"
            for i, (url, n) in enumerate(zip(self.urls, self.ranks, strict=True))
        )


class CollectiveSender:
    """Rank 0 of the one weight-sync process group that spans every server.

    Args:
        backend: `gloo` (CPU hosts) or `nccl` (GPUs).
        address: this host's address as the servers reach it (`rollout.sync.collective_address`).
        timeout_s: limit of every rendezvous and broadcast (`rollout.sync.collective_timeout_s`).
    """

    def __init__(self, backend: CollectiveBackend, address: str, timeout_s: float) -> None:
        self.backend = backend
        self.address = address
        self.timeout_s = timeout_s
        self.fleet: _Fleet | None = None
        """The group of the last sync (None: none; the next sync plans a new one)."""

    @property
    def device(self) -> str:
        """Where the flat buckets must be for a broadcast (`cuda` for NCCL)."""
        return "cuda" if self.backend == "nccl" else "cpu"

    def holds(self, urls: Sequence[str]) -> bool:
        """Whether a group over exactly `urls` (in this order) is planned already (its specs need no new
        receiver counts)."""
        return self.fleet is not None and self.fleet.urls == tuple(urls)

    def specs(self, urls: Sequence[str], ranks: Sequence[int | None] | None = None) -> list[CollectiveSpec]:
        """The rendezvous each server's begin carries, in `urls` order: the planned group's, or a new group
        over `urls` with `ranks[k]` receivers on server k (new store and token, consecutive rank blocks).

        Raises:
            ValueError: a new group is needed and `ranks` is missing, or a count is unknown with
                several servers.
        """
        import torch.distributed as dist

        if not self.holds(urls):
            self.drop()
            if ranks is None or len(ranks) != len(urls):
                raise ValueError("a new weight-sync group needs every server's receiver count")
            if len(urls) > 1 and any(n is None for n in ranks):
                raise ValueError(
                    "every server of a several-server weight-sync group must report its receivers"
                )
            store = dist.TCPStore(
                self.address,
                0,
                None,
                True,
                timeout=datetime.timedelta(seconds=self.timeout_s),
                wait_for_workers=False,
            )
            self.fleet = _Fleet(token=secrets.token_hex(8), store=store, urls=tuple(urls), ranks=tuple(ranks))
        fleet = self.fleet
        assert fleet is not None
        return [
            CollectiveSpec(
                backend=self.backend,
                master_address=self.address,
                master_port=fleet.store.port,
                group=fleet.token,
                timeout_s=self.timeout_s,
                world_size=fleet.world_size,
                rank_offset=fleet.offset(index),
            )
            for index in range(len(urls))
        ]

    def connect(self, urls: Sequence[str], begins: Sequence[SyncBeginResponse]) -> None:
        """Forms the group the servers are joining now (once per group; it waits for every receiver of every
        server), or checks that every server still holds it.

        Raises:
            SyncError: a server lost the group it had joined (restarted), brings another number of receivers
                than it reported, or the rendezvous failed (the group is dropped: the next sync plans anew).
        """
        fleet = self.fleet
        assert fleet is not None and fleet.urls == tuple(urls), "specs() plans the group before the begins"
        for index, (url, begin) in enumerate(zip(urls, begins, strict=True)):
            if begin.collective_ranks < 1:
                self.drop()
                raise SyncError(
                    f"{url} answered a {self.backend} sync without receivers; is it a rollmatch server?"
                )
            expected = fleet.ranks[index]
            if expected is not None and begin.collective_ranks != expected:
                self.drop()
                raise SyncError(
                    f"{url} brings {begin.collective_ranks} weight-sync receivers, its /health said"
                    f" {expected} (restarted with another parallel size?); the next sync plans a new group"
                )
            if fleet.group is not None and begin.collective_joining:
                self.drop()
                raise SyncError(
                    f"{url} no longer holds weight-sync group {fleet.token} (restarted?); the next sync forms"
                    " a new group with every server"
                )
        if fleet.group is None:
            fleet.ranks = tuple(begin.collective_ranks for begin in begins)
            self._join(fleet)

    def start_broadcast(self, flat: torch.Tensor, index: int) -> list[Any]:
        """Enqueues one flat bucket's broadcast to the whole group (NCCL: asynchronous, on the group's own
        stream, ordered after the current stream's work); returns its work.

        Raises:
            SyncError: the group refused the broadcast at once (it is dropped).
        """
        group = self._group()
        try:
            return [group.broadcast(flat, 0, datetime.timedelta(seconds=self.timeout_s))]
        except Exception as exc:
            raise self._broadcast_failed(index, exc) from exc

    def finish(self, works: Sequence[Any], index: int) -> None:
        """Waits on the host, bounded by the timeout, until `works` (the last bucket's) are done.

        Raises:
            SyncError: the broadcast failed or did not complete in time (the group is dropped).
        """
        servers = self._servers()
        try:
            wait_works(works, self.timeout_s, [f"broadcast of bucket {index} to {servers}"] * len(works))
        except Exception as exc:
            self.drop()
            raise CollectiveError(
                f"{self.backend} broadcast failed ({type(exc).__name__}: {exc}); a server's receiver died or"
                " timed out"
            ) from exc

    def broadcast(self, flat: torch.Tensor, index: int) -> None:
        """Broadcasts one flat bucket to the whole group, waiting on the host (gloo).

        Raises:
            SyncError: the broadcast failed or timed out (the group is dropped).
        """
        group = self._group()
        try:
            group.broadcast(flat, 0, datetime.timedelta(seconds=self.timeout_s)).wait()
        except Exception as exc:
            raise self._broadcast_failed(index, exc, "; a server's receiver died or timed out") from exc

    def _broadcast_failed(self, index: int, exc: Exception, hint: str = "") -> CollectiveError:
        """The error of bucket `index`'s failed broadcast (the group is dropped)."""
        servers = self._servers()
        self.drop()
        return CollectiveError(
            f"{self.backend} broadcast of bucket {index} to {servers} failed ({type(exc).__name__}:"
            f" {exc}){hint}"
        )

    def drop(self) -> None:
        """Forgets the group (after a failure: the next sync plans a new one). The group object is retired,
        not torn down here: a broadcast to a dead server may still be pending in it (`retire_group`)."""
        fleet, self.fleet = self.fleet, None
        if fleet is not None:
            retire_group(fleet.group)

    def close(self) -> None:
        """Forgets the group."""
        self.fleet = None

    def _group(self) -> Any:
        if self.fleet is None or self.fleet.group is None:
            raise SyncError("no weight-sync group is formed (connect() runs after every server's begin)")
        return self.fleet.group

    def _servers(self) -> str:
        fleet = self.fleet
        if fleet is None:
            return "the servers"
        return f"{len(fleet.urls)} server(s) ({fleet.world_size} ranks: learner 0, {fleet.layout()})"

    def _join(self, fleet: _Fleet) -> None:
        import torch.distributed as dist

        world_size = fleet.world_size
        assert world_size is not None
        prefixed = dist.PrefixStore(fleet.token, fleet.store)
        try:  # blocks until every receiver of every server has joined, or the timeout
            fleet.group = process_group(self.backend, prefixed, 0, world_size, self.timeout_s, self.address)
        except Exception as exc:
            self.drop()
            raise CollectiveError(
                f"forming the {self.backend} weight-sync group of {len(fleet.urls)} server(s) ({world_size}"
                f" ranks: learner 0, {fleet.layout()}) at {self.address}:{fleet.store.port} failed"
                f" ({type(exc).__name__}: {exc}); every server must reach this address: set"
                " rollout.sync.collective_address to this host's address on the servers' network"
            ) from exc
        logger.info(
            "%s weight-sync group %s formed: %d ranks (learner 0, %s)",
            self.backend,
            fleet.token,
            world_size,
            fleet.layout(),
        )
