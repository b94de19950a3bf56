"""Synthetic IMAGE detection set for the image demo: flat coloured shapes rendered with PIL.

Records follow docs/ALGORITHM.md#records §1.1 exactly: one image per record (a PNG path relative to the JSONL
file's directory, ``images/{split}_{i:05d}.png``), ``width`` / ``height`` in pixels, and objects whose
coordinates are norm1000 coord-token strings written by :func:`learner.demo_data.scenes.record_objects` (the
text demo's writer). Pixel geometry becomes bins with the §2.2 / §2.3 converter (``learner.stage2.coords``:
floor/ceil for boxes, half-to-even for polygon vertices), and polygon rings are made canonical in the bin
domain (§2.4) with :func:`learner.demo_data.scenes.canonical_ring`. Objects are listed in §1.4 ``sorted``
order (anchor ``(y, x)``).

Design choices that make the task learnable by the tiny ``tiny-qwen3-vl-demo`` model (a few M parameters,
192x192 images = 36 image tokens):

- Five categories, each one fixed colour AND one fixed shape (``CATEGORIES``), so the desc follows from any
  pixel of the object; the desc words are single tokens of the demo tokenizer (scripts/build_tiny_models.py
  ``DEMO_WORDS``) and match the text demo where the shape is the same (``tree`` triangle, ``rug`` quad).
- The geometry kind follows from the category: ``book`` (filled rectangle), ``cup`` (filled ellipse) and
  ``lamp`` (hollow frame) are ``bbox_2d`` — the box is the drawn shape's pixel extent; ``tree`` (triangle)
  and ``rug`` (convex quadrilateral) are ``poly`` with a fixed vertex count.
- Every vertex lies on a coarse pixel grid (default every 8 px: 24 positions per axis), so each coordinate
  token the model must emit is one of few values, each seen often.
- Objects are large (sides 48..88 px, 25–46 % of the side) and their bounding boxes never overlap (they may
  touch), so each object is fully visible, its shape is its GT, and a prediction that is one grid step off
  still passes the maskIoU gate (0.3) of matching.
- 1–4 objects per image on a light background with faint stripes (a random tint, stripe period and
  direction per image), so the background is never confused with an object but is not a constant either.

Everything is pure and seeded: the same ``(seed, split, n, config)`` always yields the same records and
pixels, and the train and eval splits come from independent RNG streams
(``"rollmatch-demo-vlm/{split}/{seed}"``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image, ImageDraw

from learner.demo_data.files import finished_set, write_if_changed, write_pngs_if_changed
from learner.demo_data.scenes import SceneObject, canonical_ring, record_objects
from learner.stage2.coords import bbox_to_bins, pixel_to_bin

__all__ = [
    "CATEGORIES",
    "CROWDED_CONFIG",
    "DEMO_SYSTEM_PROMPT",
    "DEMO_USER_PROMPT",
    "Category",
    "ImageDemoConfig",
    "PixelObject",
    "generate_images",
    "object_mask",
    "render_scene",
    "sample_occluded_scene",
    "sample_pixel_scene",
    "to_scene_objects",
    "visible_objects",
    "write_image_dataset",
]

logger = logging.getLogger(__name__)

# The image demo's prompts (`prompts.system` / `prompts.user` of configs/demo_vlm_cpu.yaml, and what
# scripts/vlm_pretrain.py trains the stage-1 asset on). Short on purpose: with the default prompts
# (learner.data.messages) the system text alone is 304 tokens of a 421-token prompt, which triples a CPU step
# of the 5M-parameter demo model; these give a 93-token prompt (36 of them image tokens).
DEMO_SYSTEM_PROMPT = "Detect objects: one JSON object, desc and bbox_2d or poly, <|coord_N|> coordinates."
DEMO_USER_PROMPT = "List every object."

Drawing = Literal["rectangle", "ellipse", "frame", "triangle", "quad"]


@dataclass(frozen=True)
class Category:
    """How one category is drawn: a shape and an RGB fill colour (0..255 per channel)."""

    drawing: Drawing
    rgb: tuple[int, int, int]

    @property
    def geom(self) -> Literal["bbox_2d", "poly"]:
        """The record geometry: ``poly`` for triangles and quads, ``bbox_2d`` for the rest."""
        return "poly" if self.drawing in ("triangle", "quad") else "bbox_2d"


# Desc words are single tokens of the demo tokenizer (scripts/build_tiny_models.py DEMO_WORDS).
CATEGORIES: dict[str, Category] = {
    "book": Category("rectangle", (214, 40, 40)),
    "cup": Category("ellipse", (40, 80, 214)),
    "lamp": Category("frame", (226, 186, 20)),
    "tree": Category("triangle", (30, 150, 50)),
    "rug": Category("quad", (140, 50, 170)),
}


@dataclass(frozen=True)
class ImageDemoConfig:
    """Knobs of the generator (sizes in pixels).

    Attributes:
        size: side of the square image.
        grid: every vertex coordinate is a multiple of ``grid`` (and at most ``size - 1``).
        min_objects: fewest objects per image (≥ 1).
        max_objects: most objects per image; a crowded image may keep fewer (never fewer than one).
        min_side: smallest side of an object's bounding box.
        max_side: largest side of an object's bounding box.
        categories: desc → drawing; order matters for sampling.
        min_visible: 1.0 (the demo): bounding boxes never overlap and every object is whole. Below 1:
            objects may overlap, and each keeps at least this fraction of its drawn pixels visible (an
            occluded scene, :func:`sample_occluded_scene`); the GT box of a box-kind object is then the
            extent of its VISIBLE pixels.
        same_category_p: with this probability an object takes the previous object's category and is
            placed touching or overlapping it (same-category neighbours); only used below ``min_visible``
            1.0.
    """

    size: int = 192
    grid: int = 8
    min_objects: int = 1
    max_objects: int = 4
    min_side: int = 48
    max_side: int = 88
    categories: dict[str, Category] = field(default_factory=lambda: dict(CATEGORIES))
    min_visible: float = 1.0
    same_category_p: float = 0.0

    def __post_init__(self) -> None:
        if not 32 <= self.size <= 1024:
            raise ValueError(f"ImageDemoConfig.size={self.size}: must be in 32..1024 pixels")
        if not 1 <= self.grid <= self.size // 8:
            raise ValueError(f"ImageDemoConfig.grid={self.grid}: must be in 1..size/8={self.size // 8}")
        if not 1 <= self.min_objects <= self.max_objects:
            raise ValueError(
                f"ImageDemoConfig: min_objects={self.min_objects}, max_objects={self.max_objects}; "
                "need 1 <= min_objects <= max_objects"
            )
        if not 4 * self.grid <= self.min_side <= self.max_side < self.size:
            raise ValueError(
                f"ImageDemoConfig: min_side={self.min_side}, max_side={self.max_side}, grid={self.grid}, "
                f"size={self.size}; need 4 * grid <= min_side <= max_side < size"
            )
        if not self.categories:
            raise ValueError("ImageDemoConfig.categories is empty")
        if not 0.1 <= self.min_visible <= 1.0:
            raise ValueError(f"ImageDemoConfig.min_visible={self.min_visible}: must be in 0.1..1.0")
        if not 0.0 <= self.same_category_p <= 1.0:
            raise ValueError(f"ImageDemoConfig.same_category_p={self.same_category_p}: must be in 0..1")

    @property
    def occluded(self) -> bool:
        """Whether objects may overlap (``min_visible < 1``)."""
        return self.min_visible < 1.0


CROWDED_CONFIG = ImageDemoConfig(
    size=384,
    grid=8,
    min_objects=8,
    max_objects=24,
    min_side=32,
    max_side=72,
    min_visible=0.5,
    same_category_p=0.5,
)
"""The crowded task (``bench/ab_learning.py --task crowded-random``): 8–24 objects on a 384 px canvas (144
image tokens at 32 px per merged token), sides of 32–72 px (8–19 % of the side), same-category neighbours
half the time, overlaps that leave each object at least half visible. Where on-policy training should pay:
many objects to order, duplicates to avoid, misses among neighbours."""


@dataclass(frozen=True)
class PixelObject:
    """One drawn object in pixel coordinates.

    Attributes:
        desc: category word (a key of the config's ``categories``).
        box: ``(x1, y1, x2, y2)`` pixel extent, both ends inclusive (x1 < x2, y1 < y2).
        ring: polygon vertices ``((x, y), ...)`` for triangles and quads; empty for box-like drawings.
    """

    desc: str
    box: tuple[int, int, int, int]
    ring: tuple[tuple[int, int], ...] = ()


def _grid_value(rng: random.Random, lo: int, hi: int, grid: int) -> int:
    """A uniform multiple of ``grid`` in ``[lo, hi]`` (both rounded inward to the grid)."""
    return rng.randint(-(-lo // grid), hi // grid) * grid


def _sample_object(
    rng: random.Random, desc: str, cfg: ImageDemoConfig, near: PixelObject | None = None
) -> PixelObject:
    """One object of category ``desc``; with ``near``, its box lies within two grid steps of ``near``'s."""
    g, last = cfg.grid, cfg.size - 1
    w = _grid_value(rng, cfg.min_side, cfg.max_side, g)
    h = _grid_value(rng, cfg.min_side, cfg.max_side, g)
    if near is None:
        x1 = _grid_value(rng, 0, last - w, g)
        y1 = _grid_value(rng, 0, last - h, g)
    else:
        nx1, ny1, nx2, ny2 = near.box
        x1 = _grid_value(rng, max(0, nx1 - w - 2 * g), min(last - w, nx2 + 2 * g), g)
        y1 = _grid_value(rng, max(0, ny1 - h - 2 * g), min(last - h, ny2 + 2 * g), g)
    x2, y2 = x1 + w, y1 + h
    drawing = cfg.categories[desc].drawing
    if drawing == "triangle":
        # Apex on the top edge, base corners on the bottom quarter: area >= w*h/4, never degenerate. The
        # left base corner ends the bottom edge at y2 so that the box extent is exactly (x1, y1, x2, y2).
        apex = _grid_value(rng, x1 + w // 4, x2 - w // 4, g)
        ring: tuple[tuple[int, int], ...] = (
            (apex, y1),
            (x2, y2 - _grid_value(rng, 0, h // 4, g)),
            (x1, y2),
        )
    elif drawing == "quad":
        # Each corner moves inward along one axis by at most a quarter side: convex, area >= w*h/2.
        dx, dy = (w // 4) // g * g, (h // 4) // g * g
        ring = (
            (x1 + _grid_value(rng, 0, dx, g), y1),
            (x2, y1 + _grid_value(rng, 0, dy, g)),
            (x2 - _grid_value(rng, 0, dx, g), y2),
            (x1, y2 - _grid_value(rng, 0, dy, g)),
        )
    else:
        ring = ()
    return PixelObject(desc, (x1, y1, x2, y2), ring)


def _overlap(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """Whether two inclusive pixel boxes share interior rows AND columns (touching edges do not count)."""
    return min(a[2], b[2]) > max(a[0], b[0]) and min(a[3], b[3]) > max(a[1], b[1])


def sample_pixel_scene(rng: random.Random, cfg: ImageDemoConfig) -> list[PixelObject]:
    """Draw ``min_objects..max_objects`` objects with pairwise non-overlapping boxes (in draw order).

    Rejection sampling, 50 tries per object; a scene too crowded for another object keeps fewer.
    """
    names = list(cfg.categories)
    target = rng.randint(cfg.min_objects, cfg.max_objects)
    objects: list[PixelObject] = []
    for _ in range(target):
        desc = rng.choice(names)
        for _ in range(50):
            obj = _sample_object(rng, desc, cfg)
            if not any(_overlap(obj.box, o.box) for o in objects):
                objects.append(obj)
                break
    return objects


def _share_pixels(a: tuple[int, int, int, int], b: tuple[int, int, int, int]) -> bool:
    """Whether two inclusive pixel boxes share any pixel (touching edges count)."""
    return min(a[2], b[2]) >= max(a[0], b[0]) and min(a[3], b[3]) >= max(a[1], b[1])


def _draw(draw: ImageDraw.ImageDraw, o: PixelObject, cat: Category, fill: Any, outline: Any = None) -> None:
    """Draw ``o`` as its category does (the one drawing rule for pixels and masks); ``outline``: a 2 px edge
    of that colour (crowded scenes: neighbours of one category stay apart), None for none (the demo)."""
    edge = {"outline": outline, "width": 2} if outline is not None else {}
    if o.ring:
        draw.polygon(list(o.ring), fill=fill, **edge)
    elif cat.drawing == "ellipse":
        draw.ellipse(o.box, fill=fill, **edge)
    elif cat.drawing == "frame":
        side = min(o.box[2] - o.box[0], o.box[3] - o.box[1])
        draw.rectangle(o.box, outline=fill, width=max(3, side // 6))
        if outline is not None:
            draw.rectangle(o.box, outline=outline, width=1)
    else:
        draw.rectangle(o.box, fill=fill, **edge)


def object_mask(o: PixelObject, cfg: ImageDemoConfig) -> np.ndarray:
    """The pixels ``o`` paints, as a bool array over its inclusive box (rows y1..y2, columns x1..x2)."""
    x1, y1, x2, y2 = o.box
    canvas = Image.new("1", (x2 - x1 + 1, y2 - y1 + 1), 0)
    shifted = PixelObject(o.desc, (0, 0, x2 - x1, y2 - y1), tuple((x - x1, y - y1) for x, y in o.ring))
    _draw(ImageDraw.Draw(canvas), shifted, cfg.categories[o.desc], 1, 1 if cfg.occluded else None)
    return np.asarray(canvas, dtype=bool)


def _visible_masks(scene: Sequence[PixelObject], masks: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Each object's visible pixels (over its own box) when ``scene`` is painted in list order."""
    out = []
    for i, (o, m) in enumerate(zip(scene, masks, strict=True)):
        vis = m.copy()
        for later, lm in zip(scene[i + 1 :], masks[i + 1 :], strict=True):
            if not _share_pixels(o.box, later.box):
                continue
            x1, y1 = max(o.box[0], later.box[0]), max(o.box[1], later.box[1])
            x2, y2 = min(o.box[2], later.box[2]), min(o.box[3], later.box[3])
            vis[y1 - o.box[1] : y2 - o.box[1] + 1, x1 - o.box[0] : x2 - o.box[0] + 1] &= ~lm[
                y1 - later.box[1] : y2 - later.box[1] + 1, x1 - later.box[0] : x2 - later.box[0] + 1
            ]
        out.append(vis)
    return out


def _draw_order(objects: Sequence[PixelObject]) -> list[int]:
    """Box-kind objects in sampling order, then polygons: polygons are never occluded, so their GT ring is
    exactly what is visible."""
    return [i for i, o in enumerate(objects) if not o.ring] + [i for i, o in enumerate(objects) if o.ring]


def _visible_enough(
    objects: Sequence[PixelObject], masks: Sequence[np.ndarray], cfg: ImageDemoConfig
) -> bool:
    """Every object keeps ``cfg.min_visible`` of its pixels and a visible extent of at least two grid steps
    per side; polygons never overlap each other."""
    polys = [o for o in objects if o.ring]
    if any(_share_pixels(a.box, b.box) for k, a in enumerate(polys) for b in polys[k + 1 :]):
        return False
    order = _draw_order(objects)
    visible = _visible_masks([objects[i] for i in order], [masks[i] for i in order])
    for i, vis in zip(order, visible, strict=True):
        if vis.sum() < cfg.min_visible * masks[i].sum():
            return False
        ys, xs = np.nonzero(vis)
        if xs.max() - xs.min() < 2 * cfg.grid or ys.max() - ys.min() < 2 * cfg.grid:
            return False
    return True


def sample_occluded_scene(rng: random.Random, cfg: ImageDemoConfig) -> list[PixelObject]:
    """A crowded scene (``cfg.min_visible < 1``): ``min_objects..max_objects`` objects that may overlap, in
    DRAW order (later ones paint over earlier ones).

    With probability ``cfg.same_category_p`` an object repeats the previous object's category next to it.
    A candidate is kept only if every object stays visible enough (:func:`_visible_enough`); 50 tries per
    object (the last 25 anywhere on the canvas), so a scene too crowded for another object keeps fewer.
    """
    names = list(cfg.categories)
    target = rng.randint(cfg.min_objects, cfg.max_objects)
    objects: list[PixelObject] = []
    masks: list[np.ndarray] = []
    for _ in range(target):
        near = objects[-1] if objects and rng.random() < cfg.same_category_p else None
        desc = near.desc if near is not None else rng.choice(names)
        for attempt in range(50):
            obj = _sample_object(rng, desc, cfg, near if attempt < 25 else None)
            mask = object_mask(obj, cfg)
            if _visible_enough([*objects, obj], [*masks, mask], cfg):
                objects.append(obj)
                masks.append(mask)
                break
    return [objects[i] for i in _draw_order(objects)]


def visible_objects(scene: Sequence[PixelObject], cfg: ImageDemoConfig) -> list[PixelObject]:
    """The GT of a scene in draw order: what is visible. A box-kind object's box becomes the inclusive extent
    of its visible pixels; polygons (never occluded) keep their ring and box."""
    visible = _visible_masks(scene, [object_mask(o, cfg) for o in scene])
    out = []
    for o, vis in zip(scene, visible, strict=True):
        if o.ring:
            out.append(o)
            continue
        ys, xs = np.nonzero(vis)
        box = (
            o.box[0] + int(xs.min()),
            o.box[1] + int(ys.min()),
            o.box[0] + int(xs.max()),
            o.box[1] + int(ys.max()),
        )
        out.append(PixelObject(o.desc, box))
    return out


def to_scene_objects(objects: Sequence[PixelObject], width: int, height: int) -> list[SceneObject]:
    """Pixel objects → norm1000 :class:`SceneObject` (§2.2–§2.4), sorted by the §1.4 anchor (stable).

    Boxes use the floor/ceil converter of §2.3 on the inclusive pixel extent; polygon vertices are rounded
    half-to-even (§2.2), then the ring is made canonical in the bin domain (§2.4).
    """
    out = []
    for o in objects:
        if o.ring:
            ring = canonical_ring([(pixel_to_bin(x, width), pixel_to_bin(y, height)) for x, y in o.ring])
            out.append(SceneObject(o.desc, "poly", tuple(v for p in ring for v in p)))
        else:
            out.append(SceneObject(o.desc, "bbox_2d", tuple(bbox_to_bins(o.box, width, height))))
    return sorted(out, key=lambda s: s.anchor)


def render_scene(objects: Sequence[PixelObject], rng: random.Random, cfg: ImageDemoConfig) -> Image.Image:
    """The RGB image of a scene: a light striped background, then every object filled in its colour.

    The background draws come from ``rng`` (a tint per image, a stripe period and direction), so the pixels
    are as deterministic as the objects.
    """
    base = tuple(rng.randint(205, 245) for _ in range(3))
    stripe = tuple(c - 10 for c in base)
    period = rng.randint(3, 8) * 2
    vertical = rng.random() < 0.5
    img = Image.new("RGB", (cfg.size, cfg.size), base)
    draw = ImageDraw.Draw(img)
    for start in range(0, cfg.size, period):
        end = start + period // 2 - 1
        rect = (start, 0, end, cfg.size - 1) if vertical else (0, start, cfg.size - 1, end)
        draw.rectangle(rect, fill=stripe)
    for o in objects:
        rgb = cfg.categories[o.desc].rgb
        _draw(draw, o, cfg.categories[o.desc], rgb, tuple(c // 3 for c in rgb) if cfg.occluded else None)
    return img


def generate_images(
    n: int, seed: int, split: str, cfg: ImageDemoConfig | None = None
) -> list[tuple[dict[str, Any], Image.Image]]:
    """``n`` ``(record, image)`` pairs of one split; identical for identical arguments.

    The RNG is seeded from ``"rollmatch-demo-vlm/{split}/{seed}"`` (Python's str seeding hashes the text with
    SHA-512, stable across runs and platforms), so splits never share a stream. Record ``i`` refers to its
    image as ``images/{split}_{i:05d}.png``.
    """
    if n < 0:
        raise ValueError(f"generate_images: n={n} must be >= 0")
    cfg = cfg or ImageDemoConfig()
    rng = random.Random(f"rollmatch-demo-vlm/{split}/{seed}")
    out = []
    for i in range(n):
        if cfg.occluded:
            pixel_objects = sample_occluded_scene(rng, cfg)
            gt_objects = visible_objects(pixel_objects, cfg)
        else:
            pixel_objects = gt_objects = sample_pixel_scene(rng, cfg)
        image = render_scene(pixel_objects, rng, cfg)
        record = {
            "images": [f"images/{split}_{i:05d}.png"],
            "width": cfg.size,
            "height": cfg.size,
            "objects": record_objects(to_scene_objects(gt_objects, cfg.size, cfg.size)),
            "metadata": {"id": f"demo-vlm-{split}-{seed}-{i:06d}", "grid_px": cfg.grid},
        }
        out.append((record, image))
    return out


GENERATOR_VERSION = 1
"""Written into ``manifest.json``; bump it whenever a change to this module changes the images or records a
seed and config draw, so that sets written before are drawn again instead of reused."""


def write_image_dataset(
    out_dir: Path | str, n_train: int, n_eval: int, seed: int, cfg: ImageDemoConfig | None = None
) -> tuple[Path, Path]:
    """Write ``train.jsonl``, ``eval.jsonl``, ``manifest.json`` and ``images/*.png`` into ``out_dir``.

    Idempotent: a folder that holds the same set already (its ``manifest.json`` equal, every image present)
    is returned as it is; otherwise files whose bytes would not change are left untouched (mtime kept).

    Args:
        out_dir: target directory, created if missing.
        n_train: number of training records.
        n_eval: number of held-out records (own RNG stream, split name ``eval``).
        seed: base seed.
        cfg: generator knobs (default :class:`ImageDemoConfig`).

    Returns:
        ``(train_path, eval_path)``.
    """
    cfg = cfg or ImageDemoConfig()
    out = Path(out_dir)
    manifest = {"seed": seed, "n_train": n_train, "n_eval": n_eval, "config": asdict(cfg)}
    manifest["generator_version"] = GENERATOR_VERSION
    manifest_bytes = (json.dumps(manifest, indent=1, sort_keys=True) + "\n").encode()
    written = [out / f"{split}.jsonl" for split in ("train", "eval")]
    if finished_set(out, manifest_bytes, written):  # a crowded set takes ~90 s to draw: reuse it
        return written[0], written[1]
    (out / "images").mkdir(parents=True, exist_ok=True)
    paths = []
    for split, n in (("train", n_train), ("eval", n_eval)):
        pairs = generate_images(n, seed, split, cfg)
        write_pngs_if_changed([(out / record["images"][0], image) for record, image in pairs])
        lines = [json.dumps(record, ensure_ascii=False) + "\n" for record, _ in pairs]
        path = out / f"{split}.jsonl"
        write_if_changed(path, "".join(lines).encode("utf-8"))
        paths.append(path)
    write_if_changed(out / "manifest.json", manifest_bytes)  # last: it marks the set complete
    logger.info("image demo dataset in %s: %d train, %d eval records", out, n_train, n_eval)
    return paths[0], paths[1]
