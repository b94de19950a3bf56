"""GRPO on detection records (issue 23 item 4): the `detection` reward preset in the config, stage-2 records
in the GRPO data path (text demo records and image records, one code path), and the reward path of the
trainer — prompts loaded from learner.demo_data.scenes records with the REAL tiny tokenizer, completions as
token ids from a fake rollout source, scored by the rank-0 `GroupGenerator` (no server, no model)."""

from __future__ import annotations

import json
import typing
from pathlib import Path
from typing import Any

import pytest

from learner.config import RunConfig
from learner.data.errors import DataRecordError
from learner.data.prompt_encoding import PromptEncoder
from learner.data.records import build_sample
from learner.demo_data.scenes import generate_records
from learner.grpo.config import ConfigError, validate_grpo_run
from learner.grpo.config.sections import GrpoConfig
from learner.grpo.data import PromptRow, PromptSet, load_prompt_rows
from learner.grpo.generation import GroupGenerator, ResamplePool
from learner.grpo.main import build_grpo_trainer, check_reward_rows, resolve_grpo_config
from learner.grpo.rollouts import request_config
from learner.rewards.detection import DETECTION_TASK, DetectionScorer
from learner.rewards.registry import PRESETS
from learner.trainers.build import load_samples
from learner.yaml_loader import load_yaml_with_extends
from shared_schemas.health import Health
from shared_schemas.infer import Choice, InferBatch, InferResult
from tests.unit.learner.grpo.grpo_examples import REPO_ROOT

G = 4


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows), encoding="utf-8")
    return path


# -- config ------------------------------------------------------------------------------------------------
def test_detection_preset_resolves(server_raw: dict[str, Any], model_dir: Path) -> None:
    server_raw["grpo"]["reward_preset"] = "detection"
    server_raw["grpo"]["reward_weights"] = {"detection.recall": 0.1}
    run = validate_grpo_run(server_raw, model_dir.parent)
    assert run.reward_weights == {**PRESETS["detection"], "detection.recall": 0.1}
    assert run.reward_schema_path is None


def test_preset_names_are_the_registry_presets() -> None:
    literal = GrpoConfig.model_fields["reward_preset"].annotation
    assert set(typing.get_args(literal)) == set(PRESETS)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        (
            "reward_preset",
            "detect",
            r"^grpo\.reward_preset: .*'server', 'attr_key', 'detection', 'detection_dedup', "
            r"'detection_count' or 'detection_iou50'",
        ),
        (
            "reward_weights",
            {"detection.map": 1.0},
            r"^grpo\.reward_weights\.detection\.map: unknown reward.*detection\.f1",
        ),
    ],
    ids=["bad-preset", "bad-reward-name"],
)
def test_bad_names_are_config_errors(
    server_raw: dict[str, Any], model_dir: Path, key: str, value: Any, message: str
) -> None:
    server_raw["grpo"][key] = value
    with pytest.raises(ConfigError, match=message):
        validate_grpo_run(server_raw, model_dir.parent)


def test_shipped_detection_config(tiny_model_dir: Path) -> None:
    tree = load_yaml_with_extends(REPO_ROOT / "configs" / "grpo_detection_tiny_cpu.yaml")
    assert tree["model"]["path"] == "runs/demo_stage1/model"
    tiny = str(tiny_model_dir)
    run = validate_grpo_run(tree, REPO_ROOT, {"model.path": tiny, "server.model": tiny})
    cfg = RunConfig.model_validate(run.learner_config)
    assert run.grpo.reward_preset == "detection" and run.reward_weights == dict(PRESETS["detection"])
    assert cfg.data.train == [".cache/data/demo/train.jsonl"] and cfg.data.max_images_per_sample == 0
    assert run.grpo.global_max_length <= run.server.vllm.max_model_len


# -- data --------------------------------------------------------------------------------------------------
def fake_encode(messages: list[dict[str, Any]]) -> list[int]:
    return [ord(c) % 1000 for m in messages for c in json.dumps(m["content"])]


def test_image_detection_records_follow_the_stage2_rules(tmp_path: Path) -> None:
    objects = [{"desc": "cat", "bbox_2d": [1, 2, 30, 40]}]
    record = {"images": ["img/a.png"], "width": 64, "height": 48, "objects": objects, "id": "a"}
    file = write_jsonl(tmp_path / "det.jsonl", [record, {**record, "id": "b", "task_mode": "detection"}])
    loaded = load_prompt_rows(
        [file], fake_encode, budget=10**6, max_images=1, system_prompt="S", user_prompt="U"
    )
    first, second = loaded.rows
    assert first.messages == [
        {"role": "system", "content": "S"},
        {
            "role": "user",
            "content": [
                {"type": "image", "image": str(tmp_path / "img/a.png")},
                {"type": "text", "text": "U"},
            ],
        },
    ]
    assert first.n_images == 1 and first.row_id == "a" and first.meta == {"width": 64, "height": 48}
    assert first.reward_row == {"task_mode": DETECTION_TASK, "objects": objects, "sample_id": 0}
    assert (
        second.reward_row["sample_id"] == 1
    )  # (file namespace << 32) | record index, as stage 2 numbers them
    with pytest.raises(DataRecordError, match=r"det\.jsonl:1.*'images' has 1 entries; expected 0 to 0"):
        load_prompt_rows([file], fake_encode, budget=10**6, max_images=0)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{k: v for k, v in record.items() if k != "width"}])
    with pytest.raises(DataRecordError, match=r"bad\.jsonl:1.*missing required field 'width'"):
        load_prompt_rows([bad], fake_encode, budget=10**6, max_images=1)
    neither = write_jsonl(tmp_path / "neither.jsonl", [{"prompt": "hi"}])
    with pytest.raises(DataRecordError, match="no 'objects' of a detection record"):
        load_prompt_rows([neither], fake_encode, budget=10**6)


@pytest.fixture(scope="module")
def demo_records() -> list[dict[str, Any]]:
    return generate_records(6, seed=3, split="train")


@pytest.fixture()
def demo_file(tmp_path: Path, demo_records: list[dict[str, Any]]) -> Path:
    return write_jsonl(tmp_path / "demo.jsonl", demo_records)


@pytest.fixture()
def demo_rows(demo_file: Path, tiny_tokenizer) -> list[PromptRow]:
    encoder = PromptEncoder(tiny_tokenizer)
    return load_prompt_rows([demo_file], encoder.encode, budget=2048, max_images=0).rows


def test_text_records_give_the_stage2_learner_prompts(
    demo_file: Path, demo_rows: list[PromptRow], tiny_tokenizer, tiny_model_dir: Path
) -> None:
    raw = load_yaml_with_extends(REPO_ROOT / "configs" / "demo_tiny_cpu.yaml")
    raw["model"]["path"] = str(tiny_model_dir)
    cfg = RunConfig.model_validate(raw)
    samples = load_samples([str(demo_file)], cfg)
    encoder = PromptEncoder(tiny_tokenizer)
    assert len(samples) == len(demo_rows) == 6
    for sample, row in zip(samples, demo_rows, strict=True):
        assert row.messages == sample["messages"] and "Scene: " in json.dumps(row.messages)
        assert row.prompt_ids == list(encoder.encode(sample["messages"]).ids)
        # the same objects (the reward matches sets; data.object_ordering only orders SFT targets)
        key = json.dumps
        assert sorted(map(key, row.reward_row["objects"])) == sorted(map(key, sample["gt_objects"]))
        assert not row.has_images


# -- the reward path of the trainer ------------------------------------------------------------------------
class AnswerSource:
    """A rollout source answering prompt row ``r`` with ``answers(r)[j]`` as token ids (+ ``<|im_end|>``),
    decoded like the server (special tokens skipped)."""

    def __init__(self, rows: list[PromptRow], tokenizer, answers) -> None:
        self.by_ids = {tuple(r.prompt_ids): r for r in rows}
        self.tokenizer = tokenizer
        self.answers = answers

    endpoints = ("fake",)

    def health(self) -> Health:
        return Health(
            status="ok", engine="vllm", model="m", weight_version=0, dp=1, tp=1, lora_enabled=False,
            max_model_len=1024, uptime_s=1.0,
        )  # fmt: skip

    def close(self) -> None:
        pass

    def infer(self, batch: InferBatch) -> list[InferResult]:
        results = []
        for i, request in enumerate(batch.infer_requests):
            row = self.by_ids[tuple(request.prompt_token_ids)]
            choices = []
            for text in self.answers(row)[: batch.request_config.n]:
                ids = self.tokenizer.encode(text + "<|im_end|>", add_special_tokens=False)
                decoded = self.tokenizer.decode(ids, skip_special_tokens=True)
                choices.append(Choice(token_ids=ids, text=decoded, finish_reason="stop"))
            results.append(
                InferResult(
                    index=batch.first_index + i,
                    request_id=request.request_id,
                    prompt_token_ids=request.prompt_token_ids,
                    choices=choices,
                    weight_version=1,
                )
            )
        return results


def sft_answer(objects: list[Any]) -> str:
    """The plain-GT answer stage-1 SFT teaches for ``objects``."""
    record = {"images": [], "width": 1000, "height": 1000, "objects": objects}
    sample = build_sample(record, base_idx=0, dataset="d", dataset_namespace=0, include_assistant=True)
    return sample["messages"][-1]["content"]


def answers(row: PromptRow) -> list[str]:
    """Per prompt: the perfect answer, an empty one, the first object only, garbage."""
    objects = row.reward_row["objects"]
    return [sft_answer(objects), "{}", sft_answer(objects[:1]), "garbled answer"]


def check_scored(generator: GroupGenerator, rows: list[PromptRow]) -> None:
    multi = [r for r in rows if len(r.reward_row["objects"]) >= 2][:3]
    assert len(multi) == 3
    step = generator.generate_step(multi, global_step=0)
    assert step.resample_rounds == 0 and [g.row.index for g in step.groups] == [r.index for r in multi]
    for group in step.groups:
        n_gt = len(group.row.reward_row["objects"])
        half = 2 / (1 + n_gt)
        assert group.per_reward["detection.f1"] == [1.0, 0.0, pytest.approx(half), 0.0]
        assert group.per_reward["detection.format"] == [1.0, 1.0, 1.0, 0.0]
        assert group.per_reward["detection.maskiou"] == [1.0, 0.0, 1.0, 0.0]
        assert group.per_reward["detection.recall"] == [1.0, 0.0, pytest.approx(1 / n_gt), 0.0]
        assert group.rewards == [pytest.approx(1.75), 0.25, pytest.approx(half + 0.75), 0.0]


def test_generator_scores_detection_completions(demo_rows: list[PromptRow], tiny_tokenizer) -> None:
    grpo = GrpoConfig(num_generations=G, max_completion_length=240, global_max_length=1024)
    generator = GroupGenerator(
        source=AnswerSource(demo_rows, tiny_tokenizer, answers),
        config=request_config(grpo),
        reward_weights=PRESETS["detection"],
        schemas=None,
        seed=0,
        resample_pool=ResamplePool(demo_rows, seed=0),
        detection=DetectionScorer.from_tokenizer(tiny_tokenizer),
    )
    check_scored(generator, demo_rows)


def test_grpo_trainer_built_on_detection_records(
    tmp_path: Path, demo_file: Path, demo_rows: list[PromptRow], tiny_tokenizer, tiny_model_dir: Path
) -> None:
    """`build_grpo_trainer` from the shipped detection config (model and data pointed at the tiny ones): its
    rank-0 generator carries the detection scorer (stage2.matching) and scores like the unit above."""
    raw = load_yaml_with_extends(REPO_ROOT / "configs" / "grpo_detection_tiny_cpu.yaml")
    raw["model"]["path"] = raw["server"]["model"] = str(tiny_model_dir)
    raw["data"] = {"train": [str(demo_file)], "max_images_per_sample": 0}
    raw.update(
        output_dir=str(tmp_path / "out"), training={**raw["training"], "max_steps": 1, "report_to": []}
    )
    config = tmp_path / "grpo.yaml"
    config.write_text(json.dumps(raw), encoding="utf-8")  # JSON is YAML
    resolved, cfg = resolve_grpo_config(config)
    run = build_grpo_trainer(resolved, cfg, source=AnswerSource(demo_rows, tiny_tokenizer, answers))
    generator = run.trainer.generator
    assert generator is not None and generator.detection is not None
    assert (
        generator.detection.matching == cfg.stage2.matching
        and generator.reward_weights == PRESETS["detection"]
    )
    assert [r.prompt_ids for r in run.trainer.prompts] == [r.prompt_ids for r in demo_rows]
    check_scored(generator, run.trainer.prompts)


def test_rewards_and_rows_must_fit(demo_rows: list[PromptRow]) -> None:
    detection = PromptSet(rows=demo_rows, deleted_overlong=0, budget=2048)
    summary_row = PromptRow(
        0, "s", [], [1], {"task_mode": "summary", "domain": "BBU", "summary_ref": "无关图片"}
    )
    summary = PromptSet(rows=[summary_row], deleted_overlong=0, budget=2048)
    check_reward_rows(dict(PRESETS["detection"]), detection)
    check_reward_rows(dict(PRESETS["server"]), summary)
    with pytest.raises(ConfigError, match=r"^grpo\.reward_preset: detection rewards .* no detection records"):
        check_reward_rows(dict(PRESETS["detection"]), summary)
    with pytest.raises(
        ConfigError, match=r"^grpo\.reward_preset: .*detection records only.*reward_preset: detection"
    ):
        check_reward_rows(dict(PRESETS["server"]), detection)
