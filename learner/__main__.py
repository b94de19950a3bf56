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
import threading
from pathlib import Path

_COLLECTIVE_THREADS = ("pt_gloo", "gloo_", "pt_nccl")
REORDER_CHANGES_NOTHING = 0.01
"""Below this share of rollout-matching samples taught the model's own order, `reorder` trained plain SFT's
targets (the image demo: 1 sample in 480), and the run says so."""
"""Name prefixes of the native threads torch's process groups start (gloo workers and TCP loop, NCCL
watchdog/heartbeat)."""


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
    from learner.device_placement import pin_one_gpu_without_torchrun
    from learner.yaml_loader import load_yaml_with_extends

    try:
        pin_one_gpu_without_torchrun()  # before CUDA starts: never DataParallel (learner.device_placement)
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
            trainer.train(resume_from_checkpoint=cfg.training_view.resume_from_checkpoint)
            # HF evaluates a step-strategy run at its last step even off the eval period: look, don't recount
            evaluated_last = any(
                "eval_rollout_f1" in r and r.get("step") == trainer.state.global_step
                for r in trainer.state.log_history
            )
            last = (
                _last_eval(trainer)
                if evaluated_last
                else (trainer.evaluate() if trainer.eval_samples else {})
            )
        if cfg.save_final_model:  # every rank calls it: ZeRO-3 gathers the partitions for rank 0 to write
            trainer.save_model(str(parts.output_dir / "model"))
    finally:
        parts.source.close()
    if trainer.is_world_process_zero():
        from learner.report import reorder_moved_rate, write_report

        metrics_path = parts.output_dir / "metrics.jsonl"
        report = write_report(metrics_path) if metrics_path.exists() else None
        summary = {
            "eval_rollout_f1_start": first.get("eval_rollout_f1"),
            "eval_rollout_f1_end": last.get("eval_rollout_f1"),
            "steps": trainer.state.global_step,
            "metrics": str(metrics_path),
            "report": str(report) if report else None,
            "model": str(parts.output_dir / "model") if cfg.save_final_model else None,
        }
        moved = reorder_moved_rate(metrics_path) if cfg.stage2.targets.unmatched_prefix == "reorder" else None
        if moved is not None:
            summary["reorder_moved_rate"] = round(moved, 4)
            log.info(
                "reorder: %.1f %% of the rollout-matching samples were taught the model's own order%s",
                100 * moved,
                "; the rest the listed annotations, exactly as plain SFT — on these annotations"
                " rollout-matching costs the generation and changes (almost) nothing, so expect no gain over"
                " plain SFT from this run (README: when does training on its own rollouts pay?)"
                if moved < REORDER_CHANGES_NOTHING
                else ", the rest the listed annotations",
            )
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


def native_threads(prefixes: tuple[str, ...] = _COLLECTIVE_THREADS) -> dict[str, int]:
    """Live OS threads of this process whose name starts with one of `prefixes`, counted by name (Linux;
    empty elsewhere). gloo names its workers `pt_gloo_runloop` and its TCP event loop `gloo_tcp_loop`."""
    counts: dict[str, int] = {}
    try:
        tasks = os.listdir("/proc/self/task")
    except OSError:
        return counts
    for tid in tasks:
        try:
            with open(f"/proc/self/task/{tid}/comm") as fh:
                name = fh.read().strip()
        except OSError:
            continue
        if name.startswith(prefixes):
            counts[name] = counts.get(name, 0) + 1
    return counts


def shutdown(rc: int) -> int:
    """Ends the process's distributed and background work in a fixed order, while the interpreter is alive.

    1. `gc.collect()`: the trainer, its DDP/DeepSpeed wrapper and the accelerator sit in reference cycles;
       until they are collected the DDP reducer keeps the process group alive.
    2. Success only: every rank meets once more (`barrier`), so no rank tears down while another still runs
       its last collective (a failed rank must not be waited for).
    3. `destroy_process_group()` drops the registry's references; with the reducer gone that was the last
       one, so gloo's destructor joins its worker threads (`pt_gloo_runloop`) and TCP loop here, on the main
       thread.
    4. tqdm's monitor thread is stopped and joined.

    Why (issue 22): when the group outlived `main`, gloo's worker threads were still running when Python
    finalized; a worker that touched a Python object then (releasing a finished work's tensors) found the
    interpreter gone and CPython ended it with `pthread_exit`, whose forced unwind through a `noexcept` C++
    frame is `std::terminate` — `terminate called without an active exception`, SIGABRT, after the run had
    finished. A leftover collective thread is logged by name.
    """
    import gc

    import torch.distributed as dist

    gc.collect()
    if dist.is_available() and dist.is_initialized():
        if rc == 0:
            dist.barrier()
        dist.destroy_process_group()
    gc.collect()
    from tqdm._monitor import TMonitor

    for thread in threading.enumerate():
        if isinstance(thread, TMonitor):  # one per tqdm class that showed a bar (tqdm.auto, tqdm.std, ...)
            thread.exit()
            thread.join(timeout=5)
            thread.tqdm_cls.monitor = None
    left = native_threads()
    if left:
        logging.getLogger("learner").warning(
            "collective threads still alive at exit: %s (a process group is still referenced; the exit may"
            " abort)",
            left,
        )
    return rc


def run(argv: list[str] | None = None) -> int:
    """`main`, then `shutdown`, also when `main` raised: the traceback is printed and dropped first (it holds
    the trainer's frame, hence the process group), and the exit code is 1."""
    try:
        rc = main(argv)
    except SystemExit as exc:  # argparse
        rc = exc.code if isinstance(exc.code, int) else 2
    except BaseException:  # noqa: BLE001 — reported here, then the process group is torn down in order
        # Through sys.excepthook, as an uncaught exception would be: under torchrun, torch.distributed's hook
        # prefixes every traceback line with `[rankN]:`, which is how operators (and tests) tell ranks apart.
        sys.excepthook(*sys.exc_info())
        sys.stderr.flush()
        rc = 1
    return shutdown(rc)


if __name__ == "__main__":
    sys.exit(run())
