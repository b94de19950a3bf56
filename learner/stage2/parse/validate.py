"""Per-object validation of the strict parser (docs/ALGORITHM.md#object-validation, rules 1–6).

``validate_value`` checks arbitrary object text (JSON, keys, desc, geometry shape, coordinate strings,
captured token count and bins); ``check_geometry`` is the part shared with the parser's fast path for values
written exactly in the serializer format.
"""

from __future__ import annotations

import json
from typing import Any

from learner.stage2.coords import COORD_BINS, COORD_TOKEN_RE

__all__ = ["ALLOWED_KEYS", "GEOM_KEYS", "check_geometry", "validate_value"]

GEOM_KEYS = ("bbox_2d", "poly")
ALLOWED_KEYS = frozenset(("desc", "bbox_2d", "poly"))


class _DuplicateKey(ValueError):
    pass


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    d = dict(pairs)
    if len(d) != len(pairs):
        raise _DuplicateKey
    return d


def _bin(s: str) -> int | None:
    m = COORD_TOKEN_RE.fullmatch(s)
    if m is None:
        return None
    k = int(m.group(1))
    return k if k < COORD_BINS else None


def check_geometry(geom: str, values: list[int], captured_bins: list[int]) -> str | None:
    n = len(values)
    if geom == "bbox_2d":
        if n != 4:
            return f"bbox_2d has {n} values, expected 4"
    elif n < 6 or n % 2:
        return f"poly has {n} values, expected an even number >= 6"
    if len(captured_bins) != n:
        return f"{len(captured_bins)} coordinate tokens captured for {n} values"
    if captured_bins != values:
        return "captured coordinate tokens differ from the written values (coordinate written as plain text?)"
    return None


def validate_value(
    value_text: str, captured_bins: list[int]
) -> tuple[str | None, str | None, list[int], str | None]:
    """Rules 1–6 of §6.7 on arbitrary text; returns ``(desc, geom, bins, reason)``."""
    try:
        value = json.loads(value_text, object_pairs_hook=_no_duplicates)
    except _DuplicateKey:
        return None, None, [], "duplicate key in object"
    except (ValueError, RecursionError):
        return None, None, [], "value is not valid JSON"
    if not isinstance(value, dict):
        return None, None, [], "value is not a JSON object"
    extra = set(value) - ALLOWED_KEYS
    if extra:
        return None, None, [], f"unexpected keys {sorted(extra)}"
    desc = value.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        return None, None, [], "desc missing or empty"
    geoms = [g for g in GEOM_KEYS if g in value]
    if len(geoms) != 1:
        return desc, None, [], "needs exactly one of bbox_2d / poly"
    geom = geoms[0]
    raw = value[geom]
    if not isinstance(raw, list):
        return desc, geom, [], f"{geom} is not a list"
    if all(isinstance(v, str) for v in raw):
        flat = raw
    elif all(isinstance(v, list) and len(v) == 2 and all(isinstance(x, str) for x in v) for v in raw):
        flat = [x for v in raw for x in v]
    else:
        return desc, geom, [], f"{geom} is neither a flat list of strings nor a list of [x, y] string pairs"
    values: list[int] = []
    for s in flat:
        k = _bin(s)
        if k is None:
            return desc, geom, [], f"{geom} value {s[:40]!r} is not a coordinate token string"
        values.append(k)
    return desc, geom, values, check_geometry(geom, values, captured_bins)
