"""Write the synthetic image demo set (learner/demo_data/images.py): JSONL splits and their PNGs.

CLI: ``python scripts/build_vlm_demo_data.py --out .cache/data/demo_vlm`` writes ``train.jsonl``,
``eval.jsonl``, ``manifest.json`` and ``images/{train,eval}_NNNNN.png`` (paths in the records are relative to
``--out``). ``--crowded`` writes the crowded task instead (``CROWDED_CONFIG``: 384 px, 8–24 overlapping
objects). Idempotent: unchanged files are kept.
"""

from __future__ import annotations

import argparse
import logging
import sys
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.demo_data.images import CROWDED_CONFIG, ImageDemoConfig, write_image_dataset  # noqa: E402

DEFAULT_N_TRAIN = 6000
DEFAULT_N_EVAL = 64


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/demo_vlm"))
    parser.add_argument("--n-train", type=int, default=DEFAULT_N_TRAIN)
    parser.add_argument("--n-eval", type=int, default=DEFAULT_N_EVAL)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=None, help="image side in pixels (default: the task's)")
    parser.add_argument("--crowded", action="store_true", help="the crowded task (CROWDED_CONFIG)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = CROWDED_CONFIG if args.crowded else ImageDemoConfig()
    if args.size is not None:
        cfg = replace(cfg, size=args.size)
    train, held_out = write_image_dataset(args.out, args.n_train, args.n_eval, args.seed, cfg)
    print(f"train: {train}\neval: {held_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
