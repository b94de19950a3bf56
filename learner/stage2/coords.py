"""Coordinate tokens and the norm1000 grid (docs/ALGORITHM.md#coordinates, §1.3).

Coordinates live on an integer grid of ``COORD_BINS`` = 1000 bins (0..999, "norm1000"). Each bin ``k`` is one
added tokenizer token ``<|coord_k|>``. This module holds the pure conversions (pixel ↔ bin, bbox
anti-collapse, polygon canonicalization), the parsing of coordinate values found in data records, and
``CoordVocab``, the id ↔ bin map checked against a tokenizer at start-up.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

__all__ = [
    "COORD_BINS",
    "COORD_TOKEN_RE",
    "CoordValueError",
    "CoordVocab",
    "CoordVocabError",
    "anti_collapse",
    "bbox_to_bins",
    "bin_to_pixel",
    "canonicalize_poly",
    "coord_token",
    "parse_coord_string",
    "parse_coord_values",
    "pixel_to_bin",
]

COORD_BINS = 1000
_MAX_BIN = COORD_BINS - 1

# ASCII digits only: a coord string is produced by our serializer or by the coord token's own text.
COORD_TOKEN_RE = re.compile(r"<\|coord_(\d{1,3})\|>", re.ASCII)


class CoordValueError(ValueError):
    """A coordinate value violates spec §1.3 (the message says which value and why)."""


class CoordVocabError(ValueError):
    """The tokenizer does not hold the 1000 single-id coordinate tokens of spec §2.1."""


def coord_token(k: int) -> str:
    """Return the token string ``<|coord_k|>`` for bin ``k`` (0..999).

    Raises:
        CoordValueError: ``k`` is not an int in 0..999.
    """
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= _MAX_BIN:
        raise CoordValueError(f"coordinate bin {k!r} is not an int in 0..{_MAX_BIN}")
    return f"<|coord_{k}|>"


_COORD_STRINGS = tuple(f"<|coord_{k}|>" for k in range(COORD_BINS))


class _TokenizerLike(Protocol):
    def convert_tokens_to_ids(self, tokens: Any) -> Any: ...

    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: Sequence[int], **kwargs: Any) -> str: ...


@dataclass(frozen=True)
class CoordVocab:
    """The 1000 coordinate token ids of one tokenizer (spec §2.1).

    Attributes:
        ids: the 1000 ids in bin order (``ids[k]`` is the id of ``<|coord_k|>``); need not be contiguous.
        id_to_bin: inverse map, id → bin.
    """

    ids: tuple[int, ...]
    id_to_bin: dict[int, int] = field(repr=False)

    def __post_init__(self) -> None:
        if len(self.ids) != COORD_BINS or len(set(self.ids)) != COORD_BINS:
            raise CoordVocabError(
                f"CoordVocab needs {COORD_BINS} distinct ids, got {len(self.ids)} ids of which "
                f"{len(set(self.ids))} distinct"
            )
        if (
            any(self.id_to_bin.get(t) != k for k, t in enumerate(self.ids))
            or len(self.id_to_bin) != COORD_BINS
        ):
            raise CoordVocabError("CoordVocab.id_to_bin is not the inverse of CoordVocab.ids")

    @classmethod
    def from_ids(cls, ids: Sequence[int]) -> CoordVocab:
        """Build from the 1000 ids in bin order."""
        ids_t = tuple(int(t) for t in ids)
        return cls(ids=ids_t, id_to_bin={t: k for k, t in enumerate(ids_t)})

    @classmethod
    def from_tokenizer(cls, tokenizer: _TokenizerLike) -> CoordVocab:
        """Resolve ``<|coord_0|>`` … ``<|coord_999|>`` in ``tokenizer`` and check spec §2.1.

        Checks: every string is a known token (not the unknown id), encodes to exactly that one id (also when
        all 1000 are written back to back), decodes back to itself, and the 1000 ids are distinct.

        Raises:
            CoordVocabError: naming the first offending coordinate token and the fix.
        """
        fix = (
            "use a tokenizer that has the 1000 coordinate tokens added (scripts/build_tiny_models.py "
            "shows how)"
        )
        unk = getattr(tokenizer, "unk_token_id", None)
        raw = tokenizer.convert_tokens_to_ids(list(_COORD_STRINGS))
        ids: list[int] = []
        for k, (s, t) in enumerate(zip(_COORD_STRINGS, raw, strict=True)):
            if t is None or (unk is not None and t == unk):
                raise CoordVocabError(f"coordinate token {s!r} (bin {k}) is unknown to the tokenizer; {fix}")
            ids.append(int(t))
        if len(set(ids)) != COORD_BINS:
            seen: dict[int, int] = {}
            for k, t in enumerate(ids):
                if t in seen:
                    raise CoordVocabError(
                        f"coordinate tokens <|coord_{seen[t]}|> and <|coord_{k}|> share id {t}; "
                        f"the 1000 coordinate ids must be distinct; {fix}"
                    )
                seen[t] = k
        joined = tokenizer.encode("".join(_COORD_STRINGS), add_special_tokens=False)
        if list(joined) != ids:
            for k, s in enumerate(_COORD_STRINGS):
                enc = list(tokenizer.encode(s, add_special_tokens=False))
                if enc != [ids[k]]:
                    raise CoordVocabError(
                        f"coordinate token {s!r} encodes to {enc}, expected the single id [{ids[k]}]; {fix}"
                    )
            raise CoordVocabError(
                f"the 1000 coordinate tokens written back to back do not encode to their ids; {fix}"
            )
        for k in (0, 1, 500, _MAX_BIN):
            got = tokenizer.decode([ids[k]], skip_special_tokens=False)
            if got != _COORD_STRINGS[k]:
                raise CoordVocabError(f"id {ids[k]} of {_COORD_STRINGS[k]!r} decodes to {got!r}; {fix}")
        return cls.from_ids(ids)

    def is_coord(self, token_id: int) -> bool:
        """True when ``token_id`` is one of the 1000 coordinate ids."""
        return token_id in self.id_to_bin

    def bin_of(self, token_id: int) -> int:
        """Bin of a coordinate id (KeyError for a non-coordinate id)."""
        return self.id_to_bin[token_id]


# ------------------------------------------------------------------------------------------------------------
# Pixel ↔ bin (offline converter and evaluation; spec §2.2, §2.3)


def _check_size(size: int) -> None:
    if isinstance(size, bool) or not isinstance(size, int) or size < 2:
        raise CoordValueError(f"image side {size!r} must be an int >= 2 pixels to map onto {COORD_BINS} bins")


def _scaled(v: float, size: int) -> float:
    # Multiply before dividing: exact integer results stay exact (5 * 999 / 999 == 5.0), so floor/ceil in the
    # bbox converter never jump a bin because of rounding noise.
    return v * _MAX_BIN / (size - 1)


def _clamp(k: int) -> int:
    return 0 if k < 0 else _MAX_BIN if k > _MAX_BIN else k


def pixel_to_bin(v: float, size: int) -> int:
    """Map a pixel coordinate to its bin: ``round(v / (size − 1) * 999)``, half-to-even, clamped to 0..999.

    Args:
        v: pixel coordinate (x with ``size = width``, y with ``size = height``).
        size: image side in pixels (>= 2).
    """
    _check_size(size)
    if not math.isfinite(v):
        raise CoordValueError(f"pixel coordinate {v!r} is not finite")
    return _clamp(round(_scaled(v, size)))


def bin_to_pixel(k: int, size: int) -> float:
    """Inverse of ``pixel_to_bin``: ``k / 999 * (size − 1)`` pixels."""
    _check_size(size)
    return k / _MAX_BIN * (size - 1)


def anti_collapse(lo: int, hi: int) -> tuple[int, int]:
    """Make a bin interval non-empty (spec §2.3): returns ``(lo, hi)`` with ``lo < hi``.

    ``hi <= lo`` becomes ``hi = lo + 1`` when ``lo < 999``, else ``(998, 999)``.
    """
    if hi > lo:
        return lo, hi
    if lo < _MAX_BIN:
        return lo, lo + 1
    return _MAX_BIN - 1, _MAX_BIN


def bbox_to_bins(bbox: Sequence[float], width: int, height: int) -> list[int]:
    """Convert a pixel bbox ``[x1, y1, x2, y2]`` to bins with floor/ceil and anti-collapse (spec §2.3).

    Returns:
        ``[x1, y1, x2, y2]`` bins with ``x1 < x2`` and ``y1 < y2``.
    """
    if len(bbox) != 4:
        raise CoordValueError(f"bbox {list(bbox)!r} must have 4 values [x1, y1, x2, y2]")
    _check_size(width)
    _check_size(height)
    if not all(math.isfinite(v) for v in bbox):
        raise CoordValueError(f"bbox {list(bbox)!r} has a non-finite value")
    x1, y1, x2, y2 = bbox
    bx1 = _clamp(math.floor(_scaled(x1, width)))
    by1 = _clamp(math.floor(_scaled(y1, height)))
    bx2 = _clamp(math.ceil(_scaled(x2, width)))
    by2 = _clamp(math.ceil(_scaled(y2, height)))
    bx1, bx2 = anti_collapse(bx1, bx2)
    by1, by2 = anti_collapse(by1, by2)
    return [bx1, by1, bx2, by2]


def _flat_points(points: Sequence[Any]) -> list[tuple[int, int]]:
    if points and isinstance(points[0], (list, tuple)):
        if any(len(p) != 2 for p in points):
            raise CoordValueError("polygon points must be [x, y] pairs")
        return [(int(p[0]), int(p[1])) for p in points]
    if len(points) % 2:
        raise CoordValueError(f"flat polygon has an odd number of values ({len(points)})")
    return [(int(points[j]), int(points[j + 1])) for j in range(0, len(points), 2)]


def canonicalize_poly(
    points: Sequence[int] | Sequence[Sequence[int]],
) -> tuple[Literal["poly", "bbox_2d"], list[int]]:
    """Canonicalize a quantized polygon (spec §2.4).

    Steps: drop a closing duplicate vertex; order vertices by ascending ``atan2(y − cy, x − cx)`` around the
    vertex mean (stable, so ties keep input order; clockwise on screen since y points down); rotate so the
    top-most (min y, then min x) vertex comes first. A zero-area result (shoelace) becomes the ``bbox_2d`` of
    the vertices' extent, with the anti-collapse rule of §2.3.

    Args:
        points: bins as a flat ``[x1, y1, x2, y2, ...]`` list or a list of ``[x, y]`` pairs.

    Returns:
        ``("poly", flat_bins)`` or ``("bbox_2d", [x1, y1, x2, y2])``.
    """
    pts = _flat_points(points)
    if len(pts) > 1 and pts[-1] == pts[0]:
        pts = pts[:-1]
    if not pts:
        raise CoordValueError("polygon has no vertices")
    cx = sum(p[0] for p in pts) / len(pts)
    cy = sum(p[1] for p in pts) / len(pts)
    ordered = sorted(pts, key=lambda p: math.atan2(p[1] - cy, p[0] - cx))
    top = min(range(len(ordered)), key=lambda j: (ordered[j][1], ordered[j][0]))
    ordered = ordered[top:] + ordered[:top]
    twice_area = sum(
        ordered[j][0] * ordered[(j + 1) % len(ordered)][1]
        - ordered[(j + 1) % len(ordered)][0] * ordered[j][1]
        for j in range(len(ordered))
    )
    if len(ordered) < 3 or twice_area == 0:
        xs = [p[0] for p in ordered]
        ys = [p[1] for p in ordered]
        x1, x2 = anti_collapse(min(xs), max(xs))
        y1, y2 = anti_collapse(min(ys), max(ys))
        return "bbox_2d", [x1, y1, x2, y2]
    return "poly", [c for p in ordered for c in p]


# ------------------------------------------------------------------------------------------------------------
# Coordinate values in data records (spec §1.3)


_COORD_STRING_BINS = {f"<|coord_{k}|>": k for k in range(1000)}


def parse_coord_string(s: str) -> int:
    """Bin of a coordinate-token string ``"<|coord_k|>"`` (k in 0..999).

    Raises:
        CoordValueError: ``s`` is not such a string.
    """
    k = _COORD_STRING_BINS.get(s)
    if k is not None:  # the common case, without a regex
        return k
    m = COORD_TOKEN_RE.fullmatch(s)
    if m is None:
        raise CoordValueError(f"coordinate string {s!r} is not of the form '<|coord_k|>'")
    k = int(m.group(1))
    if k > _MAX_BIN:
        raise CoordValueError(f"coordinate string {s!r} has bin {k} outside 0..{_MAX_BIN}")
    return k


def _parse_number(v: int | float) -> int:
    if isinstance(v, float):
        if not math.isfinite(v):
            raise CoordValueError(f"coordinate {v!r} is not finite")
        k = round(v)  # half-to-even
    else:
        k = v
    if not 0 <= k <= _MAX_BIN:
        raise CoordValueError(
            f"coordinate {v!r} is outside 0..{_MAX_BIN}; pixel coordinates must be converted offline (spec "
            "§2.2)"
        )
    return int(k)


def parse_coord_values(values: Iterable[Any]) -> list[int]:
    """Parse one object's coordinate values into bins (spec §1.3).

    Every value is a coordinate-token string, or a number (int, or finite float rounded half-to-even) in
    0..999; booleans are rejected and one object must not mix strings and numbers.

    Raises:
        CoordValueError: naming the first bad value.
    """
    if not isinstance(values, (list, tuple)):
        values = list(values)  # read an iterator once
    try:
        # The common case, all coordinate-token strings: join accepts only strings (as the loop's isinstance
        # does), the lookup only the 1000 exact ones; anything else takes the loop (same result or error).
        "".join(values)
        return list(map(_COORD_STRING_BINS.__getitem__, values))
    except (KeyError, TypeError):
        pass
    out: list[int] = []
    form: str | None = None
    for v in values:
        if isinstance(v, bool):
            raise CoordValueError(f"coordinate {v!r} is a boolean")
        if isinstance(v, str):
            this = "string"
            k = parse_coord_string(v)
        elif isinstance(v, (int, float)):
            this = "number"
            k = _parse_number(v)
        else:
            raise CoordValueError(
                f"coordinate {v!r} of type {type(v).__name__} is neither a coord string nor a number"
            )
        if form is None:
            form = this
        elif form != this:
            raise CoordValueError(f"coordinate {v!r} mixes coord strings and numbers within one object")
        out.append(k)
    return out
