"""Body of `GET /health` (docs/ARCHITECTURE.md#health)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Health"]


class Health(BaseModel):
    """Server status; HTTP 200 only when `status == "ok"`, 503 otherwise (same body)."""

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    status: Literal["ok", "loading", "error"]
    """`loading` while the engine starts, `error` when it failed (see `detail`)."""
    engine: Literal["vllm", "hf"]
    """Backend."""
    model: str
    """Resolved local model directory."""
    weight_version: int = Field(ge=0)
    """Version of the weights served (0 = as loaded)."""
    dp: int = Field(ge=1)
    """Data-parallel engines behind this endpoint."""
    tp: int = Field(ge=1)
    """Tensor-parallel size per engine."""
    lora_enabled: bool
    """Whether adapter syncs are accepted (else the learner falls back to full syncs)."""
    max_model_len: int = Field(ge=1)
    """Prompt + new tokens limit."""
    dtype: str | None = None
    """Torch dtype name the weights are served in (`float32`, `bfloat16`, ...); a full sync must send it."""
    uptime_s: float = Field(ge=0.0)
    """Seconds since the server process started."""
    detail: str | None = None
    """Why the status is not `ok` (load failure message)."""
    collective_ranks: int | None = Field(default=None, ge=1)
    """Receivers this server brings into a `gloo`/`nccl` weight-sync group (every worker of every engine); the
    learner gives each server its block of ranks from it (`CollectiveSpec.rank_offset`). None while loading,
    or when the engine cannot receive over a collective transport."""
    gpu_uuids: list[str] = Field(default_factory=list)
    """CUDA device UUIDs the engine computes on (empty on CPU, and while loading); the learner refuses a
    `nccl` weight sync with a server on its own GPU (NCCL cannot put two ranks on one GPU)."""
