"""Pictures of what a detector predicts: a grid of evaluated images with ground truth and predictions drawn
over each (matplotlib, as `learner.report`).

Each picked sample is one row of two panels: **boxes** (every object as its axis-aligned box) and **polygons**
(every object as its own geometry, filled). Ground truth is green; a prediction matched at the gate is blue
and linked to its GT by a line labelled with the maskIoU; an unmatched prediction is red and crossed (orange
when it is a duplicate); a missed GT object is dashed magenta. Each row is titled with the sample, its gate F1
and why it was picked. Coordinates: norm1000 bins to pixels by `bin_to_pixel`, over the record's width and
height.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

from learner.predictions.records import SamplePrediction
from learner.stage2.coords import bin_to_pixel
from shared_schemas.images import load_image

__all__ = ["SELECTIONS", "pick_samples", "render_gallery", "write_gallery"]

Selection = Literal["spread", "worst", "best", "first", "random"]
SELECTIONS: tuple[str, ...] = ("spread", "worst", "best", "first", "random")
"""`spread`: a third worst, a third around the median, a third best F1 (the default); `worst` / `best`: the K
lowest / highest F1; `first`: the first K samples; `random`: K samples drawn with a fixed seed."""

GT_COLOR, MATCH_COLOR, FP_COLOR, DUP_COLOR, MISS_COLOR = "#1a9850", "#2166ac", "#d73027", "#f46d43", "#c51b7d"


def pick_samples(
    samples: Sequence[SamplePrediction], k: int, how: Selection = "spread", seed: int = 0
) -> list[tuple[str, SamplePrediction]]:
    """Up to `k` samples with images and why each was picked (`SELECTIONS`); F1 ties go to the lower index.

    Raises:
        ValueError: an unknown `how` (names the choices).
    """
    pool = [s for s in samples if s.image is not None]
    if k <= 0 or not pool:
        return []
    k = min(k, len(pool))
    ranked = sorted(pool, key=lambda s: (s.f1, s.index))
    if how == "worst":
        return [("worst", s) for s in ranked[:k]]
    if how == "best":
        return [("best", s) for s in reversed(ranked[-k:])]
    if how == "first":
        return [("first", s) for s in pool[:k]]
    if how == "random":
        import random

        return [("random", s) for s in sorted(random.Random(seed).sample(pool, k), key=lambda s: s.index)]
    if how != "spread":
        raise ValueError(f"gallery selection {how!r} is not one of {', '.join(SELECTIONS)}")
    n_worst, n_best = (k + 2) // 3, k // 3
    n_mid = k - n_worst - n_best
    mid_start = max(n_worst, min(len(ranked) - n_best - n_mid, (len(ranked) - n_mid) // 2))
    picked = [("worst", s) for s in ranked[:n_worst]]
    picked += [("median", s) for s in ranked[mid_start : mid_start + n_mid]]
    picked += [("best", s) for s in reversed(ranked[len(ranked) - n_best :])] if n_best else []
    return picked


def _points(geom_type: str, bins: Sequence[int], w: int, h: int) -> list[tuple[float, float]]:
    if geom_type == "bbox_2d":
        x1, y1, x2, y2 = bins
        bins = (x1, y1, x2, y1, x2, y2, x1, y2)
    return [
        (bin_to_pixel(int(bins[i]), w), bin_to_pixel(int(bins[i + 1]), h)) for i in range(0, len(bins) - 1, 2)
    ]


def _box(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    return [(min(xs), min(ys)), (max(xs), min(ys)), (max(xs), max(ys)), (min(xs), max(ys))]


def _center(points: list[tuple[float, float]]) -> tuple[float, float]:
    return sum(p[0] for p in points) / len(points), sum(p[1] for p in points) / len(points)


def _draw_panel(ax: Any, s: SamplePrediction, image: Any, style: str) -> None:
    from matplotlib.patches import Polygon

    w, h = s.width, s.height
    ax.imshow(image, extent=(0, w, h, 0))
    ax.set_xlim(0, w)
    ax.set_ylim(h, 0)
    ax.set_xticks([])
    ax.set_yticks([])

    def shape(points: list[tuple[float, float]]) -> list[tuple[float, float]]:
        return _box(points) if style == "boxes" else points

    fill = style == "polygons"
    gt_pts = [_points(g.geom_type, g.bins, w, h) for g in s.gts]
    for g, pts in zip(s.gts, gt_pts, strict=True):
        missed = g.pred is None
        color = MISS_COLOR if missed else GT_COLOR
        ax.add_patch(
            Polygon(
                shape(pts),
                closed=True,
                fill=fill,
                facecolor=(color if fill else "none"),
                alpha=0.35 if fill else 1.0,
                edgecolor=color,
                linewidth=2.0,
                linestyle="--" if missed else "-",
            )
        )
        if fill:  # the filled face hides the outline's alpha; redraw the outline opaque
            ax.add_patch(Polygon(shape(pts), closed=True, fill=False, edgecolor=color, linewidth=1.5))
    for p in s.preds:
        pts = _points(p.geom_type, p.bins, w, h)
        color = MATCH_COLOR if p.gt is not None else (DUP_COLOR if p.duplicate else FP_COLOR)
        ax.add_patch(
            Polygon(shape(pts), closed=True, fill=False, edgecolor=color, linewidth=1.6, linestyle=":")
        )
        cx, cy = _center(shape(pts))
        if p.gt is None:
            ax.plot([cx], [cy], marker="x", color=color, markersize=9, markeredgewidth=2.5)
        else:
            gx, gy = _center(shape(gt_pts[p.gt]))
            ax.plot([cx, gx], [cy, gy], color=MATCH_COLOR, linewidth=1.2)
            ax.plot([cx], [cy], marker="o", color=MATCH_COLOR, markersize=4)
            ax.text(
                cx,
                cy,
                f"{p.iou:.2f}",
                color="white",
                fontsize=7,
                ha="left",
                va="bottom",
                bbox={"facecolor": MATCH_COLOR, "pad": 1, "linewidth": 0},
            )


def render_gallery(picked: Sequence[tuple[str, SamplePrediction]], title: str = "") -> Any:
    """The gallery figure (matplotlib `Figure`, Agg) of the picked samples; caller saves or closes it."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    rows = max(len(picked), 1)
    fig, axes = plt.subplots(rows, 2, figsize=(7.2, 3.5 * rows + 0.9), squeeze=False)
    for row, (why, s) in enumerate(picked):
        image = load_image(s.image, s.index)
        for col, style in enumerate(("boxes", "polygons")):
            ax = axes[row][col]
            _draw_panel(ax, s, image, style)
            ax.set_title(
                f"{s.dataset}#{s.base_idx} · F1 {s.f1:.2f} ({why})" if col == 0 else style, fontsize=9
            )
            if col == 1:
                ax.set_xlabel(f"{len(s.preds)} pred / {len(s.gts)} GT", fontsize=8)
    if not picked:
        axes[0][0].axis("off")
        axes[0][1].axis("off")
        axes[0][0].text(0.5, 0.5, "no image samples", ha="center", va="center")
    legend = [
        Line2D([], [], color=GT_COLOR, linewidth=2, label="ground truth"),
        Line2D([], [], color=MISS_COLOR, linewidth=2, linestyle="--", label="missed GT"),
        Line2D(
            [], [], color=MATCH_COLOR, linewidth=1.5, linestyle=":", marker="o", label="matched pred (IoU)"
        ),
        Line2D([], [], color=FP_COLOR, linewidth=0, marker="x", markeredgewidth=2, label="unmatched pred"),
        Line2D([], [], color=DUP_COLOR, linewidth=0, marker="x", markeredgewidth=2, label="duplicate pred"),
    ]
    fig.legend(handles=legend, loc="lower center", ncol=3, fontsize=8, frameon=False)
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout(rect=(0, 0.9 / (3.5 * rows + 0.9), 1, 0.97 if title else 1))
    return fig


def write_gallery(
    picked: Sequence[tuple[str, SamplePrediction]], out_path: str | Path, title: str = ""
) -> Path:
    """Draws `render_gallery` into a PNG at `out_path` (parents created); returns the path."""
    import matplotlib.pyplot as plt

    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig = render_gallery(picked, title)
    try:
        fig.savefig(out, dpi=90)
    finally:
        plt.close(fig)
    return out
