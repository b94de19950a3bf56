"""The receiving end of the collective weight transport (`rollout.sync.transport: gloo | nccl`): joining the
learner's group (`open_receiver_group`, over the ONE process-group builder both ends use,
`shared_schemas.torch_common.process_group`) and the ONE receive function (`receive_buckets`, used by the HF
engine in the server process and by every vLLM worker through `vllm.transfer`).

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
import socket
import threading
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Any, Literal

from shared_schemas.torch_common.process_group import process_group, wait_works

__all__ = [
    "STAGING_MARGIN",
    "ReceivedTensors",
    "ReceiveResult",
    "local_address_towards",
    "open_receiver_group",
    "receive_buckets",
    "resolve_staging",
]

ReceivedTensors = list[tuple[str, Any]]
"""`(checkpoint name, tensor)` pairs, views of the flattened buckets received."""

Staging = Literal["auto", "device", "host"]

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
