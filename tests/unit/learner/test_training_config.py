"""The typed view of `training:` (learner/training_config.py): each default spelled once, HF's where it says
so, errors naming `training.<key>`, and every other key passed to `TrainingArguments` as written."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
from transformers import TrainingArguments

from learner.config import ConfigError, load_run_config
from learner.trainers.build import training_args
from learner.training_config import TRAINING_DEFAULTS, TrainingConfig

DEMO = Path(__file__).resolve().parents[3] / "configs" / "demo_tiny_cpu.yaml"
OURS = {"logging_steps", "report_to", "save_strategy", "disable_tqdm"}
"""The typed keys whose default differs from HF's, each with its reason in its docstring."""


def test_typed_defaults_are_hfs_except_the_ones_that_say_why() -> None:
    hf = {f.name: f.default for f in fields(TrainingArguments)}
    for name, field in TrainingConfig.model_fields.items():
        ours = getattr(TRAINING_DEFAULTS, name)
        assert (ours != hf[name]) == (name in OURS), name
        assert field.description, name


def test_the_view_reads_the_mapping_and_passes_other_keys_through() -> None:
    cfg = load_run_config(DEMO, {"training": {"seed": 7, "resume_from_checkpoint": True}})
    view = cfg.training_view
    assert view.seed == 7 and view.resume_from_checkpoint is True and view.learning_rate == 3e-3
    assert view.disable_tqdm is True  # not in the YAML: the view's default
    arguments = view.arguments()
    assert (
        arguments["lr_scheduler_kwargs"] == {"min_lr_rate": 0.1} and "resume_from_checkpoint" not in arguments
    )


def test_training_arguments_get_the_views_values(tmp_path: Path) -> None:
    cfg = load_run_config(DEMO, {"training": {"logging_steps": 5}})
    args = training_args(cfg, tmp_path, fixed={"max_steps": 3})
    assert (args.seed, args.per_device_train_batch_size, args.logging_steps, args.max_steps) == (0, 16, 5, 3)
    assert args.report_to == ["tensorboard"] and args.save_strategy.value == "no"
    assert args.lr_scheduler_type.value == "cosine_with_min_lr" and not args.remove_unused_columns


@pytest.mark.parametrize(
    ("training", "fragment"),
    [
        ({"bogus_knob": 1}, "training.bogus_knob: not a field of HF TrainingArguments"),
        ({"gradient_accumulation_steps": 100}, "training.gradient_accumulation_steps: 100 > 99 collides"),
        ({"per_device_train_batch_size": 0}, "training.per_device_train_batch_size: Input should be greater"),
        ({"seed": "abc"}, "training.seed: Input should be a valid integer"),
    ],
    ids=["unknown-key", "gas-seeds", "batch-bound", "seed-type"],
)
def test_errors_name_the_training_key(training: dict[str, object], fragment: str) -> None:
    with pytest.raises(ConfigError) as info:
        load_run_config(DEMO, {"training": training})
    assert fragment in str(info.value) and "\n" not in str(info.value)
