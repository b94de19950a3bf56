"""The ONE process-group builder of the collective weight transport (`rollout.sync.transport: gloo | nccl`),
used by both ends: the learner's sender (`learner.weights.group_send`) and the server's receivers
(`rollout_server.weights.group_receive.open_receiver_group`), with the bounded wait on a group's works and the
retirement of a group after a failed sync.

The group is a plain `torch.distributed` backend (`ProcessGroupGloo` on CPU hosts, `ProcessGroupNCCL` on
GPUs) over a `TCPStore` that the learner hosts, keyed by a group token; every collective has the sync's
timeout, so a vanished peer becomes an error instead of a hang. torch is imported when a group is built.
"""

from __future__ import annotations

import datetime
import os
import time
from collections.abc import Sequence
from typing import Any

__all__ = ["process_group", "retire_group", "wait_works"]

_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"


def process_group(
    backend: str, store: Any, rank: int, world_size: int, timeout_s: float, hostname: str
) -> Any:
    """A `ProcessGroupGloo` / `ProcessGroupNCCL` over `store` — the one builder both ends use.

    torch has no public constructor that sets both a gloo group's interface and its timeout, so the backend
    options (private attributes) are set here and nowhere else.

    Args:
        backend: `gloo` or `nccl`.
        store: the rendezvous store (already prefixed with the group token).
        rank: this process's rank (learner 0).
        world_size: learner + every receiver of every server.
        timeout_s: limit of the rendezvous and of each collective.
        hostname: gloo only: the local address the peers reach this process on.
    """
    import torch.distributed as dist

    timeout = datetime.timedelta(seconds=timeout_s)
    if backend == "gloo":
        options = dist.ProcessGroupGloo._Options()
        options._timeout = timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=hostname)]
        return dist.ProcessGroupGloo(store, rank, world_size, options)
    if backend == "nccl":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        # A peer that dies mid-sync must fail the sync, not the process: unless the user chose otherwise, this
        # group's watchdog aborts its communicator on a timeout and leaves the process running (torch's
        # default, 3, tears the process down — the learner's training run, or the server that still serves).
        previous = os.environ.get(_NCCL_ERROR_HANDLING)
        if previous is None:
            os.environ[_NCCL_ERROR_HANDLING] = "2"
        try:
            return dist.ProcessGroupNCCL(store, rank, world_size, options)
        finally:
            if previous is None:
                os.environ.pop(_NCCL_ERROR_HANDLING, None)
    raise ValueError(f"collective backend must be 'gloo' or 'nccl', got {backend!r}")


_RETIRED: list[Any] = []


def retire_group(group: Any) -> None:
    """Forgets a group after a FAILED sync without destroying it here: its communicator may still hold a
    broadcast that will never complete (the peer died), and tearing it down from a Python thread can block
    that thread — with the interpreter's lock held — until the communicator's watchdog has aborted it. The
    group's own watchdog aborts the communicator after its timeout; the object is kept until the process
    exits."""
    if group is not None:
        _RETIRED.append(group)


def wait_works(works: Sequence[Any], timeout_s: float, what: Sequence[str]) -> None:
    """Waits on the host, bounded, until every work (NCCL: asynchronous) has completed.

    Raises:
        TimeoutError: `what[i]` of the first work still running after `timeout_s`.
    """
    deadline = time.monotonic() + timeout_s
    pause = 0.0002
    for work, name in zip(works, what, strict=True):
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not complete within {timeout_s:.0f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.01)
        work.wait()  # raises the collective's own error, if any
