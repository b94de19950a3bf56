"""PNG report of a run's `metrics.jsonl`: loss, rollout F1, parse-valid rate, step-time split, packing fill,
learner throughput (tokens/s, MFU).

Usage: `python -m learner.report runs/demo/metrics.jsonl [-o runs/demo/report.png]`.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

__all__ = ["load_metrics", "reorder_moved_rate", "write_report"]

TIME_KEYS = (
    "time/rollout_wait_s",
    "time/weight_sync_s",
    "time/rollout_parse_match_s",
    "time/post_rollout_pack_s",
    "time/forward_s",
    "time/backward_s",
)


def load_metrics(path: str | Path) -> list[dict[str, Any]]:
    """Records of a metrics JSONL file, in order."""
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def reorder_moved_rate(metrics_path: str | Path) -> float | None:
    """Fraction of a run's rollout-matching samples that `unmatched_prefix: reorder` taught in another order
    than the listed annotations (`rollout/reorder_moved` over `rollout/samples`); None without such steps."""
    if not Path(metrics_path).exists():
        return None
    rows = [r for r in load_metrics(metrics_path) if r.get("rollout/reorder_moved") is not None]
    samples = sum(float(r.get("rollout/samples") or 0.0) for r in rows)
    return sum(float(r["rollout/reorder_moved"]) for r in rows) / samples if samples else None


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    xs, ys = [], []
    for r in records:
        if r.get(key) is not None:
            xs.append(r["step"])
            ys.append(float(r[key]))
    return xs, ys


def write_report(metrics_path: str | Path, out_path: str | Path | None = None) -> Path:
    """Draws the six panels into a PNG next to the metrics file (or at `out_path`); returns its path."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = load_metrics(metrics_path)
    out = Path(out_path) if out_path else Path(metrics_path).with_name("report.png")
    fig, axes = plt.subplots(1, 6, figsize=(26, 4))

    ax = axes[0]
    ax.plot(*_series(records, "loss"), label="loss/total")
    for key in ("loss/ce", "loss/coord"):
        ax.plot(*_series(records, key), label=key, alpha=0.7)
    ax.set_title("loss")
    ax.set_xlabel("optimizer step")
    ax.legend()

    ax = axes[1]
    xs, ys = _series(records, "eval_rollout_f1")
    ax.plot(xs, ys, "o-", label="held-out eval_rollout_f1")
    ax.plot(*_series(records, "rollout/f1"), alpha=0.6, label="train rollout/f1")
    if ys:
        ax.annotate(
            f"{ys[0]:.2f} → {ys[-1]:.2f}", (xs[-1], ys[-1]), textcoords="offset points", xytext=(-60, 8)
        )
    ax.set_ylim(0, 1)
    ax.set_title("rollout F1")
    ax.set_xlabel("optimizer step")
    ax.legend()

    ax = axes[2]
    ax.plot(*_series(records, "rollout/parse_obj_valid_frac"), label="train: valid objects / parsed")
    ax.plot(
        *_series(records, "eval_rollout_sample_valid_pred_rate"),
        "o-",
        label="eval: samples with a valid pred",
    )
    ax.set_ylim(0, 1.05)
    ax.set_title("parse-valid rate")
    ax.legend()

    _step_time_panel(axes[3], records)

    ax = axes[4]
    xs, ys = _series(records, "packing/post_rollout_fill")
    if xs:
        ax.plot(xs, ys)
        ax.set_ylim(0, 1.05)
    else:
        ax.text(0.5, 0.5, "packing disabled", ha="center", va="center", transform=ax.transAxes)
    ax.set_title("packing fill")

    _throughput_panel(axes[5], records)

    fig.tight_layout()
    fig.savefig(out, dpi=80)
    plt.close(fig)
    return out


def _step_time_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    """Stacked: what each step blocked on (rollout wait, sync, stage-2 host work, forward, backward).

    Lines: the rollout generation itself and the wall time per step. Synchronous runs wait for the whole
    generation; with `rollout.async` the generation runs during the previous step's training, so its line
    rises above the wait."""
    trained = [r for r in records if r.get("time/forward_s") is not None]
    steps = [r["step"] for r in trained]
    bottom = [0.0] * len(steps)
    for key in TIME_KEYS:
        # Metrics written before `time/rollout_wait_s` existed: the generation was the wait.
        fallback = "time/rollout_generate_s" if key == "time/rollout_wait_s" else key
        vals = [float(r.get(key, r.get(fallback)) or 0.0) for r in trained]
        ax.bar(steps, vals, bottom=bottom, label=key.removeprefix("time/"), width=1.0)
        bottom = [b + v for b, v in zip(bottom, vals, strict=True)]
    ax.plot(steps, [float(r.get("time/rollout_generate_s") or 0.0) for r in trained], "k.-", lw=1,
            label="rollout_generate_s")  # fmt: skip
    walls = [(r["step"], float(r["wall_s"])) for r in trained if r.get("wall_s") is not None]
    if len(walls) > 1:
        per_step = [b - a for (_, a), (_, b) in zip(walls[:-1], walls[1:], strict=True)]
        ax.plot([s for s, _ in walls[1:]], per_step, "r-", lw=1, label="wall per step")
    overlapped = any(float(r.get("rollout/prefetched") or 0.0) > 0 for r in trained)
    ax.set_title(
        "step-time split (s)" + (": rollouts overlap training (rollout.async)" if overlapped else "")
    )
    ax.legend(fontsize=7)


def _throughput_panel(ax: Any, records: list[dict[str, Any]]) -> None:
    """The learner's tokens/s (left) and MFU with and without attention FLOPs (right, % of the GPU's dense
    peak; `learner.flops`), per logged step, over its forward + backward."""
    xs, ys = _series(records, "perf/tokens_per_s")
    if not xs:
        ax.text(0.5, 0.5, "no perf/* metrics", ha="center", va="center", transform=ax.transAxes)
        ax.set_title("learner throughput")
        return
    ax.plot(xs, ys, "b-", label="tokens/s (all GPUs)")
    ax.set_ylabel("tokens/s")
    ax.set_xlabel("optimizer step")
    twin = ax.twinx()
    for key, style in (("perf/mfu", "g-"), ("perf/mfu_with_attn", "g:")):
        mx, my = _series(records, key)
        if mx:
            twin.plot(mx, [100 * v for v in my], style, label=key.removeprefix("perf/"))
    twin.set_ylabel("MFU (% of dense peak)")
    twin.set_ylim(bottom=0)
    last = _series(records, "perf/mfu")[1]
    ax.set_title("learner throughput" + (f": MFU {100 * last[-1]:.1f} %" if last else ""))
    lines = ax.get_legend_handles_labels()
    twin_lines = twin.get_legend_handles_labels()
    ax.legend(lines[0] + twin_lines[0], lines[1] + twin_lines[1], fontsize=7)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("metrics", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=None)
    args = parser.parse_args(argv)
    print(write_report(args.metrics, args.out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
