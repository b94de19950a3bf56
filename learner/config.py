"""The learner's run configuration: one pydantic model per YAML section (docs/ARCHITECTURE.md#configuration).

Knob names and defaults follow docs/ALGORITHM.md and docs/ARCHITECTURE.md#configuration. A section owned by
one package is defined there and assembled here: `rollout:` in `learner.rollout.config`, the typed view of
`training:` in `learner.training_config`, `stage2.*` parts beside their modules. Every section
forbids unknown keys; `load_run_config` turns validation errors into one-line `ConfigError`s naming the
file and the dotted key. The `server:` section belongs to the rollout server and its launcher: `RunConfig`
keeps it as an opaque mapping (a demo or compose file carries both); GRPO runs check it with the server's own
schema (`shared_schemas.server_config`) in `learner.grpo.config`, which also validates the `grpo:` section.

Cross-section guards (docs/ALGORITHM.md#seeds, §14.1, §16; issue "Learner loop" item 4) are checked by
`RunConfig` and by `check_runtime_guards` (those that need the world size or the server's `/health`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from learner.batching.packing import PackingConfig
from learner.data.messages import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_PROMPT
from learner.rollout.config import (
    AsyncRolloutConfig,
    ColocateVllmConfig,
    DecodingConfig,
    RolloutConfig,
    ServerEntry,
)
from learner.stage2.losses import CoordLossConfig, LossConfig
from learner.stage2.matching.match import MatchingConfig
from learner.stage2.rollout_reuse import RolloutBufferConfig
from learner.stage2.targets.y_train import TargetsConfig
from learner.training_config import MAX_REQUESTS_PER_MICRO_STEP, TrainingConfig
from learner.yaml_loader import ConfigError, deep_merge, format_validation_error, load_yaml_with_extends
from shared_schemas.config import REPO_ROOT, ConfigSection

__all__ = [
    "REPO_ROOT",
    "AsyncRolloutConfig",
    "ColocateVllmConfig",
    "ConfigError",
    "DecodingConfig",
    "RolloutConfig",
    "RunConfig",
    "ServerEntry",
    "Stage2Config",
    "TrainingConfig",
    "check_runtime_guards",
    "deep_merge",
    "load_run_config",
    "load_yaml_with_extends",
    "resolve_path",
]


def resolve_path(path: str) -> str:
    """A relative path in a config resolves against the repository root (so configs work from any cwd)."""
    p = Path(path)
    return str(p if p.is_absolute() else (REPO_ROOT / p).resolve())


class ModelConfig(ConfigSection):
    """`model:` — the checkpoint to train and its adapters."""

    path: str
    """Local model directory (never a hub name: no download). Relative paths resolve against the repo."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Training dtype of the weights."""
    attn_implementation: Literal["sdpa", "eager", "flash_attention_2"] = "sdpa"
    """Attention kernel; packed rows rely on position-id restarts (sdpa/eager) or varlen (flash)."""
    adapter: Literal["none", "lora", "dora"] = "none"
    """Train the full model or a PEFT LoRA/DoRA adapter on it."""
    lora_r: int = Field(default=16, ge=1)
    """Adapter rank."""
    lora_alpha: int = Field(default=32, ge=1)
    """Adapter scaling numerator."""
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    """Adapter dropout."""
    lora_target_modules: list[str] | str | None = None
    """Module-name suffixes (a list) or a PEFT regex (a string) that get adapters. Default: the attention
    projections of a text model; every linear layer of a VL model's LLM, nothing of its vision tower
    (`learner.policy.VL_LORA_TARGETS`)."""
    freeze_vision: bool | None = None
    """VL models only: freeze the vision tower (ViT blocks, patch embedding). Default true."""
    freeze_aligner: bool | None = None
    """VL models only: freeze the aligner (the patch merger(s) projecting vision features into the LLM).
    Default true."""
    freeze_llm: bool | None = None
    """VL models only: freeze the language model and LM head. Default false."""
    image_min_pixels: int | None = Field(default=None, ge=1)
    """VL models only: the processor's minimum image area (pixels) after resizing; default: the checkpoint's
    processor config. Must equal the rollout engine's (`server.vllm.mm_processor_kwargs`), or prompts
    differ and samples are dropped (`stage2.encode.on_prompt_mismatch`)."""
    image_max_pixels: int | None = Field(default=None, ge=1)
    """VL models only: the processor's maximum image area (pixels) after resizing (see image_min_pixels)."""
    liger_kernel: bool = False
    """Qwen3-VL on CUDA only: Liger-Kernel's Triton RMSNorm, rotary and SwiGLU (`learner.kernels`; the `gpu`
    extra). Measured: bench/RESULTS.md, "learner throughput"."""
    varlen_kernel: Literal["auto", "fa4", "torch"] = "auto"
    """Packed rows' attention kernel on CUDA (`learner.kernels.varlen`, whose registry spells the names):
    `fa4` = FlashAttention-4 (the `fa4` extra, Hopper/Blackwell), `torch` = PyTorch's varlen op
    (FlashAttention-2 kernels), `auto` = the first of them that imports and passes its one-time check here
    (else the per-segment loop). FA4 compiles each attention configuration on first use. Measured:
    bench/RESULTS.md, "learner throughput"."""
    compile_blocks: bool = False
    """Regional `torch.compile` of every decoder layer and ViT block (`learner.kernels.compile_blocks`,
    dynamic shapes; generation stays eager); the first steps compile (CPU works too). Not with
    `liger_kernel` (dynamo cannot trace Liger's RMSNorm). Not HF's `training.torch_compile` (whole model).
    Measured: bench/RESULTS.md, "learner throughput"."""

    @model_validator(mode="after")
    def _check_pixels(self) -> ModelConfig:
        lo, hi = self.image_min_pixels, self.image_max_pixels
        if lo is not None and hi is not None and lo > hi:
            raise ValueError(f"model.image_min_pixels {lo} > model.image_max_pixels {hi}")
        return self

    @model_validator(mode="after")
    def _check_kernels(self) -> ModelConfig:
        if self.compile_blocks and self.liger_kernel:
            raise ValueError(
                "model.compile_blocks and model.liger_kernel do not compose (torch.compile cannot trace"
                " Liger's RMSNorm); set one of them false — compile_blocks measured faster (bench/RESULTS.md)"
            )
        return self


class DataConfig(ConfigSection):
    """`data:` — dataset files (the record format and the converter from pixel annotations: docs/DATA.md)."""

    train: list[str]
    """Training JSONL files, in dataset-namespace order (sample_id = namespace << 32 | row)."""
    eval: list[str] = Field(default_factory=list)
    """Held-out JSONL files for the rollout-only evaluation."""
    image_root: str | None = None
    """Base for relative image paths (default: the JSONL file's directory)."""
    max_images_per_sample: int = Field(default=1, ge=0)
    """Images per record; 0 = text-only records (the embedded demo's tiny LM has no vision tower)."""
    object_ordering: Literal["sorted", "random"] = "sorted"
    """GT object order (§1.4)."""
    max_eval_samples: int | None = Field(default=None, ge=1)
    """Evaluate on the first N held-out samples only."""


class PromptsConfig(ConfigSection):
    """`prompts:` — the texts used for rollout and teacher forcing alike (§3.2)."""

    system: str = DEFAULT_SYSTEM_PROMPT
    """System prompt injected when a record has none."""
    user: str = DEFAULT_USER_PROMPT
    """User prompt; a record's `metadata.scene` text (synthetic demo data) is appended on a new line."""


class ChatConfig(ConfigSection):
    """`chat:` — template tokens."""

    end_of_turn_token: str = "<|im_end|>"
    """Assistant terminator; supervised after the closing brace (§12)."""


class ParseConfig(ConfigSection):
    """`stage2.parse:`."""

    stop_markers: list[str] = Field(default_factory=lambda: ["<|im_end|>", "<|endoftext|>"])
    """Hard stops (§6.2)."""


class GtConfig(ConfigSection):
    """`stage2.gt:`."""

    malformed_policy: Literal["skip", "raise"] = "skip"
    """Malformed GT objects are counted and skipped, or raise (data audits)."""
    malformed_log_max: int = Field(default=20, ge=0)
    """Individually logged malformed objects per process."""


class EncodeConfig(ConfigSection):
    """`stage2.encode:`."""

    on_prompt_mismatch: Literal["drop", "raise"] = "drop"
    """Teacher-forced prompt ids differ from the rollout's (§11.3)."""
    oversize_policy: Literal["raise", "drop"] = "raise"
    """Segment longer than packing_length (§11.5)."""
    global_max_length: int = Field(default=4096, ge=16)
    """Longest teacher-forced segment (= packing_length by default)."""


class OffloadConfig(ConfigSection):
    """`stage2.offload:` (§16) — colocated vLLM only."""

    enabled: bool = False
    """Wrap the rollout section of an E-step in the offload context (colocated vLLM only)."""
    model: bool = False
    """Move parameters to CPU while the engine generates."""
    optimizer: bool = False
    """Move optimizer states to CPU while the engine generates."""


class EvalConfig(ConfigSection):
    """`stage2.eval:` — decoding overrides for evaluation (default: inherit rollout.decoding)."""

    max_new_tokens: int | None = Field(default=None, ge=1)
    """Override of rollout.decoding.max_new_tokens for evaluation (None: inherit)."""
    temperature: float | None = Field(default=None, ge=0.0)
    """Override of rollout.decoding.temperature for evaluation (None: inherit)."""
    at_start: bool = True
    """Evaluate before the first step too (the demo reports F1 at step 0)."""
    gallery_images: int = Field(default=6, ge=0)
    """Held-out images drawn with their predictions at every evaluation into
    `output_dir/gallery/step_XXXX.png` (and TensorBoard's `eval/gallery` when it is a report target); the
    same images every time. 0: none; text-only records draw nothing."""


class Stage2Config(ConfigSection):
    """`stage2:` — everything of docs/ALGORITHM.md between the rollout and the optimizer."""

    parse: ParseConfig = Field(default_factory=ParseConfig)
    gt: GtConfig = Field(default_factory=GtConfig)
    matching: MatchingConfig = Field(default_factory=MatchingConfig)
    targets: TargetsConfig = Field(default_factory=TargetsConfig)
    encode: EncodeConfig = Field(default_factory=EncodeConfig)
    loss: LossConfig = Field(default_factory=LossConfig)
    coord_loss: CoordLossConfig = Field(default_factory=CoordLossConfig)
    packing: PackingConfig = Field(default_factory=PackingConfig)
    rollout_buffer: RolloutBufferConfig = Field(default_factory=RolloutBufferConfig)
    offload: OffloadConfig = Field(default_factory=OffloadConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    sft_warmup_steps: int = Field(default=0, ge=0)
    """Optimizer steps trained on the plain GT (an empty rollout: Y_train = the whole answer) before rollouts
    start — stage-1 SFT for a model that has never seen the output format. 0 (default) = rollouts from step 0,
    the spec's behaviour for a stage-1 SFT checkpoint."""

    @model_validator(mode="after")
    def _check_fp_unlikelihood(self) -> Stage2Config:
        weight, prefix = self.loss.fp_unlikelihood_weight, self.targets.unmatched_prefix
        if weight > 0 and prefix != "keep":
            # drop and reorder rewrite the teacher-forced answer without the false positives
            raise ValueError(
                f"stage2.loss.fp_unlikelihood_weight {weight} needs stage2.targets.unmatched_prefix: keep"
                f" (got {prefix!r}: its answer holds no false positive to penalize); set"
                " unmatched_prefix: keep, or fp_unlikelihood_weight: 0"
            )
        return self


class RunConfig(ConfigSection):
    """A whole learner run."""

    model: ModelConfig
    data: DataConfig
    prompts: PromptsConfig = Field(default_factory=PromptsConfig)
    chat: ChatConfig = Field(default_factory=ChatConfig)
    training: dict[str, Any] = Field(default_factory=dict)
    """Passed to HF `TrainingArguments`, as written; the keys the learner reads are typed, with their
    defaults, in `training_view` (`learner.training_config`: the `training` table)."""
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    stage2: Stage2Config = Field(default_factory=Stage2Config)
    server: dict[str, Any] | None = None
    """The rollout server's section (opaque here; read by the server and its launcher)."""
    grpo: dict[str, Any] | None = None
    """GRPO section (validated by learner.grpo.config when the GRPO trainer runs)."""
    output_dir: str = "runs/default"
    """Where metrics.jsonl, TensorBoard events, checkpoints and the report go."""
    gpu_peak_tflops: float | None = Field(default=None, gt=0)
    """Dense bf16 peak of one GPU in TFLOP/s, the denominator of the logged `perf/mfu`; null: looked up by
    the device's name in `learner.flops.PEAK_TFLOPS` (H100/H200 SXM 989), no MFU for an unknown device."""
    save_final_model: bool = True
    """Write the trained policy to `output_dir/model` after the last step (HF `save_model`: full weights with
    config and tokenizer/processor, or the adapter for PEFT runs; gathered under ZeRO-3). It loads as
    `model.path` of a later run or as the rollout server's `server.model`."""

    @field_validator("training")
    @classmethod
    def _check_training(cls, value: dict[str, Any]) -> dict[str, Any]:
        TrainingConfig.model_validate(value)  # its errors are reported under `training.`
        return value

    @property
    def training_view(self) -> TrainingConfig:
        """`training:` typed: the keys the learner reads, with their defaults (`learner.training_config`)."""
        return TrainingConfig.model_validate(self.training)

    @model_validator(mode="after")
    def _check(self) -> RunConfig:
        if (
            self.rollout.mode == "colocate"
            and self.rollout.backend == "vllm"
            and self.rollout.vllm.max_model_len is None
        ):
            raise ValueError("rollout.vllm.max_model_len is required for a colocated vLLM engine")
        if self.stage2.offload.enabled and self.rollout.mode != "colocate":
            raise ValueError("stage2.offload.enabled only applies to rollout.mode colocate")
        training = self.training_view
        if self.stage2.offload.enabled and (training.deepspeed or training.fsdp):
            raise ValueError(
                "stage2.offload.enabled cannot be combined with sharded parameters or optimizer states "
                "(training.deepspeed / training.fsdp); use ZeRO's own offload instead"
                " (docs/ALGORITHM.md#offload)"
            )
        if training.eval_enabled and not self.data.eval:
            raise ValueError(
                f"training.eval_strategy={training.eval_strategy!r} needs held-out samples but data.eval is"
                " empty; list eval JSONL files under data.eval or set training.eval_strategy: 'no'"
            )
        return self


def load_run_config(path: str | Path, overrides: dict[str, Any] | None = None) -> RunConfig:
    """Loads and validates a run YAML (with `extends`), applying optional overrides (deep-merged).

    Raises:
        ConfigError: one line naming the file and the dotted key.
    """
    raw = load_yaml_with_extends(path)
    if overrides:
        raw = deep_merge(raw, overrides)
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        raise ConfigError(format_validation_error(exc, path)) from exc


def check_runtime_guards(
    cfg: RunConfig,
    *,
    world_size: int,
    server_lora_enabled: bool | None = None,
    server_max_model_len: int | None = None,
    longest_prompt_tokens: int | None = None,
) -> None:
    """Guards that need facts known only at start-up. Raises `ConfigError` naming the key.

    Args:
        world_size: learner processes.
        server_lora_enabled: from the servers' `/health` (server mode).
        server_max_model_len: smallest `max_model_len` over the servers (server mode).
        longest_prompt_tokens: longest templated prompt of the data, when known.
    """
    per_device = cfg.training_view.per_device_train_batch_size
    if world_size * per_device > MAX_REQUESTS_PER_MICRO_STEP:
        raise ConfigError(
            f"training.per_device_train_batch_size {per_device} × world size {world_size} >"
            f" {MAX_REQUESTS_PER_MICRO_STEP} collides per-request seeds (docs/ALGORITHM.md#seeds); lower"
            " training.per_device_train_batch_size or run fewer learner processes"
        )
    tp = cfg.rollout.vllm.tensor_parallel_size
    if cfg.rollout.mode == "colocate" and world_size % tp:
        raise ConfigError(
            f"rollout.vllm.tensor_parallel_size {tp} must divide the learner world size {world_size}; a"
            " colocated engine's TP group is made of torchrun ranks, one GPU each: launch with torchrun"
            " --nproc-per-node N, N a multiple of the TP size"
        )
    if (
        cfg.rollout.sync.mode == "adapter"
        and server_lora_enabled is False
        and not cfg.rollout.sync.fallback_to_full
    ):
        raise ConfigError(
            "rollout.sync.mode is 'adapter' but the rollout server runs without LoRA and "
            "rollout.sync.fallback_to_full is false; start the server with server.vllm.enable_lora: true or "
            "use rollout.sync.mode: full"
        )
    max_len = server_max_model_len if cfg.rollout.mode == "server" else cfg.rollout.vllm.max_model_len
    if max_len is not None and longest_prompt_tokens is not None:
        need = longest_prompt_tokens + cfg.rollout.decoding.max_new_tokens
        if need > max_len:
            key = (
                "server.vllm.max_model_len" if cfg.rollout.mode == "server" else "rollout.vllm.max_model_len"
            )
            raise ConfigError(
                f"{key} {max_len} < longest prompt {longest_prompt_tokens} + rollout.decoding.max_new_tokens "
                f"{cfg.rollout.decoding.max_new_tokens} = {need}; raise {key} or lower max_new_tokens"
            )
