"""Synthetic detection set for the one-command CPU demo (docs/ARCHITECTURE.md#demos).

The demo model is a tiny text-only Qwen2 LM, so the "image" is replaced by a text description of the scene
that the learner appends to the user prompt (``learner.data.records.record_user_text``). Records follow
docs/ALGORITHM.md#records §1.1 except that ``images`` is EMPTY: the data loader must accept text-only records
for the demo (no image part in the user message). ``width`` and ``height`` are 1000, so pixel values and
norm1000 bins coincide (§2.2).

Design choices that make the task learnable by the ~0.5M-parameter ``tiny`` model in ~100–150 SFT steps
(measured by the SFT probe of docs/EXPERIMENTS.md; the model must first get a generic copy circuit, see
scripts/copy_pretrain.py — from random init the same circuit needs ≥ 25k training samples):

- The scene text lists the objects in the same order as the answer (§1.4 ``sorted``: anchor ``(y, x)``),
  each as ``desc`` immediately followed by its coordinate tokens in answer order (style ``tight``), so the
  answer is a structured copy of the scene: "emit the scene token that follows the last content token I
  emitted", wrapped in the JSON grammar of §4. Sorting on the model's side would need far more capacity.
- ``distinct`` (default): no coordinate value and no desc repeats within a scene, so every content token of
  the scene identifies its successor unambiguously (with repeats the copy is ambiguous and learns slower).
- Coordinates lie on a coarse grid (default every 20 bins, 50 values per axis), so every coord token the
  model must copy is seen often during training; the coord tokens of the tokenizer stay single ids.
- Objects are large (sides 100..360 bins) and overlap little (pairwise AABB IoU ≤ 0.2), so a prediction that
  is off by one grid step on one coordinate still passes the IoU gates of evaluation (maskIoU 0.3, §18) and
  of the probe (IoU 0.5), and a prediction cannot match two GT objects.
- Two categories are polygons with a fixed vertex count (``tree``: triangle, ``rug``: quadrilateral), so
  the geometry key and ring length follow from the desc. Rings are canonical (§2.4: clockwise on screen,
  starting at the top-most then left-most vertex) and stored flat in ``poly`` with ``poly_points``.
- Every category word is one token of the demo tokenizer, both as ``"cat"`` in the answer and ``cat`` in
  the scene text.

Everything is pure and seeded: the same ``(seed, split, n, config)`` always yields the same records, and
the train and eval splits come from independent RNG streams.
"""

from __future__ import annotations

import json
import logging
import math
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from learner.demo_data.files import write_if_changed

__all__ = [
    "CATEGORIES",
    "DemoDataConfig",
    "SceneObject",
    "canonical_ring",
    "coord_token",
    "describe_scene",
    "generate_records",
    "make_record",
    "record_objects",
    "sample_scene",
    "write_demo_dataset",
]

logger = logging.getLogger(__name__)

Shape = Literal["bbox", "triangle", "quad"]

# Category → geometry. Words are single tokens of the demo tokenizer (DEMO_WORDS in
# scripts/build_tiny_models.py).
CATEGORIES: dict[str, Shape] = {
    "cat": "bbox",
    "dog": "bbox",
    "car": "bbox",
    "lamp": "bbox",
    "chair": "bbox",
    "person": "bbox",
    "tree": "triangle",
    "rug": "quad",
}

SceneStyle = Literal["tight", "compact", "verbose"]


@dataclass(frozen=True)
class DemoDataConfig:
    """Knobs of the generator (all sizes in norm1000 bins).

    Attributes:
        grid: every coordinate is a multiple of ``grid`` (1 = full resolution).
        min_objects: fewest objects per scene (≥ 1).
        max_objects: most objects per scene.
        min_size: smallest side of an object's bounding box.
        max_size: largest side of an object's bounding box.
        max_pair_iou: largest AABB IoU allowed between two objects of one scene.
        distinct: every coordinate value and every desc occurs at most once per scene, so each content
            token of the scene identifies its successor (what a copy head keys on).
        scene_style: see :func:`describe_scene`.
        categories: category → geometry; order matters for sampling.
    """

    grid: int = 20
    min_objects: int = 1
    max_objects: int = 6
    min_size: int = 100
    max_size: int = 360
    max_pair_iou: float = 0.2
    distinct: bool = True
    scene_style: SceneStyle = "tight"
    categories: dict[str, Shape] = field(default_factory=lambda: dict(CATEGORIES))

    def __post_init__(self) -> None:
        if not 1 <= self.grid <= 100:
            raise ValueError(f"DemoDataConfig.grid={self.grid}: must be in 1..100")
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(
                f"DemoDataConfig: min_objects={self.min_objects}, max_objects={self.max_objects}; "
                "need 1 <= min_objects <= max_objects"
            )
        if not self.grid <= self.min_size <= self.max_size <= 999 - self.grid:
            raise ValueError(
                f"DemoDataConfig: min_size={self.min_size}, max_size={self.max_size}, grid={self.grid}; "
                "need grid <= min_size <= max_size <= 999 - grid"
            )
        if not self.categories or any(
            s not in ("bbox", "triangle", "quad") for s in self.categories.values()
        ):
            raise ValueError(f"DemoDataConfig.categories={self.categories}: need shapes bbox|triangle|quad")
        if self.scene_style not in ("tight", "compact", "verbose"):
            raise ValueError(
                f"DemoDataConfig.scene_style={self.scene_style!r}: use 'tight', 'compact' or 'verbose'"
            )
        if self.distinct and self.max_objects > len(self.categories):
            raise ValueError(
                f"DemoDataConfig: distinct=True needs max_objects={self.max_objects} <= "
                f"{len(self.categories)} categories"
            )


@dataclass(frozen=True)
class SceneObject:
    """One GT object in norm1000 bins.

    Attributes:
        desc: category word.
        geom: ``bbox_2d`` or ``poly``.
        coords: ``(x1, y1, x2, y2)`` for a bbox (x1 < x2, y1 < y2); for a poly the canonical ring flattened
            as ``(x, y, x, y, ...)`` (§2.4), first vertex = anchor.
    """

    desc: str
    geom: Literal["bbox_2d", "poly"]
    coords: tuple[int, ...]

    @property
    def anchor(self) -> tuple[int, int]:
        """The §1.4 sort key ``(y, x)``: bbox ``(y1, x1)``, poly its smallest ``(y, x)`` vertex."""
        if self.geom == "bbox_2d":
            return self.coords[1], self.coords[0]
        return min((self.coords[i + 1], self.coords[i]) for i in range(0, len(self.coords), 2))

    @property
    def aabb(self) -> tuple[int, int, int, int]:
        """Axis-aligned extent ``(x1, y1, x2, y2)``."""
        xs, ys = self.coords[0::2], self.coords[1::2]
        return min(xs), min(ys), max(xs), max(ys)


def coord_token(k: int) -> str:
    """The coordinate-token string of bin ``k`` (§2.1)."""
    if not 0 <= k <= 999 or isinstance(k, bool):
        raise ValueError(f"coordinate bin {k!r} outside 0..999")
    return f"<|coord_{k}|>"


def canonical_ring(points: Sequence[tuple[int, int]]) -> list[tuple[int, int]]:
    """§2.4 steps 1–3: drop a closing duplicate, sort clockwise (y down) around the mean, start top-left.

    Args:
        points: integer vertices ``(x, y)``.

    Returns:
        The reordered vertices; zero-area handling (step 4) is the caller's business.
    """
    pts = list(points)
    if len(pts) > 1 and pts[-1] == pts[0]:
        pts = pts[:-1]
    cx = sum(p[0] for p in pts) / len(pts)
    cy = sum(p[1] for p in pts) / len(pts)
    # sorted() is stable, so equal angles keep their input order as §2.4 requires.
    pts = sorted(pts, key=lambda p: math.atan2(p[1] - cy, p[0] - cx))
    start = min(range(len(pts)), key=lambda i: (pts[i][1], pts[i][0]))
    return pts[start:] + pts[:start]


def _aabb_iou(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> float:
    iw = max(0, min(a[2], b[2]) - max(a[0], b[0]))
    ih = max(0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = iw * ih
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def _grid_value(rng: random.Random, lo: int, hi: int, grid: int) -> int:
    """A uniform multiple of ``grid`` in ``[lo, hi]`` (both rounded inward to the grid)."""
    first, last = -(-lo // grid), hi // grid
    return rng.randint(first, last) * grid


def _sample_shape(rng: random.Random, desc: str, shape: Shape, cfg: DemoDataConfig) -> SceneObject:
    g = cfg.grid
    top = (999 // g) * g  # largest coordinate on the grid
    w = _grid_value(rng, cfg.min_size, cfg.max_size, g)
    h = _grid_value(rng, cfg.min_size, cfg.max_size, g)
    x1 = _grid_value(rng, 0, top - w, g)
    y1 = _grid_value(rng, 0, top - h, g)
    x2, y2 = x1 + w, y1 + h
    if shape == "bbox":
        return SceneObject(desc, "bbox_2d", (x1, y1, x2, y2))
    if shape == "triangle":
        # Apex on the top edge, base corners on the bottom quarter (tilted so that all values can differ):
        # area ≥ w*h/4, never degenerate.
        apex = _grid_value(rng, x1 + w // 4, x2 - w // 4, g)
        ring = [
            (apex, y1),
            (x2, y2 - _grid_value(rng, 0, h // 4, g)),
            (x1, y2 - _grid_value(rng, 0, h // 4, g)),
        ]
    else:
        # Each corner moves inward by at most a quarter side: the quad stays convex with area ≥ w*h/2.
        dx, dy = max(g, (w // 4) // g * g), max(g, (h // 4) // g * g)
        corners = [(x1, y1, 1, 1), (x2, y1, -1, 1), (x2, y2, -1, -1), (x1, y2, 1, -1)]
        ring = [
            (x + sx * _grid_value(rng, 0, dx, g), y + sy * _grid_value(rng, 0, dy, g))
            for x, y, sx, sy in corners
        ]
    ring = canonical_ring(ring)
    return SceneObject(desc, "poly", tuple(v for p in ring for v in p))


def sample_scene(rng: random.Random, cfg: DemoDataConfig) -> list[SceneObject]:
    """Draw one scene: ``min_objects..max_objects`` objects, sorted by the §1.4 anchor (stable).

    Objects are placed by rejection sampling so that no two AABBs overlap by more than ``max_pair_iou``
    (and, with ``distinct``, no coordinate value or desc repeats); when a scene is too crowded to place
    another object after 50 tries per object, it keeps fewer objects (never fewer than one).
    """
    names = list(cfg.categories)
    target = rng.randint(cfg.min_objects, cfg.max_objects)
    objects: list[SceneObject] = []
    used: set[int] = set()
    tries = 0
    while len(objects) < target and tries < 50 * target:
        pool = [n for n in names if n not in {o.desc for o in objects}] if cfg.distinct else names
        desc = rng.choice(pool)
        # Retry the shape for the chosen desc first, so that polygons (more values to keep distinct) are
        # not rejected more often than boxes and the category mix stays uniform.
        for _ in range(50):
            tries += 1
            obj = _sample_shape(rng, desc, cfg.categories[desc], cfg)
            if cfg.distinct and (len(set(obj.coords)) < len(obj.coords) or used.intersection(obj.coords)):
                continue
            if all(_aabb_iou(obj.aabb, o.aabb) <= cfg.max_pair_iou for o in objects):
                objects.append(obj)
                used.update(obj.coords)
                break
    return sorted(objects, key=lambda o: o.anchor)


def describe_scene(objects: Sequence[SceneObject], style: SceneStyle = "tight") -> str:
    """The scene text the learner appends to the user prompt, objects in the given order.

    Styles (``c`` stands for a coordinate token, written in answer order):
    - ``tight``: ``Scene: cat<c><c><c><c> tree<c><c><c><c><c><c>.`` — the content tokens of the answer
      (desc word, then coordinates) with one space before each desc; the answer is this sequence wrapped
      in JSON, and each content token is directly followed by the next one.
    - ``compact``: ``Scene: cat <c><c><c><c>, tree <c>...``.
    - ``verbose``: ``Scene: cat box <c> <c> <c> <c>; tree polygon <c> ...``.
    An empty scene is ``Scene: nothing.``
    """
    if not objects:
        return "Scene: nothing."
    parts = []
    for o in objects:
        toks = [coord_token(v) for v in o.coords]
        if style == "tight":
            parts.append(f"{o.desc}{''.join(toks)}")
        elif style == "compact":
            parts.append(f"{o.desc} {''.join(toks)}")
        else:
            kind = "box" if o.geom == "bbox_2d" else "polygon"
            parts.append(f"{o.desc} {kind} {' '.join(toks)}")
    sep = {"tight": " ", "compact": ", ", "verbose": "; "}[style]
    return "Scene: " + sep.join(parts) + "."


def record_objects(objects: Sequence[SceneObject]) -> list[dict[str, Any]]:
    """The §1.2 ``objects`` list: ``desc`` plus ``bbox_2d`` or ``poly`` (flat) as coord-token strings, and
    ``poly_points`` for polygons; order kept."""
    out_objects: list[dict[str, Any]] = []
    for o in objects:
        entry: dict[str, Any] = {"desc": o.desc, o.geom: [coord_token(v) for v in o.coords]}
        if o.geom == "poly":
            entry["poly_points"] = len(o.coords) // 2
        out_objects.append(entry)
    return out_objects


def make_record(objects: Sequence[SceneObject], record_id: str, cfg: DemoDataConfig) -> dict[str, Any]:
    """One §1.1 record (text-only: ``images`` is empty) with coord-token strings and the scene text."""
    return {
        "images": [],
        "width": 1000,
        "height": 1000,
        "objects": record_objects(objects),
        "metadata": {"id": record_id, "scene": describe_scene(objects, cfg.scene_style), "grid": cfg.grid},
    }


def generate_records(
    n: int, seed: int, split: str, cfg: DemoDataConfig | None = None
) -> list[dict[str, Any]]:
    """``n`` records of one split; identical for identical arguments.

    The RNG is seeded from the string ``"rollmatch-demo/{split}/{seed}"`` (Python's str seeding is a
    SHA-512 of the text, stable across runs and platforms), so splits never share a stream.
    """
    if n < 0:
        raise ValueError(f"generate_records: n={n} must be >= 0")
    cfg = cfg or DemoDataConfig()
    rng = random.Random(f"rollmatch-demo/{split}/{seed}")
    return [make_record(sample_scene(rng, cfg), f"demo-{split}-{seed}-{i:06d}", cfg) for i in range(n)]


def write_demo_dataset(
    out_dir: Path | str, n_train: int, n_eval: int, seed: int, cfg: DemoDataConfig | None = None
) -> tuple[Path, Path]:
    """Write ``train.jsonl`` and ``eval.jsonl`` (plus ``manifest.json``) into ``out_dir``.

    Idempotent: files whose content would not change are left untouched (mtime kept). The eval split uses
    the same ``seed`` with its own RNG stream (split name ``eval``), so it never repeats training scenes'
    random draws.

    Args:
        out_dir: target directory, created if missing.
        n_train: number of training records.
        n_eval: number of held-out records.
        seed: base seed.
        cfg: generator knobs (default :class:`DemoDataConfig`).

    Returns:
        ``(train_path, eval_path)``.
    """
    cfg = cfg or DemoDataConfig()
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("eval", n_eval)):
        path = out / f"{split}.jsonl"
        lines = [json.dumps(r, ensure_ascii=False) + "\n" for r in generate_records(n, seed, split, cfg)]
        write_if_changed(path, "".join(lines).encode("utf-8"))
        paths.append(path)
    manifest = {"seed": seed, "n_train": n_train, "n_eval": n_eval, "config": asdict(cfg)}
    write_if_changed(
        out / "manifest.json", (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode("utf-8")
    )
    logger.info("demo dataset in %s: %d train, %d eval records", out, n_train, n_eval)
    return paths[0], paths[1]
