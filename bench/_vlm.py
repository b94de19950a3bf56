"""Shared `--vlm` set-up of the bench scripts: a Qwen3-VL model, its processor and image segments, in code.

Nothing is downloaded. The tokenizer (and chat template, coord tokens) is the embedded tiny one
(`scripts/build_tiny_models.py`, via the tiny Qwen3-VL at `.cache/models/tiny-qwen3-vl`); its ids are kept as
they are inside the model's vocabulary.

- ``smoke=True``: the tiny Qwen3-VL itself (float32, its own small image processor: 64x64 -> 4 image tokens).
- ``smoke=False``: a RANDOM-INIT model of Qwen3-VL-2B-Instruct's shapes (``QWEN3_VL_2B_TEXT`` /
  ``QWEN3_VL_2B_VISION``: a Qwen3-1.7B-shaped LLM, vocabulary 151,936, tied head, interleaved M-RoPE
  [24, 20, 20]; a 24-block ViT of width 1024 with deepstack taps 5 / 11 / 17) in bf16, and the real
  processor geometry (patch 16, merge 2: one image token per 32x32 pixels, 65,536 to 16,777,216 pixels), so a
  448x448 image gives 196 image tokens and an 896x896 one 784.

Prompts go through the learner's `PromptEncoder` (processor-expanded ids, vision tensors, M-RoPE positions),
and teacher-forced segments through `learner.stage2.targets.labels.build_segment`, as in training.
"""

from __future__ import annotations

import random
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[1]
for _path in (REPO, REPO / "scripts"):
    if str(_path) not in sys.path:
        sys.path.insert(0, str(_path))

from learner.data.prompt_encoding import EncodedPrompt, PromptEncoder  # noqa: E402
from learner.stage2.coords import CoordVocab  # noqa: E402
from learner.stage2.targets.labels import build_segment  # noqa: E402
from learner.stage2.targets.segment import Segment  # noqa: E402
from learner.stage2.targets.y_train import YTrain  # noqa: E402

__all__ = [
    "QWEN3_VL_2B_TEXT",
    "QWEN3_VL_2B_VISION",
    "QWEN3_VL_IMAGE_PROCESSOR",
    "VlmParts",
    "build_vlm",
    "save_vlm_2b",
    "vlm_model_dir",
    "forward_attention",
    "image_messages",
    "image_sizes",
    "image_segment",
    "write_images",
]

QWEN3_VL_2B_TEXT = dict(
    hidden_size=2048,
    intermediate_size=6144,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=262144,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    rope_parameters={
        "rope_type": "default",
        "rope_theta": 5000000.0,
        "mrope_section": [24, 20, 20],
        "mrope_interleaved": True,
    },
    vocab_size=151936,
)
"""Qwen3-VL-2B-Instruct's `text_config` (Qwen3-1.7B shapes)."""
QWEN3_VL_2B_VISION = dict(
    depth=24,
    hidden_size=1024,
    intermediate_size=4096,
    num_heads=16,
    in_channels=3,
    patch_size=16,
    spatial_merge_size=2,
    temporal_patch_size=2,
    out_hidden_size=2048,
    num_position_embeddings=2304,
    deepstack_visual_indexes=[5, 11, 17],
    hidden_act="gelu_pytorch_tanh",
)
"""Qwen3-VL-2B-Instruct's `vision_config`."""
QWEN3_VL_IMAGE_PROCESSOR = dict(
    patch_size=16,
    merge_size=2,
    temporal_patch_size=2,
    size={"shortest_edge": 65536, "longest_edge": 16777216},
    image_mean=[0.5, 0.5, 0.5],
    image_std=[0.5, 0.5, 0.5],
)
"""Qwen3-VL's image processor geometry (one image token per 32x32 pixels)."""

SYSTEM = "You are an open-vocabulary object detector. Reply with one single-line JSON object."
DESCS = ["cat", "dog", "traffic light", "chair", "person", "red car", "cup", "book"]


@dataclass
class VlmParts:
    """A model with its tokenizer, processor, prompt encoder and coord vocabulary."""

    model: torch.nn.Module
    tokenizer: Any
    processor: Any
    encoder: PromptEncoder
    coords: CoordVocab

    @property
    def eot_id(self) -> int:
        return int(self.tokenizer.convert_tokens_to_ids("<|im_end|>"))

    @property
    def newline_id(self) -> int:
        return int(self.tokenizer.encode("\n", add_special_tokens=False)[0])

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)


def tiny_vlm_dir() -> Path:
    from build_tiny_vlm import build_tiny_vlm

    return build_tiny_vlm(REPO / ".cache" / "models" / "tiny-qwen3-vl", seed=0)


def _processor(tokenizer: Any, image_processor: dict) -> Any:
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import (
            Qwen2VLImageProcessorPil as ImageProcessor,
        )
    except ImportError:  # transformers without the PIL backend module (torchvision present then)
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import (
            Qwen2VLImageProcessor as ImageProcessor,
        )
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    geometry = {k: image_processor[k] for k in ("patch_size", "merge_size", "temporal_patch_size", "size")}
    return Qwen3VLProcessor(
        image_processor=ImageProcessor(**image_processor),
        tokenizer=tokenizer,
        video_processor=Qwen3VLVideoProcessor(**geometry),
        chat_template=tokenizer.chat_template,
    )


def build_vlm(
    smoke: bool, device: str | torch.device, *, train: bool, gradient_checkpointing: bool = False
) -> VlmParts:
    """The tiny Qwen3-VL (``smoke``, float32) or a random-init Qwen3-VL-2B-shaped model (bf16) on ``device``.

    Args:
        smoke: tiny model and processor.
        device: where the model lives.
        train: train mode (else eval).
        gradient_checkpointing: turn it on (training benches of the full model).
    """
    from shared_schemas.vlm_shim import ensure_vl_imports

    ensure_vl_imports()
    from build_tiny_vlm import PRESETS
    from transformers import AutoTokenizer, Qwen3VLConfig, Qwen3VLForConditionalGeneration

    tiny = tiny_vlm_dir()
    tokenizer = AutoTokenizer.from_pretrained(tiny)
    if smoke:
        processor = _processor(tokenizer, PRESETS["tiny-qwen3-vl"].image_processor)
        model = Qwen3VLForConditionalGeneration.from_pretrained(tiny, dtype=torch.float32).to(device)
    else:
        processor = _processor(tokenizer, QWEN3_VL_IMAGE_PROCESSOR)
        ids = {t: tokenizer.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|video_pad|>")}
        config = Qwen3VLConfig(
            text_config=QWEN3_VL_2B_TEXT,
            vision_config=QWEN3_VL_2B_VISION,
            image_token_id=ids["<|image_pad|>"],
            video_token_id=ids["<|video_pad|>"],
            vision_start_token_id=tokenizer.convert_tokens_to_ids("<|vision_start|>"),
            vision_end_token_id=tokenizer.convert_tokens_to_ids("<|vision_end|>"),
            tie_word_embeddings=True,
        )
        config.text_config.eos_token_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
        config.text_config.pad_token_id = tokenizer.pad_token_id
        torch.manual_seed(0)
        with torch.device(device):
            model = Qwen3VLForConditionalGeneration(config).to(torch.bfloat16)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable()
    model.config.use_cache = False
    model.train(train)
    encoder = PromptEncoder.for_model(model, tokenizer, processor)
    return VlmParts(model, tokenizer, processor, encoder, CoordVocab.from_tokenizer(tokenizer))


def save_vlm_2b(folder: Path, device: str | torch.device = "cpu") -> Path:
    """Writes the random-init Qwen3-VL-2B-shaped model (bf16), its processor and tokenizer to `folder`, a
    model directory `python -m learner` loads like a downloaded checkpoint (skipped when `folder` has one)."""
    if (folder / "config.json").is_file():
        return folder
    parts = build_vlm(False, device, train=False)
    folder.mkdir(parents=True, exist_ok=True)
    parts.model.config.use_cache = True
    parts.model.save_pretrained(folder, safe_serialization=True)
    parts.processor.save_pretrained(folder)
    return folder


def vlm_model_dir(smoke: bool, folder: Path, device: str | torch.device = "cpu") -> Path:
    """A model directory a rollout server loads: the tiny Qwen3-VL's own (``smoke``; `folder` unused), else
    the random-init Qwen3-VL-2B-shaped model written to `folder` (`save_vlm_2b`, built on `device`)."""
    return tiny_vlm_dir() if smoke else save_vlm_2b(folder, device)


def forward_attention(model: torch.nn.Module) -> str:
    """The language model's attention in the learner's teacher-forced forward (`forward_for_loss`): its
    configured implementation, or the per-segment SDPA where `forward_for_loss` switches `sdpa` to it."""
    import inspect

    from learner.stage2.step import forward_for_loss

    configured = model.config.text_config._attn_implementation
    if configured == "sdpa" and "segment_attention" in inspect.signature(forward_for_loss).parameters:
        return "segment_sdpa"
    return configured


def image_sizes(smoke: bool) -> list[tuple[int, int]]:
    """Image sizes (w, h) cycled through by the benches: 448–896 px (196–784 image tokens), or tiny ones."""
    if smoke:
        return [(64, 64), (128, 96), (96, 160), (160, 128)]
    return [
        (448, 448), (640, 480), (896, 672), (512, 768), (768, 576), (896, 896), (480, 640), (704, 512),
        (576, 832), (832, 448), (640, 640), (448, 896), (768, 768), (544, 704), (896, 512), (608, 448),
    ]  # fmt: skip


def write_images(folder: Path, sizes: Sequence[tuple[int, int]], seed: int = 0) -> list[str]:
    """One PNG per size (noise over a gradient, so the processor does real work); returns absolute paths."""
    import numpy as np
    from PIL import Image

    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    paths = []
    for k, (w, h) in enumerate(sizes):
        grad = np.linspace(0, 255, w, dtype=np.float32)[None, :, None]
        noise = rng.integers(0, 64, (h, w, 3)).astype(np.float32)
        pixels = np.clip(grad + noise, 0, 255).astype(np.uint8)
        path = folder / f"img{k}_{w}x{h}.png"
        Image.fromarray(pixels).save(path)
        paths.append(str(path.resolve()))
    return paths


def image_messages(path: str, text: str = "List every object.") -> list[dict[str, Any]]:
    """§3.3 rollout messages of one image prompt."""
    return [
        {"role": "system", "content": SYSTEM},
        {"role": "user", "content": [{"type": "image", "image": path}, {"type": "text", "text": text}]},
    ]


def _answer_ids(parts: VlmParts, length: int, rng: random.Random) -> tuple[list[int], list[int]]:
    """About ``length`` answer ids: a detection JSON of objects, 4 coord tokens each (ids, coord indices)."""
    tokenizer = parts.tokenizer
    ids = tokenizer.encode("{", add_special_tokens=False)
    k = 0
    while len(ids) < length:
        k += 1
        bins = [rng.randrange(1000) for _ in range(4)]
        box = ", ".join(f"<|coord_{b}|>" for b in bins)
        sep = ", " if k > 1 else ""
        desc = DESCS[rng.randrange(len(DESCS))]
        ids += tokenizer.encode(
            f'{sep}"object_{k}": {{"desc": "{desc}", "bbox_2d": [{box}]}}', add_special_tokens=False
        )
    ids = ids[: length - 1] + tokenizer.encode("}", add_special_tokens=False)
    return ids, [i for i, t in enumerate(ids) if parts.coords.is_coord(t)]


def image_segment(
    parts: VlmParts, prompt: EncodedPrompt, answer_len: int, rng: random.Random, sample_id: int
) -> Segment:
    """A teacher-forced rollout-matching segment over an encoded image prompt (`build_segment`).

    The answer is ``answer_len`` detection-JSON tokens: the first ~60 % stand for the matched rollout prefix
    (its coord slots get coord targets), the rest for the appended FN tail (CE), as §10 / §12 lay them out.
    """
    ids, coord_at = _answer_ids(parts, answer_len, rng)
    prefix_len = int(len(ids) * 0.6)
    slots = tuple(i for i in coord_at if i < prefix_len)
    y_train = YTrain(
        ids=tuple(ids),
        prefix_len=prefix_len,
        append_text="",
        append_ids=tuple(ids[prefix_len:]),
        prefix_coord_pos=slots,
        prefix_coord_target_bins=tuple(min(999, parts.coords.bin_of(ids[i]) + 1) for i in slots),
        tail_ignore_pos=(),
        prefix_ce_pos=(),
        tp=(),
        excluded=(),
        fp=(),
        fn=(),
    )
    return build_segment(
        prompt.ids,
        y_train,
        parts.eot_id,
        parts.newline_id,
        parts.coords,
        sample_id=sample_id,
        base_idx=sample_id,
        rollout_step=0,
        mm_inputs=prompt.mm_inputs,
        rope_positions=prompt.rope_positions,
    )
