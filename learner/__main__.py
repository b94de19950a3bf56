"""`python -m learner --config <yaml>`: run rollout-matching SFT (or GRPO when the config has `grpo:`).

Evaluates on the held-out split before the first step (when `stage2.eval.at_start`) and after the last,
writes `metrics.jsonl`, TensorBoard events and `report.png` under `output_dir`, and prints the F1 change.
Exit codes: 0 success, 2 configuration error (one line naming file and key), 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from pathlib import Path


def _configure_logging() -> None:
    rank = int(os.environ.get("RANK", "0"))
    level = logging.INFO if rank == 0 else logging.WARNING
    logging.basicConfig(
        level=level,
        format=f"%(asctime)s [rank{rank}] %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    for noisy in ("httpx", "httpcore", "urllib3"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def _last_eval(trainer) -> dict:
    """The eval record HF already logged at the final step (no second evaluation of the same weights)."""
    for record in reversed(trainer.state.log_history):
        if "eval_rollout_f1" in record:
            return record
    return trainer.evaluate()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m learner", description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, type=Path, help="run YAML (hyperparameters live there)")
    args = parser.parse_args(argv)
    _configure_logging()
    log = logging.getLogger("learner")

    from learner.config import ConfigError, load_run_config
    from learner.data.errors import DataRecordError
    from learner.yaml_loader import load_yaml_with_extends

    try:
        if "grpo" in load_yaml_with_extends(args.config):
            from learner.grpo.main import run_grpo

            return run_grpo(args.config)
        cfg = load_run_config(args.config)
        from learner.trainers.build import build_run

        parts = build_run(cfg)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except DataRecordError as exc:  # a record or image file of data.train / data.eval (docs/DATA.md)
        print(f"data error: {exc}", file=sys.stderr)
        return 2

    from tqdm.contrib.logging import logging_redirect_tqdm

    trainer = parts.trainer
    try:
        # Log lines go through tqdm.write so they never break the live progress bar.
        with logging_redirect_tqdm():
            first = trainer.evaluate() if cfg.stage2.eval.at_start and trainer.eval_samples else {}
            trainer.train(resume_from_checkpoint=cfg.training.get("resume_from_checkpoint"))
            evaluated_last = (
                trainer.args.eval_strategy == "steps"
                and trainer.state.global_step % max(int(trainer.args.eval_steps or 1), 1) == 0
            )
            last = (
                _last_eval(trainer)
                if evaluated_last
                else (trainer.evaluate() if trainer.eval_samples else {})
            )
    finally:
        parts.source.close()
    if trainer.is_world_process_zero():
        from learner.report import write_report

        metrics_path = parts.output_dir / "metrics.jsonl"
        report = write_report(metrics_path) if metrics_path.exists() else None
        summary = {
            "eval_rollout_f1_start": first.get("eval_rollout_f1"),
            "eval_rollout_f1_end": last.get("eval_rollout_f1"),
            "steps": trainer.state.global_step,
            "metrics": str(metrics_path),
            "report": str(report) if report else None,
        }
        (parts.output_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if first and last:
            log.info(
                "held-out eval_rollout_f1: %.3f at step 0 → %.3f at step %d",
                first["eval_rollout_f1"],
                last["eval_rollout_f1"],
                trainer.state.global_step,
            )
        print(json.dumps(summary))
    return 0


def leave_process_group(rc: int) -> int:
    """Ends a torchrun run in order: every rank meets once more, then its process group is destroyed.

    Without it each rank tears its gloo/NCCL group down while exiting, possibly while another rank still
    finishes its last collective; measured under CI load, a GRPO run with 2 ranks then ended in
    `terminate called without an active exception` (SIGABRT) after "GRPO done". Only after success: a failed
    rank raises instead of returning, and the others must not wait for it here.
    """
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if rc == 0:
            dist.barrier()
        dist.destroy_process_group()
    return rc


if __name__ == "__main__":
    sys.exit(leave_process_group(main()))
