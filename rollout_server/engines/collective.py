"""Receiving side of the collective weight transport (`rollout.sync.transport: gloo | nccl`).

The learner's rank 0 and the receivers of ONE server form a process group of their own (learner = rank 0,
receivers = ranks 1..n: every TP worker of every DP engine of that server). HTTP carries only the control
(`begin` with the manifest and the rendezvous, `commit`/`abort`, the version); the bytes of each manifest
bucket travel as one flattened `uint8` broadcast from rank 0 — the bucket's tensors back to back in manifest
order, exactly `BucketSpec.nbytes` long, no header (the manifest, validated at `begin`, is the header).

The vLLM engine receives in its workers through vLLM's weight-transfer API (`vllm_transfer`); the HF engine
receives in the server process. Both call the two functions here, and both STAGE what they receive: it is
loaded only at the sync's commit, so a learner that dies mid-broadcast leaves the served weights untouched.

The group is a plain `torch.distributed` backend (`ProcessGroupGloo` on CPU hosts, `ProcessGroupNCCL` on
GPUs) over a `TCPStore` that the learner hosts, keyed by a group token; every collective has the sync's
timeout, so a vanished peer becomes an error naming the learner's address instead of a hang.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Sequence
from typing import Any

__all__ = [
    "ReceivedTensors",
    "local_address_towards",
    "open_receiver_group",
    "receive_buckets",
]

ReceivedTensors = list[tuple[str, Any]]
"""`(checkpoint name, tensor)` pairs, views of the flattened buckets received."""


def local_address_towards(address: str, port: int) -> str:
    """The local interface address that routes to `address` (what the learner can reach us on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, port))  # UDP: no packet is sent, only the route is looked up
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


def open_receiver_group(rendezvous: Any, rank: int) -> Any:
    """Joins the learner's group as `rank` (>= 1); blocks until every member has joined or the timeout.

    Args:
        rendezvous: `backend`, `master_address`, `master_port`, `group`, `world_size` and `timeout_s` as
            attributes (`engines.base.Rendezvous`, or the vLLM engine's init info).
        rank: this receiver's rank in the group.

    Raises:
        RuntimeError: the rendezvous failed or timed out (names the learner's address).
    """
    import torch.distributed as dist

    backend, master_address, master_port = (
        rendezvous.backend,
        rendezvous.master_address,
        rendezvous.master_port,
    )
    world_size, group = rendezvous.world_size, rendezvous.group
    timeout = datetime.timedelta(seconds=rendezvous.timeout_s)
    try:
        store = dist.TCPStore(
            master_address, master_port, None, False, timeout=timeout, wait_for_workers=False
        )
        prefixed = dist.PrefixStore(group, store)
        if backend == "gloo":
            options = dist.ProcessGroupGloo._Options()
            options._timeout = timeout
            options._devices = [
                dist.ProcessGroupGloo.create_device(
                    hostname=local_address_towards(master_address, master_port)
                )
            ]
            return dist.ProcessGroupGloo(prefixed, rank, world_size, options)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        return dist.ProcessGroupNCCL(prefixed, rank, world_size, options)
    except Exception as exc:
        raise RuntimeError(
            f"joining the learner's {backend} weight-sync group at {master_address}:{master_port} as rank {rank}"
            f" of {world_size} failed ({type(exc).__name__}: {exc}); check that this server can reach the"
            " learner's rollout.sync.collective_address and that the learner is still running"
        ) from exc


def receive_buckets(
    group: Any, buckets: Sequence[Sequence[tuple[str, str, Sequence[int]]]], *, device: Any, timeout_s: float
) -> ReceivedTensors:
    """Receives one flattened broadcast per bucket from rank 0 and splits it into tensor views.

    Args:
        group: the process group from `open_receiver_group`.
        buckets: per bucket, its tensors as `(name, safetensors dtype code, shape)` in manifest order.
        device: where the buffers live (the worker's device).
        timeout_s: per-broadcast limit.

    Raises:
        RuntimeError: a broadcast failed or timed out (the learner died, or aborted the sync).
    """
    import math

    import torch

    from shared_schemas.buckets import DTYPE_NAMES

    timeout = datetime.timedelta(seconds=timeout_s)
    received: ReceivedTensors = []
    for index, tensors in enumerate(buckets):
        specs = [(name, getattr(torch, DTYPE_NAMES[code]), tuple(shape)) for name, code, shape in tensors]
        sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
        try:
            group.broadcast(flat, 0, timeout).wait()
        except Exception as exc:
            raise RuntimeError(
                f"receiving bucket {index} of {len(buckets)} from the learner failed ({type(exc).__name__}:"
                f" {exc}); the learner stopped sending (died, timed out or aborted the sync)"
            ) from exc
        offset = 0
        for (name, dtype, shape), size in zip(specs, sizes, strict=True):
            raw = flat[offset : offset + size]
            if offset % dtype.itemsize:
                raw = raw.clone()  # unaligned for its dtype: one copy of this tensor only
            received.append((name, raw.view(dtype).reshape(shape)))
            offset += size
    return received
