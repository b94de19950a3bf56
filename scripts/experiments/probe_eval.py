"""Approximate object-level scoring for sft_probe.py (not the product's parser or matcher).

Complete objects are pulled out of a (possibly truncated) answer by regex, then matched one-to-one to GT by
polygon IoU (shapely), greedily in order of decreasing IoU. The product uses the strict token-aligned parser
(spec/STAGE2.md §6) and Hungarian matching on maskIoU (§8); this is close enough to rank training recipes.
"""

from __future__ import annotations

import json
import re

from shapely.geometry import Polygon, box

COORD_RE = re.compile(r"^<\|coord_(\d{1,3})\|>$")
OBJ_RE = re.compile(r'\{"desc": "([^"]*)", "(bbox_2d|poly)": (\[[^{}]*?\])\}')


def parse_objects(text: str) -> list[tuple[str, list[int]]]:
    """Complete objects of a (possibly truncated) answer: ``(desc, flat coords)`` with valid geometry."""
    text = text.split("<|im_end|>")[0]
    out = []
    for m in OBJ_RE.finditer(text):
        try:
            geom = json.loads(m.group(3))
        except json.JSONDecodeError:
            continue
        flat = geom if m.group(2) == "bbox_2d" else [v for p in geom if isinstance(p, list) for v in p]
        if m.group(2) == "poly" and not all(isinstance(p, list) and len(p) == 2 for p in geom):
            continue
        bins = [COORD_RE.match(v) if isinstance(v, str) else None for v in flat]
        if not all(bins) or not m.group(1).strip():
            continue
        vals = [int(b.group(1)) for b in bins]
        if (m.group(2) == "bbox_2d" and len(vals) == 4) or (m.group(2) == "poly" and len(vals) >= 6):
            out.append((m.group(1), vals))
    return out


def shape_of(vals: list[int]):
    if len(vals) == 4:
        x1, y1, x2, y2 = vals
        return box(min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2))
    return Polygon(list(zip(vals[0::2], vals[1::2], strict=True))).buffer(0)


def iou(a, b) -> float:
    try:
        u = a.union(b).area
        return a.intersection(b).area / u if u > 0 else 0.0
    except Exception:  # noqa: BLE001 - invalid predicted polygons simply score 0 in this probe
        return 0.0


def match_counts(preds: list[list[int]], gts: list[list[int]], thr: float) -> int:
    ps, gs = [shape_of(p) for p in preds], [shape_of(g) for g in gts]
    pairs = sorted(((iou(p, g), i, j) for i, p in enumerate(ps) for j, g in enumerate(gs)), reverse=True)
    used_p, used_g, m = set(), set(), 0
    for v, i, j in pairs:
        if v < thr:
            break
        if i not in used_p and j not in used_g:
            used_p.add(i)
            used_g.add(j)
            m += 1
    return m


def gt_coords(record: dict) -> list[list[int]]:
    out = []
    for o in record["objects"]:
        flat = o.get("bbox_2d") or o["poly"]
        out.append([int(COORD_RE.match(v).group(1)) for v in flat])
    return out
