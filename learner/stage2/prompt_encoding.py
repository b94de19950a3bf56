"""Teacher-forced prompt encoding, text and images alike (spec/STAGE2.md §3.3, §11.1).

`PromptEncoder.encode(messages)` is the learner's ONE encode function for a rollout prompt: the §3.3 rollout
messages the engine receives, rendered with the tokenizer's chat template in generation mode exactly as the
rollout server renders them (`rollout_server.engines.base.render_chat_prompt`: template text, then
tokenized without extra special tokens). A prompt with image parts also goes through the model's HF
processor, which expands each `<|image_pad|>` to the image's token count and returns the vision tensors
(`pixel_values`, `image_grid_thw`, ...): the ids then equal the engine's expanded `prompt_token_ids`, which
the §11 alignment check compares token for token.

Image references are decoded by `shared_schemas.images.load_image`, the function the server decodes with,
so both sides see the same pixels; references are strings (absolute path, `file://` or `data:` URL — the
record loader made relative paths absolute from `data.image_root`).

Qwen-VL models place tokens with multi-axis rotary positions (M-RoPE: time, height, width). The encoder
computes the prompt's 3-row positions with the model's own rope-index function (`get_rope_index`), once per
prompt; the text that follows a prompt continues every row from ``max(prompt positions) + 1``, so a segment's
positions are the prompt's plus a continuation (`learner.stage2.packed_batch.segment_rope_positions`) — what `get_rope_index` returns for
the whole segment (tested).

Encodings are cached per rollout-buffer window (`new_window()` clears the cache): the E-step's rollout (a
colocated HF engine encodes the same prompts) and its teacher forcing decode every image once; M-steps
replay prepared batches and decode nothing.
"""

from __future__ import annotations

import inspect
import json
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from shared_schemas.images import load_image
from shared_schemas.infer import iter_image_refs

__all__ = ["EncodedPrompt", "PromptEncoder", "RopeIndex", "model_rope_index"]

RopeIndex = Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], torch.Tensor]
"""`(input_ids [1, L], mm_token_type_ids [1, L], image_grid_thw [n, 3] | None) -> positions [3, L]`."""

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


class PromptEncoder:
    """Encodes rollout messages into prompt ids (+ vision tensors) exactly as the engines do.

    Args:
        tokenizer: the text tokenizer (its chat template renders the prompt).
        processor: the model's HF processor; None for a text-only model (then images are refused).
        rope_index: the model's M-RoPE index function (`model_rope_index`); None for 1-D positions.
        image_token_id: id of the image placeholder (`<|image_pad|>`), needed with `rope_index`.
        video_token_id: id of the video placeholder, if any.
        max_cached: most prompts kept between `new_window()` calls (a window normally holds fewer).
    """

    def __init__(
        self,
        tokenizer: Any,
        processor: Any | None = None,
        *,
        rope_index: RopeIndex | None = None,
        image_token_id: int | None = None,
        video_token_id: int | None = None,
        max_cached: int = 4096,
    ) -> None:
        self.tokenizer = tokenizer
        self.processor = processor
        self._rope_index = rope_index
        self._image_token_id = image_token_id
        self._video_token_id = video_token_id
        self._max_cached = max_cached
        self._cache: OrderedDict[str, EncodedPrompt] = OrderedDict()

    @classmethod
    def for_model(cls, model: torch.nn.Module, tokenizer: Any, processor: Any | None) -> PromptEncoder:
        """The encoder of a loaded policy (rope index and placeholder ids from the model's config)."""
        if processor is None:
            return cls(tokenizer)
        config = model.config
        return cls(
            tokenizer,
            processor,
            rope_index=model_rope_index(model),
            image_token_id=getattr(config, "image_token_id", None),
            video_token_id=getattr(config, "video_token_id", None),
        )

    @property
    def takes_images(self) -> bool:
        """Whether image prompts can be encoded."""
        return self.processor is not None

    def new_window(self) -> None:
        """Forget cached encodings (a new rollout-buffer window starts)."""
        self._cache.clear()

    def render(self, messages: list[dict[str, Any]]) -> str:
        """The prompt text: the chat template with the generation prompt (one placeholder per image)."""
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        if not isinstance(text, str):
            raise TypeError(f"chat template returned {type(text).__name__}, expected str")
        return text

    def encode(self, messages: list[dict[str, Any]], *, index: int = 0) -> EncodedPrompt:
        """Encodes one prompt (cached within the window).

        Args:
            messages: the §3.3 rollout messages (system + user; image parts hold reference strings).
            index: request/sample index named in errors.

        Raises:
            ValueError: images for a text-only model.
            shared_schemas.images.ImageRefError: an unreadable image reference.
        """
        key = json.dumps(messages, sort_keys=True, default=str)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        encoded = self._encode(messages, index)
        self._cache[key] = encoded
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return encoded

    def _encode(self, messages: list[dict[str, Any]], index: int) -> EncodedPrompt:
        text = self.render(messages)
        refs = iter_image_refs(messages)
        if not refs:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return EncodedPrompt(tuple(int(t) for t in ids), rope_positions=self._text_rope(len(ids)))
        if self.processor is None:
            raise ValueError(
                f"sample {index}: {len(refs)} image(s) but the model takes no images; point model.path at a "
                "Qwen-VL checkpoint or use text-only records (data.max_images_per_sample: 0)"
            )
        images = [load_image(ref, index, k) for k, ref in enumerate(refs)]
        out = self.processor(text=[text], images=images, return_tensors="pt", add_special_tokens=False)
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
