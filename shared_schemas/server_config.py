"""The `server:` section of a run YAML, its one schema: the rollout server's configuration
(docs/ARCHITECTURE.md#configuration, docs/ALGORITHM.md#grpo-config GRPO §2.2).

The rollout server validates its process with it (`rollout_server.config` re-exports it); a GRPO learner
validates the same section with the same models and adds only its cross-section rules
(`learner.grpo.config`). A file holding a whole run (a `server:` section next to learner sections) is read by
taking ONLY its `server:` section; a file without a `server:` key is a server section by itself. Unknown keys
are errors naming the file that set them and the dotted key.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, SecretStr, ValidationError, model_validator

from shared_schemas.config import (
    REPO_ROOT,
    ConfigError,
    ConfigSection,
    GpuList,
    Provenance,
    format_validation_error,
    is_loopback,
    load_yaml_tree,
    rule_error,
)

__all__ = [
    "HfServerConfig",
    "ServerConfig",
    "VllmServerConfig",
    "load_server_config",
    "server_config_from_mapping",
]


class VllmServerConfig(ConfigSection):
    """`server.vllm`: engine knobs (names as vLLM's `EngineArgs`)."""

    tensor_parallel_size: int = Field(default=1, ge=1)
    """GPUs per engine."""
    data_parallel_size: int = Field(default=1, ge=1)
    """Engine replicas behind one endpoint (requests are chunked over them in order)."""
    gpu_memory_utilization: float = Field(default=0.6, gt=0.0, le=1.0)
    """Fraction of each GPU's memory vLLM may use."""
    max_model_len: int = Field(default=8192, ge=16)
    """Prompt + new tokens limit (also used by the HF backend)."""
    enable_lora: bool = False
    """Serve synced adapters as LoRA; when off, adapter syncs are refused with 409 `lora_disabled`."""
    max_lora_rank: int = Field(default=16, ge=1)
    """Largest adapter rank accepted when `enable_lora` is true."""
    max_loras: int = Field(default=1, ge=1)
    """Adapters resident at once."""
    enable_prefix_caching: bool = True
    """Prefix cache (reset after every weight sync)."""
    enforce_eager: bool = False
    """Disable CUDA graphs / compilation (true on CPU for fast start)."""
    limit_mm_per_prompt: dict[str, int] | None = None
    """e.g. `{image: 1, video: 0}` (no video profiling)."""
    mm_processor_kwargs: dict[str, Any] | None = None
    """e.g. `{do_resize: false}` to keep image-token counts identical to the learner (also passed to the HF
    backend's processor)."""
    mm_processor_cache_gb: float | None = Field(default=None, ge=0.0)
    """Multimodal processor cache size."""
    max_num_seqs: int | None = Field(default=None, ge=1)
    """Concurrent sequences per engine."""
    max_num_batched_tokens: int | None = Field(default=None, ge=1)
    """Tokens per engine step (null: vLLM's default; on CPU max(4096, max_model_len), and at least
    max_model_len there, since the CPU server never prefills in chunks: see `engines/vllm/params.py`)."""
    kv_cache_space_gb: int | None = Field(default=None, ge=1)
    """CPU backend only: KV cache GiB (exported as `VLLM_CPU_KVCACHE_SPACE` by `__main__`/launcher)."""
    disable_custom_all_reduce: bool | None = None
    """Passed through to vLLM when set."""
    disable_cascade_attn: bool | None = None
    """Passed through to vLLM when set."""
    quantization: str | None = None
    """Passed through to vLLM when set."""
    startup_timeout_s: float = Field(default=900.0, gt=0.0, le=7200.0)
    """Seconds the engine may take to start (weights, torch.compile, CUDA graphs; a first compile of a large
    model takes longest); past it the server exits with an error naming the stage reached and the fixes,
    instead of waiting for ever. Measured start-ups: bench/RESULTS.md, "the vLLM backend on GPUs"."""
    engine_kwargs: dict[str, Any] = Field(default_factory=dict)
    """Extra `EngineArgs` keyword arguments, passed through unchanged (typed knobs above win)."""


class HfServerConfig(ConfigSection):
    """`server.hf`: knobs of the transformers backend (tests and references, not throughput)."""

    batch_size: int = Field(default=8, ge=1)
    """Requests per left-padded `generate` call."""


class ServerConfig(ConfigSection):
    """`server`: everything the rollout server process and its launcher read."""

    host: str = "127.0.0.1"
    """Bind address; non-loopback needs `allow_non_loopback: true`."""
    port: int = Field(default=8000, ge=1, le=65535)
    """HTTP port."""
    health_port: int | None = Field(default=None, ge=1, le=65535)
    """Port of the probe listener (`/health/live`, `/health/ready`, `/health` in a process of its own, so
    probes never wait behind generation; `rollout_server.health_listener`); None: probes on the main port
    only."""
    drain_timeout_s: float = Field(default=30.0, gt=0.0, le=3600.0)
    """On SIGTERM/SIGINT: stop accepting, give in-flight requests this long to finish, then abort the rest,
    close the engine and exit 0."""
    gpus: GpuList = None
    """GPU indices for `CUDA_VISIBLE_DEVICES` (None: leave it as it is, e.g. on CPU)."""
    allow_non_loopback: bool = False
    """Allow binding an address reachable from other hosts (then `auth_token` is required, or the explicit
    `allow_unauthenticated` opt-out)."""
    auth_token: SecretStr | None = Field(default=None, min_length=1)
    """When set, every route except `/health` needs `Authorization: Bearer <token>` (the learner sends
    `rollout.auth_token`). Required with a non-loopback `host`."""
    allow_unauthenticated: bool = False
    """Serve a non-loopback `host` WITHOUT `auth_token`: anyone who reaches the port can generate and replace
    the served weights through `/sync_weights/`. Only on a network you trust; the server logs a warning at
    start."""
    model: str
    """Local model directory (relative paths resolve against the repository root; never a hub name)."""
    backend: Literal["vllm", "hf"] = "vllm"
    """Generation backend."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Weights and activations dtype."""
    seed: int = Field(default=0, ge=0)
    """Base seed when a request config has none."""
    max_body_mb: float = Field(default=1024.0, gt=0.0)
    """Largest accepted request body in MiB (weight buckets included); larger → 413."""
    shm_dir: str | None = None
    """Staging directory for same-host bucket files (e.g. `/dev/shm/rollmatch`); None disables shm."""
    sync_timeout_s: float = Field(default=600.0, gt=0.0)
    """A staged sync idle for this long is discarded."""
    sync_staging: Literal["auto", "device", "host"] = "auto"
    """Collective transport (`gloo`/`nccl`): where received buckets wait for the commit. `device`: in GPU
    memory (one model's worth; the commit is a device copy); `host`: in pinned host memory (two buckets of GPU
    memory while receiving; the commit copies host to device); `auto`: device when free GPU memory exceeds
    1.25x the model + 1 GiB at the sync's begin, else host. HTTP/shm syncs always stage in files on
    /dev/shm."""
    vllm: VllmServerConfig = Field(default_factory=VllmServerConfig)
    """vLLM engine knobs."""
    hf: HfServerConfig = Field(default_factory=HfServerConfig)
    """HF engine knobs."""

    @model_validator(mode="after")
    def _check(self) -> ServerConfig:
        if not self.allow_non_loopback and not is_loopback(self.host):
            raise rule_error(
                "host",
                f"{self.host!r} is not loopback (127.0.0.1, localhost, ::1); bind loopback or set"
                " server.allow_non_loopback: true",
            )
        if not is_loopback(self.host) and self.auth_token is None and not self.allow_unauthenticated:
            raise rule_error(
                "auth_token",
                f"server.host {self.host!r} is reachable from other hosts and no token is set, so anyone who"
                " reaches the port could replace the served weights through /sync_weights/; set"
                " server.auth_token (and the same rollout.auth_token on the learner), or on a trusted network"
                " only server.allow_unauthenticated: true",
            )
        if self.health_port is not None and self.health_port == self.port:
            raise rule_error(
                "health_port",
                f"{self.health_port} is server.port too; give the probe listener a port of its own",
            )
        if self.gpus is not None:
            need = self.vllm.tensor_parallel_size * self.vllm.data_parallel_size
            if len(self.gpus) != need:
                raise rule_error(
                    "gpus",
                    f"{list(self.gpus)} has {len(self.gpus)} entries but tensor_parallel_size"
                    f" {self.vllm.tensor_parallel_size} x data_parallel_size {self.vllm.data_parallel_size}"
                    f" = {need}; list {need} GPUs or change TP/DP",
                )
        return self

    @property
    def unauthenticated_exposure(self) -> bool:
        """True when other hosts can reach the server and it asks no token (`allow_unauthenticated`)."""
        return not is_loopback(self.host) and self.auth_token is None

    @property
    def model_path(self) -> Path:
        """The model directory as an absolute path (relative → under `REPO_ROOT`)."""
        path = Path(self.model).expanduser()
        return path if path.is_absolute() else (REPO_ROOT / path).resolve()

    @property
    def served_dtype(self) -> str | None:
        """The dtype reported in `/health` (None for `auto`: the engine picks it from the checkpoint)."""
        return None if self.dtype == "auto" else self.dtype

    @property
    def max_body_bytes(self) -> int:
        """`max_body_mb` in bytes."""
        return int(self.max_body_mb * 2**20)


def server_config_from_mapping(
    tree: Mapping[str, Any],
    *,
    source: str = "<mapping>",
    overrides: Mapping[str, Any] | None = None,
    provenance: Provenance | None = None,
) -> ServerConfig:
    """Validates a run tree (or a bare server section) into a `ServerConfig`.

    Args:
        tree: a run mapping with a `server` key (only that section is read) or a bare server section.
        source: file name used in error messages.
        overrides: top-level server keys that win over the file (launcher flags: port, host, gpus).
        provenance: dotted key → file that set it (from `load_yaml_tree`).

    Raises:
        ConfigError: naming the file and the dotted key of each problem (at most 10).
    """
    prefix: tuple[str, ...] = ()
    section: Any = tree
    if "server" in tree:
        prefix, section = ("server",), tree["server"]
    if not isinstance(section, Mapping):
        raise ConfigError(f"{source}: {'.'.join(prefix) or '<root>'}: must be a mapping")
    data = dict(section)
    prov = dict(provenance or {})
    for key, value in (overrides or {}).items():
        if value is not None:
            data[key] = value
            prov[(*prefix, key)] = Path("<command line>")
    try:
        return ServerConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, source, prefix=prefix, provenance=prov)) from exc


def load_server_config(path: str | Path, overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    """Loads the server section of a YAML file (with its `extends:` chain).

    Args:
        path: a server-only YAML or a whole run's YAML (only `server:` is read).
        overrides: launcher flags that win over the file (`port`, `host`, `gpus`); None values are ignored.

    Raises:
        ConfigError: naming the file and dotted key.
    """
    tree, prov = load_yaml_tree(path)
    return server_config_from_mapping(tree, source=str(path), overrides=overrides, provenance=prov)
