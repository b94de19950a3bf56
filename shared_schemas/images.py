"""Image references → pixels, exactly one way for every process (server engines, learner, colocate backends).

An image reference is a string: a local path, a `file://` URL or a `data:` URL (`image_ref_kind`); nothing is
ever fetched from the network. The learner's teacher-forced prompt (docs/ALGORITHM.md#teacher-forced-encoding)
must see the same pixels as the engine that rolled out, so both decode through `load_image` here: EXIF
orientation applied, converted to RGB, as `transformers.image_utils.load_image` does.

PIL is imported inside `load_image` only, so importing `shared_schemas` stays light (no torch, no PIL).
`attach_images` places ms-swift style `images` lists into the messages (both sides do it the same way;
`request_messages` does it for an `InferRequest`).
Relative paths are resolved against the current directory; the learner makes them absolute from
`data.image_root` / the JSONL's directory before they go on the wire (`learner.data.records.resolve_image`).
"""

from __future__ import annotations

import base64
import binascii
import io
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse
from urllib.request import url2pathname

from shared_schemas.infer import InferRequest, image_ref_kind, iter_image_refs

__all__ = [
    "IMAGE_TAG",
    "ImageRefError",
    "attach_images",
    "image_bytes",
    "load_image",
    "local_image_path",
    "request_messages",
]

IMAGE_TAG = "<image>"
"""ms-swift's inline image marker in string message content."""
_TAG_SPLIT = re.compile(f"({re.escape(IMAGE_TAG)})")


class ImageRefError(ValueError):
    """An image reference cannot be read or decoded.

    Attributes:
        index: global request index (or sample index) the image belongs to.
        position: the image's position within that request.
        why: what is wrong; names a local path or file URL in full, a data: URL by its size only (they can be
            megabytes).
    """

    def __init__(self, index: int, position: int, why: str) -> None:
        self.index, self.position, self.why = index, position, why
        super().__init__(
            f"request {index}: image {position}: {why}; send a readable local path, a file:// URL or a"
            " base64 data: URL"
        )


def image_bytes(ref: str, index: int = 0, position: int = 0) -> bytes:
    """Reads the encoded bytes behind an image reference.

    Args:
        ref: a local path, a `file://` URL or a `data:` URL.
        index: global request index (named in errors).
        position: the image's position in the request (named in errors).

    Raises:
        ImageRefError: unknown scheme, malformed URL, missing or unreadable file.
    """
    path = local_image_path(ref, index, position)
    if path is None:  # a data: URL
        header, sep, payload = ref.partition(",")
        if not sep:
            raise ImageRefError(index, position, "data: URL without a ',' before the payload")
        if header.endswith(";base64"):
            try:
                return base64.b64decode(payload, validate=False)
            except (binascii.Error, ValueError) as exc:
                raise ImageRefError(index, position, "data: URL payload is not valid base64") from exc
        return unquote_to_bytes(payload)
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise ImageRefError(index, position, f"file {str(path)!r} does not exist") from exc
    except OSError as exc:
        raise ImageRefError(index, position, f"file {str(path)!r} cannot be read ({exc.strerror})") from exc


def local_image_path(ref: str, index: int = 0, position: int = 0) -> Path | None:
    """The local file behind a path or `file://` URL; None for a `data:` URL.

    Raises:
        ImageRefError: unknown scheme, or a `file://` URL naming another host.
    """
    try:
        kind = image_ref_kind(ref)
    except ValueError as exc:
        raise ImageRefError(index, position, str(exc)) from exc
    if kind == "data":
        return None
    if kind == "file":
        parsed = urlparse(ref)
        if parsed.netloc not in ("", "localhost"):
            raise ImageRefError(
                index, position, f"file:// URL names host {parsed.netloc!r}; only local files"
            )
        return Path(url2pathname(unquote(parsed.path)))
    return Path(ref).expanduser()


def _describe(ref: str) -> str:
    """A reference as errors name it: a path or file URL in full, a data: URL by its size only."""
    return f"a data: URL of {len(ref)} characters" if ref.startswith("data:") else repr(ref)


def load_image(ref: str, index: int = 0, position: int = 0) -> Any:
    """Decodes an image reference to an RGB `PIL.Image` (EXIF orientation applied).

    Raises:
        ImageRefError: unreadable reference or bytes that are not an image.
    """
    from PIL import Image, ImageOps, UnidentifiedImageError

    data = image_bytes(ref, index, position)
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise ImageRefError(
            index, position, f"the bytes of {_describe(ref)} are not a decodable image ({exc})"
        ) from exc
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")


def _image_part(ref: str) -> dict[str, Any]:
    return {"type": "image", "image": ref}


def attach_images(messages: list[dict[str, Any]], extra_refs: Sequence[str]) -> list[dict[str, Any]]:
    """Places ms-swift style `images` (refs not already in the messages) into the messages as image parts.

    Each `<image>` tag in string content takes the next extra image, in order; images left over are
    prepended, in order, to the first user message (Qwen-VL puts the image before the text).

    Args:
        messages: chat messages (not modified).
        extra_refs: image refs from the request's `images` that no message part holds.

    Returns:
        New messages whose image parts, read in order, are the images of the prompt.
    """
    pending = list(extra_refs)
    if not pending:
        return messages
    out: list[dict[str, Any]] = []
    for message in messages:
        content = message.get("content")
        if isinstance(content, str) and IMAGE_TAG in content and pending:
            parts: list[dict[str, Any]] = []
            for piece in _TAG_SPLIT.split(content):
                if piece == IMAGE_TAG and pending:
                    parts.append(_image_part(pending.pop(0)))
                elif piece:
                    parts.append({"type": "text", "text": piece})
            message = {**message, "content": parts}
        out.append(message)
    if pending:
        first_user = next((i for i, m in enumerate(out) if m.get("role") == "user"), 0)
        message = out[first_user]
        content = message.get("content")
        body = [{"type": "text", "text": content}] if isinstance(content, str) else list(content or [])
        out[first_user] = {**message, "content": [*(_image_part(r) for r in pending), *body]}
    return out


def request_messages(request: InferRequest) -> list[dict[str, Any]] | None:
    """A request's messages with its ms-swift `images` placed (`attach_images` of the refs no message part
    holds yet): the messages every engine renders. None for a `prompt_token_ids` request."""
    if request.messages is None:
        return None
    in_messages = iter_image_refs(request.messages)
    return attach_images(request.messages, [ref for ref in request.images if ref not in in_messages])
