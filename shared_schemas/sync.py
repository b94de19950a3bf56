"""Wire models of the weight sync (docs/ARCHITECTURE.md#sync-weights).

A sync is `begin(manifest)` → one upload per bucket → `commit` (or `abort`). Buckets are safetensors files of
bounded size, sent either as the HTTP body (`PUT {BUCKET_PATH}`, `application/octet-stream`) or, on the same
host, as the NAME of a file the learner wrote into the server's staging directory (`POST {BUCKET_SHM_PATH}`
with a `ShmBucketRef`). Nothing is applied before `commit`, and a rejected or abandoned sync applies nothing.

Routes (`{sync_id}` from `SyncBeginResponse`, `{index}` the bucket's index in the manifest):

| phase | method and path | body → response |
|---|---|---|
| begin | `POST /sync_weights/begin` | `SyncBeginRequest` → `SyncBeginResponse` |
| bucket (HTTP) | `PUT /sync_weights/{sync_id}/buckets/{index}` | safetensors bytes → `BucketAck` |
| bucket (shm) | `POST /sync_weights/{sync_id}/buckets/{index}/shm` | `ShmBucketRef` → `BucketAck` |
| prepare (optional) | `POST /sync_weights/prepare` | `SyncPrepareRequest` → `SyncPrepareResponse` |
| commit | `POST /sync_weights/commit` | `SyncCommitRequest` → `SyncCommitResponse` |
| abort | `POST /sync_weights/abort` | `SyncAbortRequest` → `SyncAbortResponse` |

With `SyncBeginRequest.collective` the bucket phase is not HTTP at all: one broadcast per bucket over the
learner's process group (`CollectiveSpec`), between begin and commit. ONE group spans the learner and every
receiver of every server of the sync (the learner assigns each server its ranks), so each bucket is one
broadcast whatever the number of servers; `prepare` then tells the learner that a server holds every bucket,
and the learner commits no server before every server has answered it (a server that died mid-broadcast
leaves every server on its old weights).
"""

from __future__ import annotations

import math
from typing import Any, Literal, get_args

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

__all__ = [
    "BUCKET_PATH",
    "BUCKET_SHM_PATH",
    "COLLECTIVE_BACKENDS",
    "DTYPE_NBYTES",
    "SYNC_ABORT_PATH",
    "SYNC_BEGIN_PATH",
    "SYNC_COMMIT_PATH",
    "SYNC_PREPARE_PATH",
    "BucketAck",
    "BucketSpec",
    "CollectiveSpec",
    "ShmBucketRef",
    "SyncAbortRequest",
    "SyncAbortResponse",
    "SyncBeginRequest",
    "SyncBeginResponse",
    "SyncCommitRequest",
    "SyncCommitResponse",
    "SyncManifest",
    "SyncPrepareRequest",
    "SyncPrepareResponse",
    "TRANSPORT_NAMES",
    "CollectiveBackend",
    "TensorSpec",
    "TransportName",
]

CollectiveBackend = Literal["gloo", "nccl"]
"""The collective transports: one process group over the learner and every server (`gloo` on CPU hosts,
`nccl` on GPUs)."""
TransportName = Literal["http", "shm", CollectiveBackend]
"""Every weight-sync transport (`rollout.sync.transport`), spelled here only: the learner's config, transports
and report, the server's receivers and the begin request's collective backend all use these names."""
TRANSPORT_NAMES: tuple[str, ...] = get_args(TransportName)
"""`TransportName`'s names, in order (registries accept these only)."""
COLLECTIVE_BACKENDS: tuple[str, ...] = get_args(CollectiveBackend)
"""`CollectiveBackend`'s names."""

SYNC_BEGIN_PATH = "/sync_weights/begin"
BUCKET_PATH = "/sync_weights/{sync_id}/buckets/{index}"
BUCKET_SHM_PATH = "/sync_weights/{sync_id}/buckets/{index}/shm"
SYNC_COMMIT_PATH = "/sync_weights/commit"
SYNC_PREPARE_PATH = "/sync_weights/prepare"
SYNC_ABORT_PATH = "/sync_weights/abort"

DTYPE_NBYTES: dict[str, int] = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}
"""Bytes per element of each safetensors dtype code accepted on the wire."""

_SYNC_ID = r"^[0-9a-f]{8,64}$"


def _nbytes(dtype: str, shape: tuple[int, ...]) -> int:
    return DTYPE_NBYTES[dtype] * math.prod(shape)


class TensorSpec(BaseModel):
    """Name, safetensors dtype code and shape of one tensor."""

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    name: str = Field(min_length=1, max_length=1024)
    """Parameter name (base-model names for full syncs, PEFT key names for adapters)."""
    dtype: str
    """safetensors dtype code: one of `DTYPE_NBYTES` (`F32`, `BF16`, `F16`, …)."""
    shape: tuple[int, ...]
    """Dimensions (each >= 0); `()` is a scalar."""

    @field_validator("dtype")
    @classmethod
    def _known_dtype(cls, value: str) -> str:
        if value not in DTYPE_NBYTES:
            raise ValueError(f"unknown dtype {value!r}; use a safetensors code: {', '.join(DTYPE_NBYTES)}")
        return value

    @field_validator("shape")
    @classmethod
    def _non_negative(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if any(d < 0 for d in value):
            raise ValueError(f"shape {list(value)} has a negative dimension")
        return value

    @property
    def nbytes(self) -> int:
        """Raw data size in bytes."""
        return _nbytes(self.dtype, self.shape)


class BucketSpec(BaseModel):
    """One bucket of the manifest: the tensors its safetensors file holds, in order."""

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    index: int = Field(ge=0)
    """Position in the manifest (0-based, contiguous)."""
    tensors: tuple[TensorSpec, ...] = Field(min_length=1)
    """Tensors of this bucket."""
    nbytes: int = Field(ge=0)
    """Sum of the tensors' raw data sizes (the safetensors header is extra)."""

    @model_validator(mode="after")
    def _check(self) -> BucketSpec:
        total = sum(t.nbytes for t in self.tensors)
        if total != self.nbytes:
            raise ValueError(f"bucket {self.index}: nbytes {self.nbytes} != sum of tensor sizes {total}")
        names = [t.name for t in self.tensors]
        if len(set(names)) != len(names):
            raise ValueError(f"bucket {self.index} lists a tensor name twice")
        return self


class SyncManifest(BaseModel):
    """Everything a sync will send, declared up front so the server validates before any byte arrives."""

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    mode: Literal["full", "adapter"]
    """`full`: merged base-model weights; `adapter`: a PEFT adapter served as a LoRA."""
    version: int = Field(ge=1)
    """Target weight version; must be greater than the server's current version."""
    buckets: tuple[BucketSpec, ...] = Field(min_length=1)
    """Buckets in upload order; indices 0..len-1."""
    adapter_name: str | None = Field(default=None, min_length=1, max_length=128)
    """Adapter mode: the name requests will use in `request_config.adapter`."""
    adapter_config: dict[str, Any] | None = None
    """Adapter mode: the PEFT `adapter_config.json` content."""

    @model_validator(mode="after")
    def _check(self) -> SyncManifest:
        indices = [b.index for b in self.buckets]
        if indices != list(range(len(self.buckets))):
            raise ValueError(f"bucket indices must be 0..{len(self.buckets) - 1} in order")
        seen: set[str] = set()
        for bucket in self.buckets:
            for tensor in bucket.tensors:
                if tensor.name in seen:
                    raise ValueError(f"tensor {tensor.name!r} appears in more than one bucket")
                seen.add(tensor.name)
        if self.mode == "adapter" and (self.adapter_name is None or self.adapter_config is None):
            raise ValueError("mode 'adapter' needs adapter_name and adapter_config")
        if self.mode == "full" and (self.adapter_name is not None or self.adapter_config is not None):
            raise ValueError("mode 'full' takes no adapter_name or adapter_config")
        return self

    @property
    def tensors(self) -> list[TensorSpec]:
        """Every tensor of every bucket, in order."""
        return [t for b in self.buckets for t in b.tensors]

    @property
    def nbytes(self) -> int:
        """Total raw data size in bytes."""
        return sum(b.nbytes for b in self.buckets)


class CollectiveSpec(BaseModel):
    """Collective transport of a full sync: the bytes travel over a process group the learner hosts, not HTTP.

    ONE group spans the learner (rank 0, the only sender) and every receiver of every server of the sync
    (every worker of every engine): the learner asks each server how many receivers it has
    (`Health.collective_ranks`) and gives each server a contiguous block of ranks, `rank_offset` ...
    `rank_offset + n - 1`, in the order of its `rollout.servers`; `world_size` is 1 + every server's
    receivers. Each manifest bucket is then ONE broadcast from rank 0 to the whole group of its tensors' raw
    bytes back to back, in manifest order (exactly `BucketSpec.nbytes`, no header), so the learner's link
    carries one copy of the weights whatever the number of servers. A server keeps its group for the next sync
    that names the same `group`.

    Without `world_size` (one server, or a learner that predates fleet groups) the group is this server alone:
    its receivers are ranks 1..n of a world of n + 1.
    """

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    backend: CollectiveBackend
    """`gloo` (CPU hosts) or `nccl` (GPUs)."""
    master_address: str = Field(min_length=1, max_length=255)
    """Address of the learner's rendezvous store, as the server reaches it."""
    master_port: int = Field(ge=1, le=65_535)
    """Port of the learner's rendezvous store."""
    group: str = Field(pattern=r"^[0-9a-f]{8,64}$")
    """Group token: the same token reuses the group joined by an earlier sync, a new one joins anew."""
    timeout_s: float = Field(default=120.0, gt=0, le=3_600)
    """Limit of the rendezvous and of each broadcast; a peer silent for longer fails the sync."""
    world_size: int | None = Field(default=None, ge=2, le=65_536)
    """Ranks of the whole group: the learner + every receiver of every server (None: 1 + this server's)."""
    rank_offset: int = Field(default=1, ge=1, le=65_535)
    """Rank of this server's first receiver; its n receivers are `rank_offset` ... `rank_offset + n - 1`."""

    @model_validator(mode="after")
    def _ranks_fit(self) -> CollectiveSpec:
        if self.world_size is not None and self.rank_offset >= self.world_size:
            raise ValueError(
                f"rank_offset {self.rank_offset} is outside a group of world_size {self.world_size}"
                " (rank 0 is the learner; receivers are 1 .. world_size - 1)"
            )
        return self


class SyncBeginRequest(BaseModel):
    """Opens a sync. A new begin supersedes (aborts) a sync still staged on the server."""

    model_config = ConfigDict(extra="ignore")

    manifest: SyncManifest
    timeout_s: float | None = Field(default=None, gt=0, le=86_400)
    """Idle seconds after which the staged sync is discarded (server default when None)."""
    collective: CollectiveSpec | None = None
    """Send the buckets over a collective group instead of HTTP/shm (full syncs only)."""


class SyncBeginResponse(BaseModel):
    """The id every later phase names."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sync_id: str = Field(pattern=_SYNC_ID)
    current_version: int = Field(ge=0)
    num_buckets: int = Field(ge=1)
    expires_in_s: float = Field(gt=0)
    collective_ranks: int = Field(default=0, ge=0)
    """Collective syncs: how many receivers of this server are in the group (ranks `rank_offset` onwards)."""
    collective_joining: bool = False
    """Collective syncs: the server joins the group now (a new token, or it lost the previous group); when
    False it reuses the group it joined before under the same token."""


class ShmBucketRef(BaseModel):
    """A bucket written by the learner into the server's staging directory, named by file NAME only."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    file_name: str = Field(min_length=1, max_length=255)
    """Plain file name inside `server.shm_dir` (no directory part, no `..`)."""

    @field_validator("file_name")
    @classmethod
    def _plain_name(cls, value: str) -> str:
        if "/" in value or "\\" in value or "\x00" in value or value in {".", ".."}:
            raise ValueError("file_name must be a plain file name inside the staging dir, not a path")
        return value


class BucketAck(BaseModel):
    """A bucket was received and matches the manifest."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sync_id: str
    index: int = Field(ge=0)
    received: int = Field(ge=0)
    """Buckets received so far."""
    expected: int = Field(ge=1)
    """Buckets in the manifest."""


class SyncCommitRequest(BaseModel):
    """Applies a fully received sync atomically."""

    model_config = ConfigDict(extra="ignore")

    sync_id: str = Field(pattern=_SYNC_ID)


class SyncPrepareRequest(SyncCommitRequest):
    """Asks whether a staged sync holds every bucket (collective: waits until its receive has finished)."""


class SyncPrepareResponse(BaseModel):
    """Every bucket is in and matches the manifest: the commit will only apply (nothing left to receive)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sync_id: str
    received: int = Field(ge=0)
    """Buckets received."""
    receive_s: float = Field(ge=0)
    """Collective syncs: seconds the prepare waited for the receive to finish."""


class SyncCommitResponse(BaseModel):
    """The update is live: every later generation uses `weight_version`."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sync_id: str
    mode: Literal["full", "adapter"]
    weight_version: int = Field(ge=0)
    num_tensors: int = Field(ge=0)
    nbytes: int = Field(ge=0)
    apply_s: float = Field(ge=0)
    """Seconds spent in the engine's apply."""
    stages: dict[str, float] = Field(default_factory=dict)
    """Server-side seconds per stage of this sync (`receive_s`: bucket bytes in and checked; `apply_s`; and
    the engine's own split when it reports one, e.g. `workers_stage_s`, `load_s`), for profiling."""


class SyncAbortRequest(BaseModel):
    """Discards a staged sync."""

    model_config = ConfigDict(extra="ignore")

    sync_id: str = Field(pattern=_SYNC_ID)


class SyncAbortResponse(BaseModel):
    """`aborted` is False when no such sync was staged (aborting is idempotent)."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    sync_id: str
    aborted: bool
