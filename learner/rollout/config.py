"""The learner's `rollout:` section (docs/ARCHITECTURE.md#rollout-source, #weight-sync;
docs/ALGORITHM.md#rollout): where rollouts come from (servers or a colocated engine), how they are decoded,
and overlapped rollouts.

Its sub-sections `sync` (`learner.weights.sync.SyncConfig`) and `decoding.repeat_terminate`
(`learner.rollout.repeat_guard`) live with the code they configure; `learner.config.RunConfig` holds this one.
"""

from __future__ import annotations

import re
from typing import Literal

from pydantic import ConfigDict, Field, field_validator, model_validator

from learner.rollout.repeat_guard import RepeatTerminateConfig
from learner.weights.sync import SyncConfig
from shared_schemas.config import ConfigSection

__all__ = ["AsyncRolloutConfig", "ColocateVllmConfig", "DecodingConfig", "RolloutConfig", "ServerEntry"]


class DecodingConfig(ConfigSection):
    """`rollout.decoding:` — decoding knobs shared by rollout-matching SFT and GRPO (§5.2)."""

    decode_mode: Literal["greedy", "beam"] = "greedy"
    """`beam` only with the hf backend."""
    max_new_tokens: int = Field(default=512, ge=1)
    """New tokens per rollout."""
    temperature: float = Field(default=0.0, ge=0.0)
    """0 → argmax."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    top_k: int = Field(default=-1, ge=-1)
    """-1 = off."""
    repetition_penalty: float = Field(default=1.0, gt=0.0)
    """1.05 recommended for dense data."""
    num_beams: int = Field(default=1, ge=1)
    """Beam mode only."""
    rollout_generate_batch_size: int = Field(default=1, ge=1)
    """Padded batch size of in-process (hf) generation per rank; server mode sends one call per step. The
    spec's 1 decodes the rows one at a time (a warning says so): set it to the rows per step on a GPU."""
    repeat_terminate: RepeatTerminateConfig = Field(default_factory=RepeatTerminateConfig)
    """Degenerate-rollout guard (§5.4)."""


class ServerEntry(ConfigSection):
    """One rollout server process (a DP server is ONE entry)."""

    base_url: str
    """`http(s)://host:port`; a trailing `/` is stripped."""

    @field_validator("base_url")
    @classmethod
    def _check_url(cls, value: str) -> str:
        value = value.rstrip("/")
        if not re.fullmatch(
            r"https?://[^/:]+(:\d{1,5})(/.*)?|https?://\[[0-9a-fA-F:]+\](:\d{1,5})(/.*)?", value
        ):
            raise ValueError(f"base_url {value!r} must look like http://host:port (the port is required)")
        return value


class ColocateVllmConfig(ConfigSection):
    """`rollout.vllm:` — colocate mode's in-process engine (§16); ignored (with a warning) in server mode."""

    gpu_memory_utilization: float = Field(default=0.45, gt=0.0, le=1.0)
    """Leaves room for training on the same GPU."""
    max_model_len: int | None = Field(default=None, ge=16)
    """≥ longest prompt + max_new_tokens; required in colocate mode."""
    tensor_parallel_size: int = Field(default=1, ge=1)
    """Divides the learner world size."""
    enable_prefix_caching: bool = True
    """Reset after every weight sync."""
    load_format: Literal["dummy", "auto"] | None = None
    """`dummy`: real weights arrive with the step-0 sync; `auto`: the engine reads the checkpoint. Default:
    dummy for text models, auto for Qwen-VL (vLLM's Qwen-VL vision tower holds state that is not in the
    checkpoint, e.g. Qwen3-VL's `visual.input_norm`, which dummy init randomizes and no sync can restore)."""
    infer_batch_size: int | None = Field(default=None, ge=1)
    """Chunk requests per generate call (caps multimodal prefill memory)."""
    enforce_eager: bool = False
    """True is the safe choice with multimodal models."""
    sleep_level: int = Field(default=0, ge=0, le=2)
    """> 0: sleep after each rollout, wake before the next (GPU only)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Engine dtype."""
    kv_cache_space_gb: float | None = Field(default=None, gt=0)
    """vLLM-CPU KV cache size (VLLM_CPU_KVCACHE_SPACE)."""
    weight_handoff: Literal["auto", "ipc", "bytes"] = "auto"
    """How a sync reaches the engine: `ipc` casts on the GPU and shares the buffer through CUDA IPC (learner
    and engine on one GPU, tensor_parallel_size 1); `bytes` casts on the host and sends safetensors bytes;
    `auto` is ipc where it runs, else bytes. `ipc` where it cannot run is refused at start."""


class AsyncRolloutConfig(ConfigSection):
    """`rollout.async:` — overlapped rollouts (server mode): the servers generate the next window while the
    learner trains on this one, from weights at most `max_staleness` optimizer steps old."""

    enabled: bool = False
    """After step v's sync commits, request the next window's rollouts in the background (same chunking and
    per-request seeds as a synchronous run) and train on the current window meanwhile. Server mode only."""
    max_staleness: int = Field(default=1, ge=1, le=16)
    """Most optimizer steps a trained rollout may lag the weights it updates; an older one is regenerated,
    never trained on. With the rollout buffer, the next E-step's window is requested at most this many steps
    ahead."""
    wait_timeout_s: float | None = Field(default=None, gt=0.0)
    """Longest wait for a background rollout once the step needs it (default: 4 x rollout.infer_timeout_s)."""


class RolloutConfig(ConfigSection):
    """`rollout:` — where rollouts come from and how weights reach them (docs/ARCHITECTURE.md#rollout-source,
    #weight-sync; docs/ALGORITHM.md#rollout)."""

    model_config = ConfigDict(
        extra="forbid",
        frozen=True,
        use_attribute_docstrings=True,
        validate_by_name=True,
        validate_by_alias=True,
        serialize_by_alias=True,
    )

    backend: Literal["vllm", "hf"] = "vllm"
    """Engine kind."""
    mode: Literal["colocate", "server"] = "colocate"
    """In-process engine, or rollout servers over HTTP."""
    servers: list[ServerEntry] = Field(default_factory=list)
    """Server mode: non-empty list of servers."""
    timeout_s: float = Field(default=240.0, gt=0.0)
    """Health wait at start-up (and connect timeout cap)."""
    infer_timeout_s: float | None = Field(default=None, gt=0.0)
    """Read timeout of one generate call (default: timeout_s)."""
    auth_token: str | None = None
    """Bearer token the servers require, if any."""
    sync: SyncConfig = Field(default_factory=SyncConfig)
    """Weight sync policy."""
    vllm: ColocateVllmConfig = Field(default_factory=ColocateVllmConfig)
    """Colocated engine knobs."""
    decoding: DecodingConfig = Field(default_factory=DecodingConfig)
    """Decoding knobs."""
    async_: AsyncRolloutConfig = Field(default_factory=AsyncRolloutConfig, alias="async")
    """Overlapped rollouts (YAML key `rollout.async`)."""

    @model_validator(mode="after")
    def _check(self) -> RolloutConfig:
        if self.async_.enabled and self.mode != "server":
            raise ValueError(
                f"rollout.async.enabled: true needs rollout.mode 'server', got {self.mode!r} (a colocated "
                "engine runs in the learner's own process and cannot generate while it trains); set "
                "rollout.async.enabled: false or use rollout.mode: server"
            )
        if self.mode == "server" and not self.servers:
            raise ValueError("rollout.servers must list at least one {base_url} in server mode")
        if self.decoding.decode_mode == "beam" and self.backend != "hf":
            raise ValueError("rollout.decoding.decode_mode 'beam' needs rollout.backend 'hf'")
        return self

    @property
    def read_timeout_s(self) -> float:
        """Effective read timeout of one generate call."""
        return self.infer_timeout_s if self.infer_timeout_s is not None else self.timeout_s

    @property
    def async_wait_timeout_s(self) -> float:
        """Effective limit of one wait for a background rollout (`rollout.async.wait_timeout_s`)."""
        wait = self.async_.wait_timeout_s
        return wait if wait is not None else 4.0 * self.read_timeout_s
