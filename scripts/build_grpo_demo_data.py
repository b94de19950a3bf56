"""Build the tiny CPU GRPO demo inputs: the synthetic summary set and the warm-started tiny LM.

Writes (idempotent, deterministic; nothing is downloaded):

- ``<data>/train.jsonl``, ``<data>/eval.jsonl``: synthetic "summary" rows (``learner/demo_data/summary.py``);
- ``<models>/tiny-qwen2``: the tiny Qwen2 LM (``scripts/build_tiny_models.py``; the server loads it);
- ``<models>/tiny-qwen2-grpo-warm``: ``tiny-qwen2`` after a short SFT warm start on the train answers, half of
  them with the wrong task tag (``learner/grpo/warm_start.py``, ``with_task_noise``; the learner starts from
  it and its step-0 sync puts it on the server).

With ``--vlm`` it builds the image edition instead (the Qwen-VL GRPO demo):

- ``<data>/train.jsonl``, ``<data>/eval.jsonl`` + ``<data>/images/*.png``: synthetic image summary rows
  (``learner.demo_data.summary.generate_image_rows``; default ``<data>`` = ``.cache/data/grpo_vlm_demo``);
- ``<models>/tiny-qwen3-vl``: the tiny Qwen3-VL (``scripts/build_tiny_vlm.py``; the server loads it);
- ``<models>/tiny-qwen3-vl-grpo-warm``: ``tiny-qwen3-vl`` after a short SFT warm start on the image rows'
  answers (half with the wrong task tag, as for text), vision tower and aligner trained too.

CLI: ``python scripts/build_grpo_demo_data.py [--vlm] [--data DIR] [--models .cache/models]``
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
from build_tiny_vlm import MODEL_NAME as VLM_NAME  # noqa: E402
from build_tiny_vlm import build_tiny_vlm  # noqa: E402

from learner.demo_data.summary import generate_image_rows, generate_rows, with_task_noise, write_rows  # noqa: E402
from learner.grpo.warm_start import warm_start  # noqa: E402

DEFAULT_WARM_STEPS = 100
"""Enough for the answer skeleton (format reward ≈ 0.9 at temperature 1)."""
TASK_NOISE = 0.5
"""Fraction of warm-start answers with the wrong task tag (see ``learner/demo_data/summary.py``)."""


VLM_WARM_STEPS = 120
"""Steps of the image warm start (batch 16, lr 2e-3): the answer skeleton, the header mode left open."""


def build(
    data_dir: Path,
    models_dir: Path,
    *,
    n_train: int = 512,
    n_eval: int = 64,
    seed: int = 0,
    warm_steps: int = DEFAULT_WARM_STEPS,
    vlm: bool = False,
) -> dict[str, Path]:
    """Builds everything (the image edition with ``vlm``, see the module docstring); returns name → path."""
    if vlm:
        train = generate_image_rows(n_train, data_dir, seed=seed, split="train")
        held_out = generate_image_rows(n_eval, data_dir, seed=seed, split="eval")
        base = build_tiny_vlm(models_dir / VLM_NAME, seed=0)
    else:
        train = generate_rows(n_train, seed=seed, split="train")
        held_out = generate_rows(n_eval, seed=seed, split="eval")
        base = build_tiny_lm(models_dir / "tiny-qwen2", seed=0)
    write_rows(data_dir / "train.jsonl", train)
    write_rows(data_dir / "eval.jsonl", held_out)
    noisy = with_task_noise(train, TASK_NOISE, seed=seed)
    warm_dir = models_dir / f"{base.name}-grpo-warm"
    warm = warm_start(
        base, warm_dir, noisy, steps=warm_steps, seed=seed, image_root=data_dir if vlm else None
    )
    return {
        "train": data_dir / "train.jsonl",
        "eval": data_dir / "eval.jsonl",
        "model": base,
        "warm_model": warm,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vlm", action="store_true", help="the image edition (tiny Qwen3-VL)")
    parser.add_argument(
        "--data", type=Path, default=None, help="default .cache/data/grpo_demo (grpo_vlm_demo)"
    )
    parser.add_argument("--models", type=Path, default=REPO / ".cache/models")
    parser.add_argument("--n-train", type=int, default=None, help="default 512 (256 with --vlm)")
    parser.add_argument("--n-eval", type=int, default=None, help="default 64 (32 with --vlm)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--warm-steps", type=int, default=None)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    default_data = ".cache/data/grpo_vlm_demo" if args.vlm else ".cache/data/grpo_demo"
    built = build(
        args.data or REPO / default_data,
        args.models,
        n_train=args.n_train or (256 if args.vlm else 512),
        n_eval=args.n_eval or (32 if args.vlm else 64),
        seed=args.seed,
        warm_steps=args.warm_steps or (VLM_WARM_STEPS if args.vlm else DEFAULT_WARM_STEPS),
        vlm=args.vlm,
    )
    for name, path in built.items():
        sys.stdout.write(f"{name}: {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
