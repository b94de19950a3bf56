"""Build the tiny CPU GRPO demo inputs: the synthetic summary set and the warm-started tiny LM.

Writes (idempotent, deterministic; nothing is downloaded):

- ``<data>/train.jsonl``, ``<data>/eval.jsonl``: synthetic "summary" rows (``learner/grpo/synthetic.py``);
- ``<models>/tiny-qwen2``: the tiny Qwen2 LM (``scripts/build_tiny_models.py``; the server loads it);
- ``<models>/tiny-qwen2-grpo-warm``: ``tiny-qwen2`` after a short SFT warm start on the train answers, half of
  them with the wrong task tag (``learner/grpo/warm_start.py``, ``with_task_noise``; the learner starts from it
  and its step-0 sync puts it on the server).

CLI: ``python scripts/build_grpo_demo_data.py [--data .cache/data/grpo_demo] [--models .cache/models]``
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from build_tiny_models import build_tiny_lm  # noqa: E402

from learner.grpo.synthetic import generate_rows, with_task_noise, write_rows  # noqa: E402
from learner.grpo.warm_start import warm_start  # noqa: E402

DEFAULT_WARM_STEPS = 100
"""Enough for the answer skeleton (format reward ≈ 0.9 at temperature 1)."""
TASK_NOISE = 0.5
"""Fraction of warm-start answers with the wrong task tag (see ``learner/grpo/synthetic.py``)."""


def build(
    data_dir: Path,
    models_dir: Path,
    *,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    warm_steps: int = DEFAULT_WARM_STEPS,
) -> dict[str, Path]:
    """Builds everything; returns name → path."""
    train = generate_rows(n_train, seed=seed, split="train")
    write_rows(data_dir / "train.jsonl", train)
    write_rows(data_dir / "eval.jsonl", generate_rows(n_eval, seed=seed, split="eval"))
    base = build_tiny_lm(models_dir / "tiny-qwen2", seed=0)
    noisy = with_task_noise(train, TASK_NOISE, seed=seed)
    warm = warm_start(base, models_dir / "tiny-qwen2-grpo-warm", noisy, steps=warm_steps, seed=seed)
    return {
        "train": data_dir / "train.jsonl",
        "eval": data_dir / "eval.jsonl",
        "model": base,
        "warm_model": warm,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", type=Path, default=REPO / ".cache/data/grpo_demo")
    parser.add_argument("--models", type=Path, default=REPO / ".cache/models")
    parser.add_argument("--n-train", type=int, default=512)
    parser.add_argument("--n-eval", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=DEFAULT_WARM_STEPS)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    built = build(
        args.data,
        args.models,
        n_train=args.n_train,
        n_eval=args.n_eval,
        seed=args.seed,
        warm_steps=args.warm_steps,
    )
    for name, path in built.items():
        sys.stdout.write(f"{name}: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
