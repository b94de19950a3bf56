"""`python -m learner.evaluate --config X.yaml [--model DIR | --server URL] [--data FILE.jsonl] --out DIR`:
evaluate a checkpoint or a running rollout server on held-out records (docs/RUNBOOK.md#evaluating-a-detector).

Prints a progress bar, then the summary table; writes `DIR/metrics.json`, `DIR/predictions.jsonl` and
`DIR/gallery.png` (see `learner.evaluate.runner`). Exit codes: 0 success; 2 bad input (config, checkpoint,
server, data record or image, `--out`), one line naming the thing and the fix, nothing written to DIR;
1 anything else.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

from learner.predictions.gallery import SELECTIONS


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m learner.evaluate", description=__doc__.splitlines()[1])
    parser.add_argument("--config", required=True, type=Path, help="the run's YAML (model, data, decoding)")
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--model", help="checkpoint directory (default: the config's model.path)")
    source.add_argument("--server", help="base URL of a running rollout server (its current weights)")
    parser.add_argument("--data", action="append", help="held-out JSONL (repeatable; default: data.eval)")
    parser.add_argument("--limit", type=int, help="evaluate the first N samples only")
    parser.add_argument("--out", type=Path, required=True, help="output directory (replaced atomically)")
    parser.add_argument("--batch-size", type=int, default=16, help="requests per rollout call (default 16)")
    parser.add_argument("--gallery", type=int, default=6, help="images in gallery.png (0: none; default 6)")
    parser.add_argument(
        "--gallery-select",
        choices=SELECTIONS,
        default="spread",
        help="which images: spread (worst, median, best F1; default), worst, best, first, random",
    )
    parser.add_argument("--no-coco", action="store_true", help="skip COCO AP (no pycocotools needed)")
    parser.add_argument(
        "--server-wait-s", type=float, default=10.0, help="how long --server may take to answer /health"
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.limit is not None and args.limit < 1:
        print(f"bad input: --limit {args.limit} must be >= 1", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from tqdm.auto import tqdm

    from learner.config import ConfigError
    from learner.data.errors import DataRecordError
    from learner.evaluate.metrics import summary_table
    from learner.evaluate.runner import EvalInputError, EvalOptions, run_evaluation
    from learner.rollout.colocate.backend import EngineStartError
    from learner.rollout.errors import RolloutClientError

    options = EvalOptions(
        config=args.config,
        out=args.out,
        model=args.model,
        server=args.server,
        data=args.data,
        limit=args.limit,
        batch_size=args.batch_size,
        gallery=args.gallery,
        gallery_select=args.gallery_select,
        coco=not args.no_coco,
        server_wait_s=args.server_wait_s,
    )
    try:
        result = run_evaluation(
            options, progress_factory=lambda total: tqdm(total=total, desc="evaluate", unit="sample")
        )
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DataRecordError as exc:
        print(f"data error: {exc}", file=sys.stderr)
        return 2
    except (EvalInputError, RolloutClientError, EngineStartError, ImportError) as exc:
        print(f"bad input: {exc}", file=sys.stderr)
        return 2
    print(summary_table(result.metrics, gate=float(result.metrics["matching_gate"])))
    print(
        f"wrote {result.out}/metrics.json, predictions.jsonl"
        + (", gallery.png" if (result.out / "gallery.png").exists() else "")
    )
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is written and the engine is closed; skip the interpreter's teardown, where vLLM's AsyncLLM
    # destructor and triton's bindings print tracebacks and "leaked" lists that are not errors of this run.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
