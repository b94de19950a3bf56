"""Write the synthetic demo detection set (learner/demo_data/scenes.py): ``train.jsonl`` and ``eval.jsonl``.

CLI: ``python scripts/build_demo_data.py --out .cache/data/demo`` (idempotent; unchanged files are kept).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from learner.demo_data.scenes import DemoDataConfig, write_demo_dataset  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path(".cache/data/demo"))
    parser.add_argument("--n-train", type=int, default=4000)
    parser.add_argument("--n-eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--grid", type=int, default=DemoDataConfig.grid)
    parser.add_argument(
        "--scene-style", choices=["tight", "compact", "verbose"], default=DemoDataConfig.scene_style
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = DemoDataConfig(grid=args.grid, scene_style=args.scene_style)
    train, held_out = write_demo_dataset(args.out, args.n_train, args.n_eval, args.seed, cfg)
    print(f"train: {train}\neval: {held_out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
