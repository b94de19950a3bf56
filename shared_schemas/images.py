"""Image references → pixels, exactly one way for every process (server engines, learner, colocate backends).

An image reference is a string: a local path, a `file://` URL or a `data:` URL (`image_ref_kind`); nothing is
ever fetched from the network. The learner's teacher-forced prompt (spec/STAGE2.md §11) must see the same
pixels as the engine that rolled out, so both decode through `load_image` here: EXIF orientation applied,
converted to RGB, as `transformers.image_utils.load_image` does.

PIL is imported inside `load_image` only, so importing `shared_schemas` stays light (no torch, no PIL).
Relative paths are resolved against the current directory; the learner makes them absolute from
`data.image_root` / the JSONL's directory before they go on the wire (`learner.data.records.resolve_image`).
"""

from __future__ import annotations

import base64
import binascii
import io
from pathlib import Path
from typing import Any
from urllib.parse import unquote, unquote_to_bytes, urlparse
from urllib.request import url2pathname

from shared_schemas.infer import image_ref_kind

__all__ = ["ImageRefError", "image_bytes", "load_image"]


class ImageRefError(ValueError):
    """An image reference cannot be read or decoded.

    Attributes:
        index: global request index (or sample index) the image belongs to.
        position: the image's position within that request.
        why: what is wrong, without the reference itself (data URLs can be megabytes).
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
    try:
        kind = image_ref_kind(ref)
    except ValueError as exc:
        raise ImageRefError(index, position, str(exc)) from exc
    if kind == "data":
        header, sep, payload = ref.partition(",")
        if not sep:
            raise ImageRefError(index, position, "data: URL without a ',' before the payload")
        if header.endswith(";base64"):
            try:
                return base64.b64decode(payload, validate=False)
            except (binascii.Error, ValueError) as exc:
                raise ImageRefError(index, position, "data: URL payload is not valid base64") from exc
        return unquote_to_bytes(payload)
    if kind == "file":
        parsed = urlparse(ref)
        if parsed.netloc not in ("", "localhost"):
            raise ImageRefError(
                index, position, f"file:// URL names host {parsed.netloc!r}; only local files"
            )
        path = Path(url2pathname(unquote(parsed.path)))
    else:
        path = Path(ref).expanduser()
    try:
        return path.read_bytes()
    except FileNotFoundError as exc:
        raise ImageRefError(index, position, f"file {path.name!r} does not exist") from exc
    except OSError as exc:
        raise ImageRefError(index, position, f"file {path.name!r} cannot be read ({exc.strerror})") from exc


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
        raise ImageRefError(index, position, "the bytes are not a decodable image") from exc
    image = ImageOps.exif_transpose(image)
    return image.convert("RGB")
