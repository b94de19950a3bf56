"""`python -m learner.evaluate`: bad input exits 2 with a message naming the thing and writes nothing; a
text-only run (colocated HF engine on the tiny LM) prints the table and writes no gallery."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from learner.evaluate.__main__ import main


@pytest.fixture()
def config(tmp_path, tiny_model_dir) -> Path:
    from learner.demo_data.scenes import DemoDataConfig, write_demo_dataset

    train, held_out = write_demo_dataset(tmp_path / "data", 4, 3, 0, DemoDataConfig())
    path = tmp_path / "run.yaml"
    path.write_text(
        yaml.safe_dump(
            {
                "model": {"path": str(tiny_model_dir)},
                "data": {"train": [str(train)], "eval": [str(held_out)], "max_images_per_sample": 0},
                "prompts": {"system": "Detect every object as JSON.", "user": "List every object."},
                "rollout": {
                    "backend": "hf",
                    "mode": "colocate",
                    "decoding": {"max_new_tokens": 12, "temperature": 0.0, "rollout_generate_batch_size": 4},
                },
                "training": {"seed": 0},
            }
        )
    )
    return path


def _bad(capsys, argv, *, names: str) -> str:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert names in err, err
    return err


def test_missing_checkpoint(config, tmp_path, capsys):
    out = tmp_path / "eval"
    _bad(
        capsys, ["--config", str(config), "--model", str(tmp_path / "nope"), "--out", str(out)], names="nope"
    )
    assert not out.exists()


def test_unreachable_server(config, tmp_path, capsys):
    out = tmp_path / "eval"
    argv = [
        "--config",
        str(config),
        "--server",
        "http://127.0.0.1:9",
        "--server-wait-s",
        "1",
        "--out",
        str(out),
    ]
    _bad(capsys, argv, names="127.0.0.1:9")
    assert not out.exists()


def test_malformed_record_names_file_and_line(config, tmp_path, capsys):
    data = tmp_path / "bad.jsonl"
    good = (tmp_path / "data").glob("*.jsonl").__next__().read_text().splitlines()[0]
    data.write_text(good + "\n{not json\n")
    out = tmp_path / "eval"
    _bad(capsys, ["--config", str(config), "--data", str(data), "--out", str(out)], names=f"{data}:2")
    assert not out.exists()


def test_missing_image(config, tmp_path, capsys):
    data = tmp_path / "img.jsonl"
    record = {"images": ["missing.png"], "width": 10, "height": 10, "objects": []}
    data.write_text(json.dumps(record) + "\n")
    image_config = tmp_path / "image.yaml"
    run = yaml.safe_load(config.read_text())
    run["data"]["max_images_per_sample"] = 1
    image_config.write_text(yaml.safe_dump(run))
    out = tmp_path / "eval"
    _bad(capsys, ["--config", str(image_config), "--data", str(data), "--out", str(out)], names="missing.png")
    assert not out.exists()


def test_text_only_run_prints_the_table_without_pictures(config, tmp_path, capsys):
    out = tmp_path / "eval"
    assert main(["--config", str(config), "--out", str(out), "--limit", "2"]) == 0
    printed = capsys.readouterr().out
    assert "gate (maskIoU >= 0.30)" in printed and "COCO segm AP" in printed
    assert sorted(p.name for p in out.iterdir()) == ["metrics.json", "predictions.jsonl"]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["samples"] == 2 and "eval_rollout_f1_iou50" in metrics and "segm_AP" in metrics["coco"]
    assert set(metrics["object_order"]["agreement"]) == {"listed", "sorted"}
    assert len((out / "predictions.jsonl").read_text().splitlines()) == 2
