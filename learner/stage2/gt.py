"""Ground-truth objects: validation, ordering and extraction (docs/ALGORITHM.md#records §1.2–§1.4, §7).

``order_objects`` runs at load time (the dataset orders raw objects, §1.4); ``extract_gt`` runs per sample in
the learner and turns the ordered raw objects into ``GTObject``s, excluding, counting and logging malformed
ones (§7). A malformed object keeps its position: GT indices are 1-based positions in the ordered list.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np

from learner.stage2.coords import CoordValueError, parse_coord_values

__all__ = [
    "GTObject",
    "GtExtraction",
    "MalformedGTError",
    "MalformedLogLimiter",
    "MalformedObjectError",
    "extract_gt",
    "object_anchor",
    "order_objects",
    "parse_gt_object",
]

logger = logging.getLogger(__name__)

GeomType = Literal["bbox_2d", "poly"]


@dataclass(frozen=True, slots=True)
class GTObject:
    """One well-formed ground-truth object.

    Attributes:
        index: 1-based position in the ordered object list (the GT index of §1.4; also FN append order).
        desc: description, non-empty after stripping (kept as written).
        geom_type: ``"bbox_2d"`` or ``"poly"``.
        bins: flat bins in 0..999 (4 for a bbox, an even number >= 6 for a poly).
    """

    index: int
    desc: str
    geom_type: GeomType
    bins: tuple[int, ...]


@dataclass(frozen=True)
class GtExtraction:
    """Result of ``extract_gt``.

    Attributes:
        objects: well-formed objects in GT order.
        malformed: ``(position, reason)`` per malformed object; position is 1-based like ``GTObject.index``.
    """

    objects: list[GTObject]
    malformed: list[tuple[int, str]] = field(default_factory=list)

    @property
    def n_malformed(self) -> int:
        """Count for ``rollout/gt_malformed``."""
        return len(self.malformed)


class MalformedObjectError(ValueError):
    """One raw object violates §1.2/§1.3; the message is the reason."""


class MalformedGTError(ValueError):
    """Raised by ``extract_gt`` under ``malformed_policy: raise`` (data audits)."""

    def __init__(self, sample_id: int, position: int, reason: str) -> None:
        self.sample_id = sample_id
        self.position = position
        self.reason = reason
        super().__init__(
            f"sample {sample_id}: GT object at position {position} is malformed: {reason} "
            "(set stage2.gt.malformed_policy: skip to exclude such objects instead)"
        )


def parse_gt_object(obj: Any) -> tuple[str, GeomType, tuple[int, ...]]:
    """Validate one raw object (§1.2, §1.3) and return ``(desc, geom_type, bins)``.

    Raises:
        MalformedObjectError: with the reason (empty desc, zero or two geometries, wrong arity, bad value,
            mixed forms, ``poly_points`` mismatch, ...).
    """
    if type(obj) is not dict and not isinstance(obj, Mapping):  # a dict skips the slower ABC check
        raise MalformedObjectError(f"object is a {type(obj).__name__}, not a mapping")
    desc = obj.get("desc")
    if not isinstance(desc, str) or not desc.strip():
        raise MalformedObjectError(f"desc {desc!r} is not a non-empty string")
    has_bbox, has_poly = obj.get("bbox_2d") is not None, obj.get("poly") is not None
    if has_bbox == has_poly:
        raise MalformedObjectError(
            "object has both bbox_2d and poly" if has_bbox else "object has neither bbox_2d nor poly"
        )
    geom: GeomType = "bbox_2d" if has_bbox else "poly"
    raw = obj[geom]
    if not isinstance(raw, list):
        raise MalformedObjectError(f"{geom} is a {type(raw).__name__}, not a list")
    try:
        if geom == "bbox_2d":
            if len(raw) != 4:
                raise MalformedObjectError(f"bbox_2d has {len(raw)} values, expected 4")
            bins = parse_coord_values(raw)
        else:
            bins = parse_coord_values(_flatten_poly(raw))
            if len(bins) < 6 or len(bins) % 2:
                raise MalformedObjectError(f"poly has {len(bins)} values, expected an even number >= 6")
            if "poly_points" in obj and obj["poly_points"] is not None:
                pp = obj["poly_points"]
                if isinstance(pp, bool) or not isinstance(pp, int) or pp != len(bins) // 2:
                    raise MalformedObjectError(f"poly_points {pp!r} != {len(bins) // 2} points in poly")
    except CoordValueError as exc:
        raise MalformedObjectError(f"{geom}: {exc}") from exc
    return desc, geom, tuple(bins)


def _flatten_poly(raw: list[Any]) -> list[Any]:
    if not any(issubclass(t, (list, tuple)) for t in set(map(type, raw))):
        return raw  # flat, the common case: one C-level pass over the value types
    nested = [isinstance(v, (list, tuple)) for v in raw]
    if not any(nested):
        return raw
    if not all(nested):
        raise MalformedObjectError("poly mixes flat values and [x, y] pairs")
    if any(len(p) != 2 for p in raw):
        raise MalformedObjectError("poly has a point that is not an [x, y] pair")
    return [v for p in raw for v in p]


# ------------------------------------------------------------------------------------------------------------
# Malformed-object logging with a per-process cap (§7)


class MalformedLogLimiter:
    """Logs the first ``log_max`` malformed objects individually, then counts the rest for a summary line.

    The trainer calls ``flush_summary()`` once per logging step; it logs one line when objects were
    suppressed. Thread-safe (a dataloader worker thread may extract GT).
    """

    def __init__(self, log_max: int = 20) -> None:
        if log_max < 0:
            raise ValueError(f"stage2.gt.malformed_log_max {log_max} must be >= 0")
        self.log_max = log_max
        self.logged = 0
        self.suppressed = 0
        self._lock = threading.Lock()

    def record(self, sample_id: int, position: int, reason: str) -> None:
        """Log one malformed object at WARNING, or count it once the cap is reached."""
        with self._lock:
            if self.logged < self.log_max:
                self.logged += 1
                individually = True
            else:
                self.suppressed += 1
                individually = False
        if individually:
            logger.warning(
                "sample_id %d: malformed GT object at position %d excluded: %s", sample_id, position, reason
            )

    def flush_summary(self) -> int:
        """Log one summary line for the objects suppressed since the last call; return that count."""
        with self._lock:
            n, self.suppressed = self.suppressed, 0
        if n:
            logger.warning(
                "%d more malformed GT objects excluded since the last logging step (individual logs capped "
                "at %d)",
                n,
                self.log_max,
            )
        return n


_DEFAULT_LIMITER = MalformedLogLimiter()


def extract_gt(
    objects: Sequence[Any],
    sample_id: int,
    policy: Literal["skip", "raise"] = "skip",
    limiter: MalformedLogLimiter | None = None,
) -> GtExtraction:
    """Build the ``GTObject``s of one sample from its ordered raw objects (§7).

    Args:
        objects: the sample's ``gt_objects`` (already in §1.4 order).
        sample_id: for log lines and errors.
        policy: ``stage2.gt.malformed_policy``: ``skip`` excludes, counts and logs malformed objects;
            ``raise`` raises on the first.
        limiter: log cap (``stage2.gt.malformed_log_max``); defaults to a per-process limiter of 20.

    Returns:
        ``GtExtraction`` with the well-formed objects (``index`` = 1-based position) and the malformed ones.

    Raises:
        MalformedGTError: under ``policy="raise"``.
    """
    if policy not in ("skip", "raise"):
        raise ValueError(f"stage2.gt.malformed_policy {policy!r} must be 'skip' or 'raise'")
    lim = limiter if limiter is not None else _DEFAULT_LIMITER
    good: list[GTObject] = []
    bad: list[tuple[int, str]] = []
    for pos, obj in enumerate(objects, start=1):
        try:
            desc, geom, bins = parse_gt_object(obj)
        except MalformedObjectError as exc:
            if policy == "raise":
                raise MalformedGTError(sample_id, pos, str(exc)) from exc
            bad.append((pos, str(exc)))
            lim.record(sample_id, pos, str(exc))
            continue
        good.append(GTObject(pos, desc, geom, bins))
    return GtExtraction(objects=good, malformed=bad)


# ------------------------------------------------------------------------------------------------------------
# Ordering (§1.4)


def object_anchor(obj: Any) -> tuple[int, int] | None:
    """Anchor ``(y, x)`` of a raw object: ``(y1, x1)`` of a bbox, the smallest ``(y, x)`` vertex of a poly.

    Returns ``None`` for a malformed object (it has no well-defined anchor).
    """
    try:
        _, geom, bins = parse_gt_object(obj)
    except MalformedObjectError:
        return None
    return geometry_anchor(geom, bins)


def geometry_anchor(geom: str, bins: Sequence[int]) -> tuple[int, int]:
    """``(y, x)`` sort key of a well-formed geometry: a bbox's ``(y1, x1)``, a poly's smallest vertex."""
    if geom == "bbox_2d":
        return bins[1], bins[0]
    return min((bins[j + 1], bins[j]) for j in range(0, len(bins), 2))


def anchor_order(objects: Sequence[GTObject]) -> list[int]:
    """Indices of ``objects`` in ``data.object_ordering: sorted``'s order (stable by ``(y, x)`` anchor)."""
    return sorted(
        range(len(objects)), key=lambda j: (geometry_anchor(objects[j].geom_type, objects[j].bins), j)
    )


def order_objects(
    objects: Sequence[Any],
    ordering: Literal["sorted", "random"] = "sorted",
    *,
    seed: int = 0,
    base_idx: int = 0,
) -> list[Any]:
    """Order one record's raw objects (``data.object_ordering``, §1.4); the input is not modified.

    ``sorted``: stable sort by the ``(y, x)`` anchor; malformed objects (no anchor) go last in their original
    relative order, so they never displace well-formed ones. ``random``: a permutation drawn from an RNG
    seeded with ``(seed, base_idx)`` (reproducible across runs and processes).
    """
    if ordering == "sorted":
        keyed = [(object_anchor(o), j, o) for j, o in enumerate(objects)]
        good = sorted((k for k in keyed if k[0] is not None), key=lambda k: (k[0], k[1]))
        rest = [k for k in keyed if k[0] is None]
        return [k[2] for k in good + rest]
    if ordering == "random":
        if seed < 0 or base_idx < 0:
            raise ValueError(f"random ordering needs seed >= 0 and base_idx >= 0, got {seed}, {base_idx}")
        perm = np.random.default_rng([seed, base_idx]).permutation(len(objects))
        return [objects[int(j)] for j in perm]
    raise ValueError(f"data.object_ordering {ordering!r} must be 'sorted' or 'random'")
