"""Turns one `InferRequest` into a vLLM engine input: templated prompt ids plus decoded images.

The chat template is applied server-side with the model's own tokenizer (the same ids the HF engine and the
learner derive: `shared_schemas.torch_common.prompts.encode_chat_prompt`, the template then tokenization
without extra special tokens). Images stay UNEXPANDED — one `<|image_pad|>` per image — and travel as
`multi_modal_data`; vLLM expands the placeholder itself (ids already expanded by an HF processor would be
expanded a second time, silently wrong; notes/tiny_vlm_on_cpu.md). Image references are strings: a local path,
a `file://` URL or a `data:` URL; the server never fetches from the network.

`resolve_prompt` (template, ms-swift `images` placed, images checked against the placeholders, nothing read
yet) is shared with the HF engine, which then encodes the resolved messages through the HF processor
(`shared_schemas.torch_common.prompts.MessageEncoder`, images decoded by `load_image` here): both backends
accept and refuse the same requests with the same errors.

Everything here blocks (file reads, image decoding, tokenization): callers run it in a worker thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rollout_server.errors import BadRequestError, EngineError
from shared_schemas import images
from shared_schemas.images import IMAGE_TAG, attach_images, request_messages
from shared_schemas.infer import InferRequest, iter_image_refs
from shared_schemas.torch_common.prompts import ChatTemplateError, encode_chat_prompt

__all__ = [
    "IMAGE_PLACEHOLDER",
    "IMAGE_TAG",
    "PreparedPrompt",
    "ResolvedPrompt",
    "attach_images",
    "image_bytes",
    "load_image",
    "prepare_prompt",
    "resolve_prompt",
]

IMAGE_PLACEHOLDER = "<|image_pad|>"
"""The unexpanded per-image placeholder token of Qwen-VL chat templates."""


@dataclass
class PreparedPrompt:
    """What vLLM receives for one request.

    Attributes:
        prompt_token_ids: templated ids, one placeholder per image (unexpanded).
        images: decoded RGB images in placeholder order.
    """

    prompt_token_ids: list[int]
    images: list[Any] = field(default_factory=list)

    def engine_input(self) -> dict[str, Any]:
        """The `TokensPrompt` dict for `AsyncLLM.generate`."""
        if not self.images:
            return {"prompt_token_ids": self.prompt_token_ids}
        return {"prompt_token_ids": self.prompt_token_ids, "multi_modal_data": {"image": list(self.images)}}


def image_bytes(ref: str, index: int = 0, position: int = 0) -> bytes:
    """`shared_schemas.images.image_bytes`, its error as a 400 `bad_image` naming the request and image.

    Raises:
        BadRequestError: unknown scheme, malformed URL, missing or unreadable file.
    """
    try:
        return images.image_bytes(ref, index, position)
    except images.ImageRefError as exc:
        raise _bad_image(exc) from exc


def load_image(ref: str, index: int = 0, position: int = 0) -> Any:
    """Decodes an image reference to an RGB `PIL.Image` with `shared_schemas.images.load_image` (the learner
    decodes through the same function, so both sides see the same pixels).

    Raises:
        BadRequestError: unreadable reference or bytes that are not an image (400 `bad_image`).
    """
    try:
        return images.load_image(ref, index, position)
    except images.ImageRefError as exc:
        raise _bad_image(exc) from exc


def _bad_image(exc: images.ImageRefError) -> BadRequestError:
    return BadRequestError(str(exc), type="bad_image", detail={"index": exc.index, "image": exc.position})


def _encode(tokenizer: Any, messages: list[dict[str, Any]], index: int) -> list[int]:
    try:
        return encode_chat_prompt(tokenizer, messages)
    except ChatTemplateError as exc:
        raise EngineError(str(exc)) from exc
    except (TypeError, ValueError, KeyError) as exc:
        raise BadRequestError(
            f"request {index}: the chat template rejected the messages ({type(exc).__name__}: {exc});"
            " send role/content messages as in docs/ALGORITHM.md#prompts §3.1",
            type="bad_messages",
        ) from exc


@dataclass
class ResolvedPrompt:
    """One request's templated prompt, checked as the engines check it, before any image is read.

    Attributes:
        prompt_token_ids: templated ids, one unexpanded placeholder per image.
        refs: the image references in placeholder order.
        messages: the request's messages with its `images` placed (`request_messages`); None for a
            `prompt_token_ids` request.
    """

    prompt_token_ids: list[int]
    refs: list[str]
    messages: list[dict[str, Any]] | None


def resolve_prompt(
    tokenizer: Any, request: InferRequest, index: int, *, placeholder_id: int | None
) -> ResolvedPrompt:
    """Builds the unexpanded prompt of one request and checks its images against it (nothing read yet).

    Args:
        tokenizer: the served model's tokenizer (chat template included).
        request: the request (`messages` or `prompt_token_ids`, optional `images`).
        index: its global index (named in errors).
        placeholder_id: id of `<|image_pad|>` when the model takes images, else None.

    Raises:
        BadRequestError: images sent to a text-only model, a placeholder count that differs from the image
            count, or messages the template rejects.
    """
    messages = request_messages(request)
    if messages is not None:
        refs = iter_image_refs(messages)
        ids = _encode(tokenizer, messages, index)
    else:
        assert request.prompt_token_ids is not None
        refs, ids = list(request.images), list(request.prompt_token_ids)
    if not refs:
        return ResolvedPrompt(ids, refs, messages)
    if placeholder_id is None:
        raise BadRequestError(
            f"request {index}: {len(refs)} image(s) sent but the served model takes no images;"
            " serve a vision-language model or drop the images",
            type="images_unsupported",
        )
    found = sum(1 for t in ids if t == placeholder_id)
    if found != len(refs):
        raise BadRequestError(
            f"request {index}: prompt holds {found} {IMAGE_PLACEHOLDER} placeholder(s)"
            f" for {len(refs)} image(s);"
            f" send exactly one unexpanded {IMAGE_PLACEHOLDER} per image",
            type="image_placeholder_mismatch",
            detail={"index": index, "placeholders": found, "images": len(refs)},
        )
    return ResolvedPrompt(ids, refs, messages)


def prepare_prompt(
    tokenizer: Any, request: InferRequest, index: int, *, placeholder_id: int | None
) -> PreparedPrompt:
    """Builds the unexpanded prompt of one request (`resolve_prompt`, same arguments) and loads its images.

    Returns:
        The prompt ids and the images in placeholder order.

    Raises:
        BadRequestError: what `resolve_prompt` raises, or an unreadable image.
    """
    resolved = resolve_prompt(tokenizer, request, index, placeholder_id=placeholder_id)
    return PreparedPrompt(
        resolved.prompt_token_ids, [load_image(ref, index, k) for k, ref in enumerate(resolved.refs)]
    )
