"""Both ends of the collective weight transport (`rollout.sync.transport: gloo | nccl`): the ONE process-group
builder (`process_group`, used by the learner's sender too) and the ONE receive function (`receive_buckets`,
used by the HF engine in the server process and by every vLLM worker through `vllm.transfer`).

The learner's rank 0 and the receivers of EVERY server of the sync form ONE process group (learner = rank 0;
each server's receivers — every TP worker of every DP engine — a block of ranks the learner assigns at
`begin`: `CollectiveSpec.rank_offset` onwards, in a group of `world_size`). HTTP carries only the control
(`begin` with the manifest and the rendezvous, `prepare`, `commit`/`abort`, the version); the bytes of each
manifest bucket travel as ONE flattened `uint8` broadcast from rank 0 to the whole group, whatever the number
of servers — the bucket's tensors back to back in manifest order, exactly `BucketSpec.nbytes` long, no header
(the manifest, validated at `begin`, is the header).

Receivers STAGE what they receive: it is loaded only at the sync's commit, so a learner that dies
mid-broadcast leaves the served weights untouched. Where the staged copy lives is `server.sync_staging`:
`device` keeps every received bucket in GPU memory (one model's worth, the commit is a device-to-device copy),
`host` receives into two reused GPU buffers and moves each bucket to pinned host memory (two buckets of GPU
memory; the commit copies host to device); `auto` picks `device` when the GPU has room for the model plus a
margin. On NCCL nothing inside the receive loop waits on the host: broadcasts and host copies are ordered on a
CUDA stream of their own, and only the end waits (bounded by the sync's timeout) for the last broadcast.

The group is a plain `torch.distributed` backend (`ProcessGroupGloo` on CPU hosts, `ProcessGroupNCCL` on
GPUs) over a `TCPStore` that the learner hosts, keyed by a group token; every collective has the sync's
timeout, so a vanished peer becomes an error naming the learner's address instead of a hang.
"""

from __future__ import annotations

import datetime
import math
import os
import socket
import threading
import time
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

__all__ = [
    "STAGING_MARGIN",
    "ReceivedTensors",
    "ReceiveResult",
    "local_address_towards",
    "open_receiver_group",
    "process_group",
    "receive_buckets",
    "resolve_staging",
    "retire_group",
    "wait_works",
]

ReceivedTensors = list[tuple[str, Any]]
"""`(checkpoint name, tensor)` pairs, views of the flattened buckets received."""

Staging = Literal["auto", "device", "host"]

_NCCL_ERROR_HANDLING = "TORCH_NCCL_ASYNC_ERROR_HANDLING"

STAGING_MARGIN = 1.25
"""`auto` staging keeps the received model on the GPU only when free memory exceeds its bytes by this factor
plus 1 GiB (room left for the engine's activations while the staged copy waits for the commit)."""


def local_address_towards(address: str, port: int) -> str:
    """The local interface address that routes to `address` (what the learner can reach us on)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        try:
            probe.connect((address, port))  # UDP: no packet is sent, only the route is looked up
            return probe.getsockname()[0]
        except OSError:
            return "127.0.0.1"


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
        return process_group(
            backend,
            dist.PrefixStore(group, store),
            rank,
            world_size,
            rendezvous.timeout_s,
            local_address_towards(master_address, master_port),
        )
    except Exception as exc:
        raise RuntimeError(
            f"joining the learner's {backend} weight-sync group at {master_address}:{master_port}"
            f" as rank {rank} of {world_size} failed ({type(exc).__name__}: {exc}); check that this"
            " server can reach the learner's rollout.sync.collective_address and that the learner is"
            " still running"
        ) from exc


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


def resolve_staging(staging: str, device: Any, nbytes: int) -> Literal["device", "host"]:
    """`device` or `host` for a sync of `nbytes` received on `device` (`auto`: device when it fits)."""
    import torch

    device = torch.device(device)
    if device.type == "cpu":
        return "host"  # gloo on a CPU host: the received buffers are host memory already
    if staging in ("device", "host"):
        return staging  # type: ignore[return-value]
    free, _ = torch.cuda.mem_get_info(device)
    return "device" if free > nbytes * STAGING_MARGIN + 2**30 else "host"


@dataclass
class ReceiveResult:
    """What `receive_buckets` staged."""

    tensors: ReceivedTensors = field(default_factory=list)
    """`(name, tensor)` in manifest order, views of the staged buckets."""
    staging: Literal["device", "host"] = "device"
    """Where the staged buckets live."""
    staged_bytes: int = 0
    """Bytes of staged buckets (the sync's tensor bytes)."""
    buffers: list[Any] = field(default_factory=list)
    """`device` staging: the flat bucket buffers the tensors view, in manifest order (reusable by the next
    sync once nothing references them: `reuse`)."""
    device_buffer_bytes: int = 0
    """GPU memory held while receiving beyond the staged buckets (`host` staging: the two receive buffers)."""

    @property
    def stages(self) -> dict[str, float]:
        """The figures for a sync's `stages` (bytes as numbers)."""
        device = self.staged_bytes if self.staging == "device" else self.device_buffer_bytes
        host = self.staged_bytes if self.staging == "host" else 0
        return {"staging_device_bytes": float(device), "staging_host_bytes": float(host)}


def receive_buckets(
    group: Any,
    buckets: Sequence[Sequence[tuple[str, str, Sequence[int]]]],
    *,
    device: Any,
    timeout_s: float,
    staging: str = "device",
    reuse: Sequence[Any] = (),
) -> ReceiveResult:
    """Receives one flattened broadcast per bucket from rank 0 and stages it as tensor views.

    On a GPU every broadcast lands in device memory. `device` staging keeps each bucket in its own buffer;
    `host` staging receives into two alternating device buffers and copies each bucket out to pinned host
    memory (the copy of bucket k is ordered before the broadcast of bucket k + 2 into the same buffer). No
    host wait happens inside the loop; the end waits (bounded by `timeout_s`) for the last broadcast and copy.

    Args:
        group: the process group from `open_receiver_group`.
        buckets: per bucket, its tensors as `(name, safetensors dtype code, shape)` in manifest order.
        device: where the broadcasts land (the worker's device; `cpu` for gloo).
        timeout_s: limit of each broadcast (and of the final wait).
        staging: `device`, `host` or `auto` (see `resolve_staging`).
        reuse: `device` staging: buffers of an earlier sync that nothing reads any more (bucket k is received
            into `reuse[k]` when its size and device match, instead of a new allocation).

    Raises:
        RuntimeError: a broadcast failed or timed out (the learner died, or aborted the sync).
    """
    import torch

    from shared_schemas.buckets import DTYPE_NAMES

    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    timeout = datetime.timedelta(seconds=timeout_s)
    layouts = []
    for tensors in buckets:
        specs = [(name, getattr(torch, DTYPE_NAMES[code]), tuple(shape)) for name, code, shape in tensors]
        layouts.append((specs, [math.prod(shape) * dtype.itemsize for _, dtype, shape in specs]))
    total = sum(sum(sizes) for _, sizes in layouts)
    where = resolve_staging(staging, device, total)
    result = ReceiveResult(staging=where, staged_bytes=total)
    gpu = device.type == "cuda"
    to_host = gpu and where == "host"
    ring: list[Any] = []
    if to_host:
        widest = max((sum(sizes) for _, sizes in layouts), default=0)
        ring = [torch.empty(widest, dtype=torch.uint8, device=device) for _ in range(min(2, len(layouts)))]
        result.device_buffer_bytes = widest * len(ring)
    stream = _receive_stream(device) if gpu else None
    last: Any = None
    index = 0
    try:
        with torch.cuda.stream(stream) if gpu else nullcontext():
            for index, (specs, sizes) in enumerate(layouts):
                nbytes = sum(sizes)
                if to_host:
                    flat = ring[index % 2][:nbytes]
                elif index < len(reuse) and reuse[index].numel() == nbytes and reuse[index].device == device:
                    flat = reuse[index]
                else:
                    flat = torch.empty(nbytes, dtype=torch.uint8, device=device)
                last = group.broadcast(flat, 0, timeout)
                if gpu:
                    last.wait()  # the stream waits for the broadcast; the host goes on
                else:
                    last.wait(timeout)
                staged = flat
                if not to_host:
                    result.buffers.append(flat)
                if to_host:
                    staged = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
                    staged.copy_(flat, non_blocking=True)
                offset = 0
                for (name, dtype, shape), size in zip(specs, sizes, strict=True):
                    raw = staged[offset : offset + size]
                    if offset % dtype.itemsize:
                        raw = raw.clone()  # unaligned for its dtype: one copy of this tensor only
                    result.tensors.append((name, raw.view(dtype).reshape(shape)))
                    offset += size
        if gpu and last is not None:
            wait_works([last], timeout_s, [f"bucket {len(layouts) - 1}"])
            stream.synchronize()  # the host copies too; the staged tensors are whole from here on
    except Exception as exc:
        if gpu:
            _retire_stream(device)
        raise RuntimeError(
            f"receiving bucket {index} of {len(layouts)} from the learner failed ({type(exc).__name__}:"
            f" {exc}); the learner stopped sending (died, timed out or aborted the sync)"
        ) from exc
    return result


_STREAMS: dict[int, Any] = {}
_STREAMS_LOCK = threading.Lock()


def _retire_stream(device: Any) -> None:
    """Drops the device's receive stream after a failed receive: it waits on a broadcast that may never
    complete (the learner died mid-bucket), and a later sync's broadcasts, ordered after the stream's work,
    would wait behind it until the dead group's watchdog aborts it. The next sync gets a fresh stream."""
    with _STREAMS_LOCK:
        _STREAMS.pop(device.index, None)


def _receive_stream(device: Any) -> Any:
    """One receive stream per GPU for the process's life: staged buffers freed after a commit go back to this
    stream's pool, so the next sync reuses them instead of reserving a second model's worth."""
    import torch

    index = device.index if device.index is not None else torch.cuda.current_device()
    with _STREAMS_LOCK:
        if index not in _STREAMS:
            _STREAMS[index] = torch.cuda.Stream(torch.device("cuda", index))
        return _STREAMS[index]
