"""The one model loader of the learner: stage-2, GRPO and the colocated HF backend load their policy here.

A checkpoint is either a plain causal LM (`AutoModelForCausalLM` + its tokenizer) or a Qwen-VL model
(Qwen2-VL, Qwen2.5-VL, Qwen3-VL, told apart by `config.model_type`: `AutoModelForImageTextToText` + its
`AutoProcessor`). The `Policy` carries the model, the text tokenizer (parsing, detokenizing, coord ids) and
the processing class the trainer saves beside every checkpoint (the processor for a VL model, so a
checkpoint can be served and resumed as is).

A VL model has three parts, each with a freeze knob (`model.freeze_vision`, `freeze_aligner`, `freeze_llm`;
defaults as ms-swift's: vision tower and aligner frozen, LLM trained):

- vision tower: `model.visual` minus its mergers (patch embedding, position table, ViT blocks);
- aligner: the patch merger(s) that project vision features into the LLM (`visual.merger`, and Qwen3-VL's
  `visual.deepstack_merger_list`);
- LLM: `model.language_model` and `lm_head`.

With `model.adapter: lora|dora` the LLM trains through adapters (default targets: its attention and MLP
projections, `VL_LORA_TARGETS`; the vision tower's fused `qkv`/`proj` never match) and an unfrozen vision
tower or aligner trains in full beside them, as the seeds' "DoRA + ViT/aligner" recipe does. Such a model
cannot be synced as an adapter (the engines' LoRA covers LLM layers only): `check_sync_mode` refuses
`rollout.sync.mode: adapter` for it and `auto` resolves to full.

Without torchvision (this repository's CPU test machines), transformers' Qwen-VL processors and vLLM's
Qwen-VL model files do not import; `ensure_vl_imports` installs the torchvision-free shim of
`shared_schemas/vlm_shim/` in this process and on `PYTHONPATH` for the processes it starts (a colocated vLLM
engine). Installs with torchvision never load it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from learner.kernels import apply_liger, compile_blocks, fa4_importable, index_deepstack
from learner.yaml_loader import ConfigError
from shared_schemas.checkpoints import VL_MODEL_TYPES, is_vl_checkpoint
from shared_schemas.vlm_shim import ensure_vl_imports

if TYPE_CHECKING:
    from learner.config import ModelConfig

__all__ = [
    "TEXT_LORA_TARGETS",
    "VL_LORA_TARGETS",
    "VL_MODEL_TYPES",
    "Policy",
    "is_vl_checkpoint",
    "load_policy",
    "part_param_groups",
    "vl_parts",
]

logger = logging.getLogger(__name__)

TEXT_LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Default adapter targets of a text-only model (module-name suffixes)."""
VL_LORA_TARGETS = (
    r".*language_model\.layers\.\d+\."
    r"(self_attn\.(q_proj|k_proj|v_proj|o_proj)|mlp\.(gate_proj|up_proj|down_proj))"
)
"""Default adapter targets of a VL model: every linear layer of the LLM's decoder blocks, nothing of the
vision tower (a PEFT regex, matched against the whole module name)."""


@dataclass
class Policy:
    """A loaded policy.

    Attributes:
        model: the model to train (a `PeftModel` when `model.adapter` asks for one).
        tokenizer: the text tokenizer (chat template, coord tokens, parsing).
        processor: the VL processor (`AutoProcessor`), None for a text-only model.
        is_vision_language: whether the model takes images.
    """

    model: nn.Module
    tokenizer: Any
    processor: Any | None
    is_vision_language: bool

    @property
    def processing_class(self) -> Any:
        """What the trainer saves beside checkpoints: the processor of a VL model, else the tokenizer."""
        return self.processor if self.processor is not None else self.tokenizer

    @property
    def trains_outside_adapters(self) -> bool:
        """A PEFT model whose base weights also train (an unfrozen vision tower or aligner)."""
        if not hasattr(self.model, "peft_config"):
            return False
        return any(p.requires_grad and "lora_" not in n for n, p in self.model.named_parameters())


def vl_parts(model: nn.Module) -> dict[str, list[tuple[str, nn.Parameter]]]:
    """The parameters of a Qwen-VL model by part: `vision`, `aligner`, `llm` (names as `named_parameters`).

    Raises:
        ValueError: the model has no `visual` module (not a Qwen-VL model).
    """
    parts: dict[str, list[tuple[str, nn.Parameter]]] = {"vision": [], "aligner": [], "llm": []}
    for name, param in model.named_parameters():
        parts[_part_of(name)].append((name, param))
    if not parts["vision"]:
        raise ValueError(f"{type(model).__name__} has no vision tower parameters (no `visual.` module)")
    return parts


def _part_of(name: str) -> str:
    if ".visual." not in f".{name}":
        return "llm"
    return "aligner" if ".merger." in name or ".deepstack_merger_list." in name else "vision"


def _check_knobs(cfg: ModelConfig, is_vl: bool, path: str) -> None:
    if is_vl:
        return
    for key in ("freeze_vision", "freeze_aligner", "freeze_llm", "image_min_pixels", "image_max_pixels"):
        if getattr(cfg, key) is not None:
            raise ConfigError(
                f"model.{key} is set but {path} is a text-only model (config model_type not in "
                f"{sorted(VL_MODEL_TYPES)}); remove model.{key} or point model.path at a Qwen-VL checkpoint"
            )


def _load_processor(path: str, cfg: ModelConfig) -> Any:
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(path)
    image_processor = processor.image_processor
    if cfg.image_min_pixels is not None or cfg.image_max_pixels is not None:
        size = dict(image_processor.size)
        if cfg.image_min_pixels is not None:
            size["shortest_edge"] = cfg.image_min_pixels
        if cfg.image_max_pixels is not None:
            size["longest_edge"] = cfg.image_max_pixels
        image_processor.size = {"shortest_edge": size["shortest_edge"], "longest_edge": size["longest_edge"]}
        for attr, value in (("min_pixels", cfg.image_min_pixels), ("max_pixels", cfg.image_max_pixels)):
            if value is not None and hasattr(image_processor, attr):
                setattr(image_processor, attr, value)
    return processor


def _apply_freeze(model: nn.Module, cfg: ModelConfig) -> dict[str, bool]:
    """Sets `requires_grad` per part of a plain (not yet adapted) VL model; returns the frozen flags."""
    frozen = {
        "vision": cfg.freeze_vision if cfg.freeze_vision is not None else True,
        "aligner": cfg.freeze_aligner if cfg.freeze_aligner is not None else True,
        "llm": cfg.freeze_llm if cfg.freeze_llm is not None else False,
    }
    for part, params in vl_parts(model).items():
        for _, param in params:
            param.requires_grad_(not frozen[part])
    if all(frozen.values()) and cfg.adapter == "none":
        raise ConfigError(
            "model.freeze_vision, model.freeze_aligner and model.freeze_llm are all true: nothing would train"
        )
    return frozen


def _adapt(model: nn.Module, cfg: ModelConfig, is_vl: bool, frozen: dict[str, bool]) -> nn.Module:
    from peft import LoraConfig, get_peft_model

    if is_vl and frozen["llm"]:
        raise ConfigError(
            f"model.adapter {cfg.adapter} trains the LLM through adapters but model.freeze_llm is true; "
            "set model.adapter: none to train only the vision tower / aligner, or model.freeze_llm: false"
        )
    targets: Any = cfg.lora_target_modules
    if targets is None:
        targets = VL_LORA_TARGETS if is_vl else list(TEXT_LORA_TARGETS)
    peft_model = get_peft_model(
        model,
        LoraConfig(
            r=cfg.lora_r,
            lora_alpha=cfg.lora_alpha,
            lora_dropout=cfg.lora_dropout,
            target_modules=targets,
            use_dora=cfg.adapter == "dora",
            task_type="CAUSAL_LM",
        ),
    )
    if is_vl:
        # PEFT froze every base weight; an unfrozen vision tower / aligner trains in full beside the adapters.
        for part in ("vision", "aligner"):
            for _, param in vl_parts(peft_model)[part] if not frozen[part] else []:
                param.requires_grad_(True)
    return peft_model


def load_policy(cfg: ModelConfig, path: str | Path) -> Policy:
    """Loads the policy of `model:` from the local directory `path` (nothing is ever downloaded).

    Args:
        cfg: the validated `model:` section.
        path: checkpoint directory (already resolved).

    Raises:
        ConfigError: not a directory, a VL-only knob on a text model, contradictory freeze knobs.
    """
    path = str(path)
    if not Path(path).is_dir():
        raise ConfigError(
            f"model.path {path} is not a local directory; build it with scripts/setup.sh "
            "(tiny models) or point it at a downloaded checkpoint"
        )
    is_vl = is_vl_checkpoint(path)
    _check_knobs(cfg, is_vl, path)
    dtype = getattr(torch, cfg.dtype)
    if is_vl:
        ensure_vl_imports()
        from transformers import AutoModelForImageTextToText

        processor = _load_processor(path, cfg)
        tokenizer = processor.tokenizer
        model = AutoModelForImageTextToText.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
        frozen = _apply_freeze(model, cfg)
        index_deepstack(model)  # equal values, fewer host waits (see its docstring)
    else:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        processor = None
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=cfg.attn_implementation
        )
        frozen = {}
    if cfg.liger_kernel:  # before the adapter wraps the modules Liger patches
        logger.info("model.liger_kernel: patched %s", apply_liger(model))
    if cfg.adapter != "none":
        model = _adapt(model, cfg, is_vl, frozen)
    if cfg.varlen_kernel == "fa4":
        if not fa4_importable():
            raise ConfigError(
                "model.varlen_kernel: fa4 needs flash-attn-4 (and its nvidia-cutlass-dsl runtime) importable;"
                " pip install flash-attn-4, or set model.varlen_kernel: auto (FA4 where it runs, else torch)"
            )
    if cfg.compile_blocks:  # after the adapter: its layers live inside the compiled blocks
        logger.info(
            "model.compile_blocks: %d blocks compiled (the first steps compile)", compile_blocks(model)
        )
    if is_vl:
        logger.info("loaded %s from %s: %s", type(_unwrap(model)).__name__, path, _trainable_summary(model))
    return Policy(model=model, tokenizer=tokenizer, processor=processor, is_vision_language=is_vl)


def _unwrap(model: nn.Module) -> nn.Module:
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def _trainable_summary(model: nn.Module) -> str:
    counts: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        part = "adapter" if "lora_" in name else _part_of(name)
        total = counts.setdefault(part, [0, 0])
        total[0] += param.numel() if param.requires_grad else 0
        total[1] += param.numel()
    return ", ".join(f"{part} {t:,}/{n:,} trainable" for part, (t, n) in counts.items())


def part_param_groups(
    model: nn.Module,
    *,
    base_lr: float,
    part_lrs: dict[str, float],
    decay_names: set[str],
    weight_decay: float,
) -> list[dict[str, Any]]:
    """Optimizer parameter groups of a VL model with a learning rate per part (GRPO's `grpo.aligner_lr` and
    `grpo.vision_tower_lr`), each split into decayed and not-decayed parameters as HF `Trainer` does.

    Args:
        model: the (possibly PEFT-wrapped) VL model; only trainable parameters are grouped.
        base_lr: the rate of parts not in `part_lrs` (the LLM, adapters).
        part_lrs: `{"vision": lr, "aligner": lr}` (parts of `vl_parts`).
        decay_names: names that get weight decay (`Trainer.get_decay_parameter_names`).
        weight_decay: `training.weight_decay`.

    Returns:
        Non-empty groups `{"params", "lr", "weight_decay"}`.
    """
    buckets: dict[tuple[float, bool], list[nn.Parameter]] = {}
    for name, param in model.named_parameters():
        if not param.requires_grad:
            continue
        part = "adapter" if "lora_" in name else _part_of(name)
        key = (part_lrs.get(part, base_lr), name in decay_names)
        buckets.setdefault(key, []).append(param)
    return [
        {"params": params, "lr": lr, "weight_decay": weight_decay if decays else 0.0}
        for (lr, decays), params in buckets.items()
    ]
