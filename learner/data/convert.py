"""Converts detection annotations in PIXELS into training records (docs/DATA.md), checked against the images.

The learner reads coordinates as norm1000 bins (0..999, `learner.stage2.coords`); annotation tools write
pixels. This converter does the one mapping (`bbox_to_bins`: floor/ceil with anti-collapse for boxes,
`pixel_to_bin` for polygon vertices) and checks each image as the model will see it: the file exists, decodes,
and its size after EXIF orientation (`shared_schemas.images.load_image`, the decoder learner and server share)
equals the annotation's width x height. A size mismatch is an error, not a guess: annotations drawn on the
unrotated pixels of an EXIF-rotated photo would be trained on the wrong places.

Inputs:

- ``coco``: a COCO ``instances_*.json`` (``images``, ``annotations``, ``categories``); the category name
  becomes ``desc``. ``--geometry bbox`` (default) writes ``bbox_2d`` from ``bbox = [x, y, w, h]``;
  ``--geometry poly`` writes the largest polygon part of ``segmentation`` (an RLE/crowd mask or a part with
  fewer than 3 distinct vertices after binning falls back to the box). Boxes with ``w <= 0`` or ``h <= 0`` are
  dropped and counted.
- ``pixels``: JSONL in the record format, but ``bbox_2d`` / ``poly`` in pixels; ``width`` / ``height`` may be
  left out (then read from the image).

Images with no annotation are written with ``objects: []`` (they teach the model to answer nothing). Image
paths are written relative to the output file's folder, so the data set can move as one folder.

    python -m learner.data.convert coco --annotations instances_train.json --images images/ --out train.jsonl
    python -m learner.data.convert pixels --input labels_px.jsonl --out train.jsonl [--images DIR]

Exit codes: 0 written (a summary line on stderr), 2 bad input (the first few problems, with the fix).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections import Counter
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from learner.stage2.coords import CoordValueError, bbox_to_bins, pixel_to_bin
from shared_schemas.images import ImageRefError, load_image

__all__ = ["ConvertError", "convert_coco", "convert_pixels", "main"]


class ConvertError(ValueError):
    """Input the converter cannot turn into records (`problems`: one line each, the first few shown)."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        shown = "\n  ".join(problems[:10])
        more = f"\n  ... and {len(problems) - 10} more" if len(problems) > 10 else ""
        super().__init__(f"{len(problems)} problem(s):\n  {shown}{more}")


def _image_size(path: Path) -> tuple[int, int]:
    """(width, height) of the image as the model sees it (EXIF orientation applied)."""
    image = load_image(str(path))
    return image.width, image.height


def _poly_area(flat: list[float]) -> float:
    xs, ys = flat[0::2], flat[1::2]
    return abs(sum(xs[i] * ys[i - 1] - xs[i - 1] * ys[i] for i in range(len(xs)))) / 2


def _poly_bins(flat: list[float], width: int, height: int) -> list[int] | None:
    """Vertices as bins with consecutive duplicates dropped; None when fewer than 3 distinct remain."""
    points: list[tuple[int, int]] = []
    for x, y in zip(flat[0::2], flat[1::2], strict=True):
        point = (pixel_to_bin(x, width), pixel_to_bin(y, height))
        if not points or points[-1] != point:
            points.append(point)
    if len(points) > 1 and points[0] == points[-1]:
        points.pop()
    if len(set(points)) < 3:
        return None
    return [v for point in points for v in point]


def _record(image: Path, out_dir: Path, width: int, height: int, objects: list[dict], extra: dict) -> dict:
    return {
        "images": [os.path.relpath(image.resolve(), out_dir.resolve())],
        "width": width,
        "height": height,
        "objects": objects,
        **extra,
    }


def convert_coco(
    annotations: Path, images: Path, out: Path, *, geometry: str = "bbox"
) -> tuple[list[dict[str, Any]], Counter]:
    """Records of a COCO instances file whose `file_name`s are under `images` (see the module docstring).

    Returns:
        `(records, counts)`; counts has `images`, `objects`, `empty_images`, `dropped_degenerate`,
        `poly_fallback_to_bbox`.

    Raises:
        ConvertError: unreadable or missing images, sizes that differ from the annotation, unknown categories.
    """
    coco = json.loads(annotations.read_text())
    names = {c["id"]: c["name"] for c in coco.get("categories", [])}
    by_image: dict[Any, list[dict]] = {}
    for ann in coco.get("annotations", []):
        by_image.setdefault(ann["image_id"], []).append(ann)
    problems: list[str] = []
    counts: Counter = Counter()
    records = []
    for entry in coco.get("images", []):
        path = images / entry["file_name"]
        width, height = int(entry["width"]), int(entry["height"])
        try:
            seen = _image_size(path)
        except ImageRefError as exc:
            problems.append(f"image id {entry['id']} ({path}): {exc}")
            continue
        if seen != (width, height):
            problems.append(_size_problem(f"image id {entry['id']} ({path})", (width, height), seen))
            continue
        objects = []
        for ann in by_image.get(entry["id"], []):
            if ann["category_id"] not in names:
                problems.append(
                    f"annotation id {ann.get('id')}: category_id {ann['category_id']} not in categories"
                )
                continue
            x, y, w, h = (float(v) for v in ann["bbox"])
            if w <= 0 or h <= 0:
                counts["dropped_degenerate"] += 1
                continue
            obj: dict[str, Any] = {"desc": names[ann["category_id"]]}
            parts = ann.get("segmentation")
            poly = None
            if geometry == "poly" and isinstance(parts, list) and parts:
                largest = max((p for p in parts if len(p) >= 6), key=_poly_area, default=None)
                poly = _poly_bins(largest, width, height) if largest is not None else None
                if poly is None:
                    counts["poly_fallback_to_bbox"] += 1
            elif geometry == "poly":
                counts["poly_fallback_to_bbox"] += 1
            if poly is not None:
                obj["poly"] = poly
            else:
                obj["bbox_2d"] = bbox_to_bins([x, y, x + w, y + h], width, height)
            objects.append(obj)
        counts["images"] += 1
        counts["objects"] += len(objects)
        counts["empty_images"] += not objects
        records.append(
            _record(path, out.parent, width, height, objects, {"metadata": {"coco_id": entry["id"]}})
        )
    if problems:
        raise ConvertError(problems)
    return records, counts


def convert_pixels(
    source: Path, out: Path, *, images: Path | None = None
) -> tuple[list[dict[str, Any]], Counter]:
    """Records of a pixel-coordinate JSONL (relative image paths against `images`, else the file's folder).

    Raises:
        ConvertError: bad lines, missing/unreadable images, sizes that differ, bad coordinates.
    """
    problems: list[str] = []
    counts: Counter = Counter()
    records = []
    base = images if images is not None else source.parent
    for line_no, raw in _lines(source):
        where = f"{source}:{line_no}"
        try:
            record = json.loads(raw)
            (ref,) = record["images"]
            objects_in = record["objects"]
        except (ValueError, KeyError, TypeError) as exc:
            problems.append(
                f"{where}: needs JSON with 'images' (one path) and 'objects' ({type(exc).__name__}: {exc})"
            )
            continue
        path = Path(ref) if os.path.isabs(ref) else base / ref
        try:
            seen = _image_size(path)
        except ImageRefError as exc:
            problems.append(f"{where} ({path}): {exc}")
            continue
        width, height = record.get("width", seen[0]), record.get("height", seen[1])
        if (width, height) != seen:
            problems.append(_size_problem(f"{where} ({path})", (width, height), seen))
            continue
        objects = []
        for k, obj in enumerate(objects_in):
            try:
                objects.append(_pixel_object(obj, width, height))
            except (CoordValueError, KeyError, TypeError, ValueError) as exc:
                problems.append(f"{where} object {k}: {exc}")
        extra = {key: record[key] for key in ("summary", "metadata") if key in record}
        counts["images"] += 1
        counts["objects"] += len(objects)
        counts["empty_images"] += not objects
        records.append(_record(path, out.parent, width, height, objects, extra))
    if problems:
        raise ConvertError(problems)
    return records, counts


def _pixel_object(obj: dict[str, Any], width: int, height: int) -> dict[str, Any]:
    desc = obj["desc"]
    if not isinstance(desc, str) or not desc.strip():
        raise ValueError(f"desc {desc!r} must be a non-empty string")
    if obj.get("bbox_2d") is not None:
        return {"desc": desc, "bbox_2d": bbox_to_bins([float(v) for v in obj["bbox_2d"]], width, height)}
    flat = [float(v) for point in obj["poly"] for v in (point if isinstance(point, list) else [point])]
    if len(flat) % 2 or len(flat) < 6:
        raise ValueError(f"poly has {len(flat)} values; needs x, y pairs, at least 3 points")
    bins = _poly_bins(flat, width, height)
    if bins is None:
        raise ValueError("poly has fewer than 3 distinct vertices at norm1000 resolution")
    return {"desc": desc, "poly": bins}


def _lines(path: Path) -> Iterator[tuple[int, str]]:
    with path.open(encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if line.strip():
                yield line_no, line


def _size_problem(where: str, annotated: tuple[int, int], seen: tuple[int, int]) -> str:
    hint = (
        "the file carries an EXIF rotation and the annotation was made on the unrotated pixels: strip the"
        " orientation tag (or re-save the image rotated) so annotation and pixels agree"
        if seen == annotated[::-1]
        else "fix the annotation's width/height, or the image file"
    )
    return (
        f"{where}: annotated {annotated[0]}x{annotated[1]} but the image decodes to {seen[0]}x{seen[1]};"
        f" {hint}"
    )


def write_jsonl(records: Iterable[dict[str, Any]], out: Path) -> None:
    """Writes one record per line (atomic: a temp file renamed over `out`)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(out.suffix + ".tmp")
    with tmp.open("w", encoding="utf-8") as fh:
        for record in records:
            fh.write(json.dumps(record, ensure_ascii=False) + "\n")
    os.replace(tmp, out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m learner.data.convert", description=__doc__.splitlines()[0]
    )
    sub = parser.add_subparsers(dest="source", required=True)
    coco = sub.add_parser("coco", help="a COCO instances JSON")
    coco.add_argument("--annotations", type=Path, required=True)
    coco.add_argument("--images", type=Path, required=True, help="folder the file_names are relative to")
    coco.add_argument("--geometry", choices=("bbox", "poly"), default="bbox")
    coco.add_argument("--out", type=Path, required=True)
    pixels = sub.add_parser("pixels", help="record-format JSONL with pixel coordinates")
    pixels.add_argument("--input", type=Path, required=True)
    pixels.add_argument(
        "--images", type=Path, default=None, help="base of relative paths (default: input's folder)"
    )
    pixels.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    try:
        if args.source == "coco":
            records, counts = convert_coco(args.annotations, args.images, args.out, geometry=args.geometry)
        else:
            records, counts = convert_pixels(args.input, args.out, images=args.images)
    except ConvertError as exc:
        print(f"convert: nothing written to {args.out}: {exc}", file=sys.stderr)
        return 2
    except (OSError, ValueError, KeyError) as exc:
        print(f"convert: cannot read the input ({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    write_jsonl(records, args.out)
    summary = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    print(f"convert: wrote {args.out} ({summary})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
