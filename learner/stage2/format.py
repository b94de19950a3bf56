"""Assistant output format: the single-line JSON answer (docs/ALGORITHM.md#output-format).

``{"object_1": {"desc": "cat", "bbox_2d": ["<|coord_156|>", ...]},
"object_2": {"desc": ..., "poly": [[x, y], ...]}}`` with
``json.dumps(..., ensure_ascii=False, separators=(", ", ": "))``. The same entry serializer builds the
teacher-forcing tail of §10 (FN objects numbered from ``max_object_index_in_prefix + 1``).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from typing import Protocol

from learner.stage2.coords import COORD_BINS, coord_token

__all__ = ["GEOM_TYPES", "SerializableObject", "geometry_value", "serialize_entry", "serialize_objects"]

GEOM_TYPES = ("bbox_2d", "poly")
_COORD_STRINGS = tuple(coord_token(k) for k in range(COORD_BINS))


class SerializableObject(Protocol):
    """Anything with a desc, a geometry type and flat bins (``GTObject`` satisfies it)."""

    @property
    def desc(self) -> str: ...

    @property
    def geom_type(self) -> str: ...

    @property
    def bins(self) -> Sequence[int]: ...


def _coord_strings(bins: Sequence[int]) -> list[str]:
    """``coord_token`` of every bin; plain ints in 0..999 by table lookup (anything else via coord_token)."""
    if all(type(k) is int and 0 <= k < COORD_BINS for k in bins):
        return [_COORD_STRINGS[k] for k in bins]
    return [coord_token(k) for k in bins]


_ENCODER = json.JSONEncoder(ensure_ascii=False, separators=(", ", ": "))
"""What ``json.dumps(value, ensure_ascii=False, separators=(", ", ": "))`` builds per call (stateless)."""


def _dumps(value: object) -> str:
    return _ENCODER.encode(value)


def geometry_value(geom_type: str, bins: Sequence[int]) -> list[str] | list[list[str]]:
    """The JSON value of a geometry: bbox as 4 flat coord strings, poly as ``[x, y]`` pairs of coord strings.

    Raises:
        ValueError: unknown ``geom_type``, or a bbox without exactly 4 bins, or a poly with an odd count or
            fewer than 6 bins.
    """
    if geom_type == "bbox_2d":
        if len(bins) != 4:
            raise ValueError(f"bbox_2d needs exactly 4 bins, got {len(bins)}: {list(bins)!r}")
        return _coord_strings(bins)
    if geom_type == "poly":
        if len(bins) < 6 or len(bins) % 2:
            raise ValueError(f"poly needs an even number >= 6 of bins, got {len(bins)}: {list(bins)!r}")
        flat = _coord_strings(bins)
        return [[flat[j], flat[j + 1]] for j in range(0, len(flat), 2)]
    raise ValueError(f"geometry type {geom_type!r} is not one of {GEOM_TYPES}")


def serialize_entry(n: int, desc: str, geom_type: str, bins: Sequence[int]) -> str:
    """Serialize one entry ``"object_<n>": {"desc": ..., <geom_type>: ...}`` (no separator around it).

    Args:
        n: object number (>= 1).
        desc: object description.
        geom_type: ``"bbox_2d"`` or ``"poly"``.
        bins: flat bins ``[x1, y1, x2, y2, ...]``, each in 0..999.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"object number {n!r} must be an int >= 1")
    value = geometry_value(geom_type, bins)
    # The text _dumps({"desc": desc, geom_type: value}) gives, written directly: the geometry key and
    # coordinate strings need no escaping, so only the desc goes through json.
    return f'"object_{n}": {{"desc": {_dumps(desc)}, "{geom_type}": {_geometry_json(value)}}}'


def _geometry_json(value: list[str] | list[list[str]]) -> str:
    if value and isinstance(value[0], list):
        return "[" + ", ".join(f'["{x}", "{y}"]' for x, y in value) + "]"
    return '["' + '", "'.join(value) + '"]' if value else "[]"  # type: ignore[arg-type]


def serialize_objects(objects: Iterable[SerializableObject], start: int = 1) -> str:
    """Serialize a whole answer: ``{"object_1": ..., "object_2": ...}``, or ``{}`` when there are no objects.

    Args:
        objects: objects in output (GT) order.
        start: number of the first key.
    """
    entries = [serialize_entry(start + j, o.desc, o.geom_type, o.bins) for j, o in enumerate(objects)]
    return "{" + ", ".join(entries) + "}"
