"""Teacher-forced prompt encoding, text and images alike (docs/ALGORITHM.md#prompts §3.3,
#teacher-forced-encoding §11.1).

`PromptEncoder.encode(messages)` is the learner's ONE encode function for a rollout prompt: the §3.3 rollout
messages the engine receives, encoded by `shared_schemas.torch_common.prompts.MessageEncoder` — the encoder
the rollout server's HF backend and the colocated HF engine encode with, so their `prompt_token_ids` are these
ids by construction. Text: the chat template in generation mode, tokenized without extra special tokens (the
ids the vLLM engine derives too). A prompt with image parts also goes through the model's HF processor, which
expands each `<|image_pad|>` to the image's token count and returns the vision tensors (`pixel_values`,
`image_grid_thw`, ...): the ids then equal the engine's expanded `prompt_token_ids`, which the §11 alignment
check compares token for token.

Image references are decoded by `shared_schemas.images.load_image`, the function the server decodes with,
so both sides see the same pixels; references are strings (absolute path, `file://` or `data:` URL — the
record loader made relative paths absolute from `data.image_root`).

Qwen-VL models place tokens with multi-axis rotary positions (M-RoPE: time, height, width). The encoder
computes the prompt's 3-row positions with the model's own rope-index function (`get_rope_index`), once per
prompt; the text that follows a prompt continues every row from ``max(prompt positions) + 1``, so a segment's
positions are the prompt's plus a continuation (`learner.batching.packed_batch.segment_rope_positions`) — what
`get_rope_index` returns for the whole segment (tested).

Encodings are cached per rollout-buffer window (`new_window()` clears the cache): the E-step's rollout (a
colocated HF engine encodes the same prompts) and its teacher forcing decode every image once; M-steps
replay prepared batches and decode nothing.
"""

from __future__ import annotations

import json
from collections import OrderedDict
from typing import Any

from shared_schemas.torch_common.prompts import EncodedPrompt, MessageEncoder, RopeIndex, model_rope_index

__all__ = ["EncodedPrompt", "PromptEncoder", "RopeIndex", "model_rope_index"]


class PromptEncoder(MessageEncoder):
    """The run's prompt encoder: `MessageEncoder` (the engines' encoder) with a per-window cache.

    Args:
        tokenizer: the text tokenizer (its chat template renders the prompt).
        processor: the model's HF processor; None for a text-only model (then images are refused).
        max_cached: most prompts kept between `new_window()` calls (a window normally holds fewer).
        **options: the other keyword arguments of `MessageEncoder` (`rope_index`, `image_token_id`, ...);
            `PromptEncoder.for_model(model, tokenizer, processor)` fills them from a loaded policy.
    """

    def __init__(
        self, tokenizer: Any, processor: Any | None = None, *, max_cached: int = 4096, **options: Any
    ) -> None:
        super().__init__(tokenizer, processor, **options)
        self._max_cached = max_cached
        self._cache: OrderedDict[str, EncodedPrompt] = OrderedDict()

    def new_window(self) -> None:
        """Forget cached encodings (a new rollout-buffer window starts)."""
        self._cache.clear()

    def encode(self, messages: list[dict[str, Any]], *, index: int = 0) -> EncodedPrompt:
        """`MessageEncoder.encode`, cached within the window.

        Raises:
            ValueError: images for a text-only model.
            shared_schemas.images.ImageRefError: an unreadable image reference.
        """
        key = json.dumps(messages, sort_keys=True, default=str)
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        encoded = super().encode(messages, index=index)
        self._cache[key] = encoded
        if len(self._cache) > self._max_cached:
            self._cache.popitem(last=False)
        return encoded
