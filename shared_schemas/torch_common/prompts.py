"""Prompt encoding of rollout messages, text and images alike: ONE function for every place that encodes a
rollout prompt, in either process.

`MessageEncoder.encode(messages)` is used by the rollout server's `HfEngine` (`server.backend: hf`), by the
learner's colocated HF engine (`learner.rollout.colocate.hf`) and by the learner's teacher forcing
(`learner.data.prompt_encoding.PromptEncoder`: this encoder plus a per-window cache). So the
`prompt_token_ids` an HF engine returns are the ids the learner's alignment check (docs/ALGORITHM.md §11)
re-encodes, token for token.

Text prompts: the chat template in generation mode, tokenized without extra special tokens
(`encode_chat_prompt`, which the vLLM engine's inputs use too, so its ids are these). Image prompts: the same
template text goes through the model's HF processor, which expands each `<|image_pad|>` to the image's token
count and returns the vision tensors (`pixel_values`, `image_grid_thw`, ...); the ids then equal the expanded
`prompt_token_ids` the vLLM engine returns (vLLM expands the one placeholder per image itself).
`processor_kwargs` go into every processor call, as vLLM passes `server.vllm.mm_processor_kwargs` (e.g.
`max_pixels`).

Qwen-VL models place tokens with multi-axis rotary positions (M-RoPE: time, height, width). The encoder
computes a prompt's 3-row positions with the model's own rope-index function (`model_rope_index`), once per
prompt; what follows a prompt continues every row from ``max(prompt positions) + 1`` (`hf_decode` while
generating, `learner.batching.packed_batch.segment_rope_positions` while training). The decode loop takes an
image prompt's `mm_inputs` and `rope_positions` as its `VisionRow` (`rollout_server.engines.hf_decoder`).

Image references are decoded by `shared_schemas.images.load_image` (the server passes its wrapper
`rollout_server.engines.vllm.inputs.load_image`, which reports an unreadable image as a 400), so every side
sees the same pixels.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Self

import torch

from shared_schemas import images
from shared_schemas.infer import iter_image_refs

__all__ = [
    "ChatTemplateError",
    "EncodedPrompt",
    "MessageEncoder",
    "RopeIndex",
    "encode_chat_prompt",
    "model_rope_index",
    "render_chat_prompt",
]

RopeIndex = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""`(input_ids [1, L], mm_token_type_ids [1, L], image_grid_thw [n, 3] | None) -> positions [3, L]`."""

ImageLoader = Callable[[str, int, int], Any]
"""`(reference, request index, image position) -> RGB PIL image` (`shared_schemas.images.load_image`)."""

# Processor outputs that are not model inputs of the vision tower (the ids travel separately).
_NOT_MM = frozenset({"input_ids", "attention_mask", "mm_token_type_ids", "token_type_ids"})


@dataclass(frozen=True)
class EncodedPrompt:
    """One encoded prompt.

    Attributes:
        ids: prompt token ids, image placeholders expanded (ends with the generation prompt).
        mm_inputs: vision tensors for the forward (`pixel_values`, `image_grid_thw`, ...); empty for text.
        rope_positions: ``[3][len(ids)]`` M-RoPE positions of the prompt (rows t, h, w) for a model with
            multi-axis rotary positions, else None.
    """

    ids: tuple[int, ...]
    mm_inputs: dict[str, torch.Tensor] = field(default_factory=dict)
    rope_positions: tuple[tuple[int, ...], ...] | None = None

    @property
    def n_images(self) -> int:
        """Images in the prompt."""
        grid = self.mm_inputs.get("image_grid_thw")
        return 0 if grid is None else int(grid.shape[0])


class ChatTemplateError(RuntimeError):
    """The model's chat template returned something other than text (a broken tokenizer config: the rollout
    server reports it as a 500 `engine_error`)."""


def render_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> str:
    """Applies the model's chat template with the generation prompt (`<|im_start|>assistant\\n`).

    Args:
        tokenizer: a transformers tokenizer or processor with `apply_chat_template`.
        messages: rollout messages (docs/ALGORITHM.md#prompt-hygiene), passed unchanged.

    Returns:
        The prompt text.

    Raises:
        ChatTemplateError: the template returned no string.
    """
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    if not isinstance(text, str):
        raise ChatTemplateError(f"chat template returned {type(text).__name__}, expected str")
    return text


def encode_chat_prompt(tokenizer: Any, messages: list[dict[str, Any]]) -> list[int]:
    """Prompt ids of a text-only chat: the rendered template tokenized without extra special tokens.

    The template already holds every special token, so none is added (same ids vLLM derives).
    """
    text = render_chat_prompt(tokenizer, messages)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [int(t) for t in ids]


def model_rope_index(model: torch.nn.Module) -> RopeIndex | None:
    """The model's M-RoPE index function as a `RopeIndex`, or None for a model with 1-D positions.

    Qwen2-VL / Qwen2.5-VL / Qwen3-VL expose `get_rope_index` on their inner model; its keyword set differs by
    family and transformers version, so only the arguments it declares are passed.
    """
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    inner = getattr(base, "model", None)
    fn = getattr(inner, "get_rope_index", None) or getattr(base, "get_rope_index", None)
    if fn is None:
        return None
    accepted = set(inspect.signature(fn).parameters)

    def rope_index(ids: torch.Tensor, types: torch.Tensor, grid: torch.Tensor | None) -> torch.Tensor:
        kwargs: dict[str, Any] = {"image_grid_thw": grid}
        if "mm_token_type_ids" in accepted:
            kwargs["mm_token_type_ids"] = types
        with torch.no_grad():
            positions, _ = fn(ids, **kwargs)
        return positions[:, 0, :]

    return rope_index


class MessageEncoder:
    """Encodes rollout messages into prompt ids (+ vision tensors and M-RoPE positions); see the module doc.

    Args:
        tokenizer: the text tokenizer (its chat template renders the prompt).
        processor: the model's HF processor; None for a text-only model (then images are refused).
        rope_index: the model's M-RoPE index function (`model_rope_index`); None for 1-D positions.
        image_token_id: id of the image placeholder (`<|image_pad|>`), needed with `rope_index`.
        video_token_id: id of the video placeholder, if any.
        processor_kwargs: extra keyword arguments of every processor call (`server.vllm.mm_processor_kwargs`).
        load_image: decodes one image reference (default `shared_schemas.images.load_image`).
    """

    def __init__(
        self,
        tokenizer: Any,
        processor: Any | None = None,
        *,
        rope_index: RopeIndex | None = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        processor_kwargs: Mapping[str, Any] | None = None,
        load_image: ImageLoader = images.load_image,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self._rope_index = rope_index
        self._image_token_id = image_token_id
        self._video_token_id = video_token_id
        self._processor_kwargs = dict(processor_kwargs or {})
        self._load_image = load_image

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer: Any, processor: Any | None, **options: Any) -> Self:
        """The encoder of a loaded model (rope index and placeholder ids from the model's config); `options`
        are the other keyword arguments of the class."""
        if processor is None:
            return cls(tokenizer, **options)
        config = model.config
        return cls(
            tokenizer,
            processor,
            rope_index=model_rope_index(model),
            image_token_id=getattr(config, "image_token_id", None),
            video_token_id=getattr(config, "video_token_id", None),
            **options,
        )

    @property
    def takes_images(self) -> bool:
        """Whether image prompts can be encoded."""
        return self.processor is not None

    def encode(self, messages: list[dict[str, Any]], *, index: int = 0) -> EncodedPrompt:
        """Encodes one prompt.

        Args:
            messages: the §3.3 rollout messages (system + user; image parts hold reference strings).
            index: request/sample index named in errors.

        Raises:
            ValueError: images for a text-only model.
            shared_schemas.images.ImageRefError: an unreadable image reference (or what `load_image` raises).
        """
        refs = iter_image_refs(messages)
        if not refs:
            ids = encode_chat_prompt(self.tokenizer, messages)
            return EncodedPrompt(tuple(ids), rope_positions=self._text_rope(len(ids)))
        if self.processor is None:
            raise ValueError(
                f"sample {index}: {len(refs)} image(s) but the model takes no images; point model.path at a "
                "Qwen-VL checkpoint or use text-only records (data.max_images_per_sample: 0)"
            )
        text = render_chat_prompt(self.tokenizer, messages)
        pixels = [self._load_image(ref, index, k) for k, ref in enumerate(refs)]
        out = self.processor(
            text=[text],
            images=pixels,
            return_tensors="pt",
            add_special_tokens=False,
            **self._processor_kwargs,
        )
        ids = out["input_ids"][0]
        mm_inputs = {k: v for k, v in out.items() if k not in _NOT_MM and isinstance(v, torch.Tensor)}
        positions = None
        if self._rope_index is not None:
            types = self._token_types(ids)
            positions = self._rope_index(ids[None], types[None], mm_inputs.get("image_grid_thw"))
            positions = tuple(tuple(int(p) for p in row) for row in positions.tolist())
        return EncodedPrompt(tuple(int(t) for t in ids.tolist()), mm_inputs, positions)

    def _text_rope(self, length: int) -> tuple[tuple[int, ...], ...] | None:
        if self._rope_index is None:
            return None
        row = tuple(range(length))
        return (row, row, row)

    def _token_types(self, ids: torch.Tensor) -> torch.Tensor:
        types = torch.zeros_like(ids)
        if self._image_token_id is not None:
            types[ids == self._image_token_id] = 1
        if self._video_token_id is not None:
            types[ids == self._video_token_id] = 2
        return types
