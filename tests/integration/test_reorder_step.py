"""`reorder` on a whole step: where the step's rollouts follow the listed order, the step trains exactly what
plain SFT trains (the same tensors), whatever swaps and misses some samples have; where they follow none,
each sample keeps the model's order. One path for text and image samples: the tiny Qwen2 on text records
and the tiny Qwen3-VL (vision tower, processor-expanded image tokens, M-RoPE positions) on image records,
answered by a scripted policy."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from learner.config import RunConfig
from learner.data.prompt_encoding import PromptEncoder
from learner.data.records import build_sample, validate_record
from learner.metrics import StepMetrics
from learner.policy import load_policy
from learner.stage2.gt import extract_gt
from learner.trainers.build import sample_context
from learner.trainers.overlap import RolloutOverlap
from learner.trainers.planner import StepPlanner
from shared_schemas.infer import Choice, InferResult
from tests.unit.learner.raw_records import raw_record

pytestmark = pytest.mark.integration

BOXES = [(10, 20, 110, 120), (300, 40, 400, 140), (50, 400, 150, 500), (500, 600, 700, 800)]
"""Four boxes (norm1000) listed in the ``sorted`` (y, x) anchor order; the records hold the first three."""


class ScriptedPolicy:
    """Answers request ``sample_id:i`` with the answer scripted for that sample, on the prompt ids the engine
    would have seen (the planner's own teacher-forced prompt: images expanded as the engine expands them)."""

    endpoints = ("scripted",)

    def __init__(self, tokenizer: Any, answers: dict[int, str], prompts: dict[int, list[int]]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers
        self.prompts = prompts

    def infer(self, batch):
        out = []
        for i, req in enumerate(batch.infer_requests):
            sample_id = int(req.request_id.split(":")[0])
            ids = self.tokenizer.encode(self.answers[sample_id] + "<|im_end|>", add_special_tokens=False)
            out.append(
                InferResult(
                    index=batch.first_index + i,
                    request_id=req.request_id,
                    prompt_token_ids=self.prompts[sample_id],
                    choices=[Choice(token_ids=ids, text="", finish_reason="stop")],
                    weight_version=1,
                )
            )
        return out


def _text_samples(n: int, _folder: Path) -> list[dict]:
    objects = [{"desc": f"thing{k}", "bbox_2d": [f"<|coord_{v}|>" for v in BOXES[k]]} for k in range(3)]
    return [raw_record(i, objects) for i in range(n)]


def _image_samples(n: int, folder: Path) -> list[dict]:
    from PIL import Image

    samples = []
    for i in range(n):
        Image.radial_gradient("L").convert("RGB").resize((64, 64)).save(folder / f"img{i}.png")
        objects = [{"desc": f"thing{k}", "bbox_2d": list(BOXES[k])} for k in range(3)]
        record = validate_record(
            {"images": [f"img{i}.png"], "width": 1000, "height": 1000, "objects": objects},
            path=str(folder / "d.jsonl"),
        )
        samples.append(build_sample(record, base_idx=i, dataset="d", dataset_namespace=0) | {"sample_id": i})
    return samples


@pytest.fixture(scope="module", params=["text", "image"])
def kind(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def step_parts(kind: str, request, tmp_path_factory):
    """`(model dir, tokenizer, encoder or None, samples)` of the text or the image path."""
    folder = tmp_path_factory.mktemp(f"reorder-{kind}")
    if kind == "text":
        model_dir = request.getfixturevalue("tiny_model_dir")
        return model_dir, request.getfixturevalue("tiny_tokenizer"), None, _text_samples(3, folder)
    model_dir = request.getfixturevalue("tiny_vlm_dir")
    cfg = _cfg(model_dir, warmup=0)
    policy = load_policy(cfg.model, model_dir)
    encoder = PromptEncoder.for_model(policy.model.eval(), policy.tokenizer, policy.processor)
    return model_dir, policy.tokenizer, encoder, _image_samples(3, folder)


def _cfg(model_dir: Path, *, warmup: int) -> RunConfig:
    return RunConfig.model_validate(
        {
            "model": {"path": str(model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {"sft_warmup_steps": warmup, "targets": {"unmatched_prefix": "reorder"}},
            "training": {"seed": 3},
        }
    )


def _answer(sample: dict, order: list[int]) -> str:
    """The answer a model emits with the objects ``order`` (indices into BOXES; 3 is a false positive)."""
    listed = extract_gt(sample["gt_objects"], int(sample["sample_id"])).objects
    boxes = [listed[k].bins if k < len(listed) else list(BOXES[k]) for k in order]
    objects = {
        f"object_{n + 1}": {"desc": f"thing{k}", "bbox_2d": [f"<|coord_{v}|>" for v in box]}
        for n, (k, box) in enumerate(zip(order, boxes, strict=True))
    }
    return json.dumps(objects)


def _step(step_parts, orders: list[list[int]], *, warmup: int) -> tuple[list, dict]:
    model_dir, tokenizer, encoder, samples = step_parts
    cfg = _cfg(model_dir, warmup=warmup)
    ctx = sample_context(cfg, tokenizer, encoder)
    answers = {int(s["sample_id"]): _answer(s, order) for s, order in zip(samples, orders, strict=True)}
    prompts = {int(s["sample_id"]): ctx.prompt_ids(s) for s in samples}
    planner = StepPlanner.from_config(
        cfg, ScriptedPolicy(tokenizer, answers, prompts), ctx, batch_size=len(samples)
    )
    raws = [list(samples)]
    planner.new_window()
    batch = planner.step_batch(raws, 10)
    overlap = RolloutOverlap(planner.source.infer, endpoints=planner.source.endpoints)
    rollouts = None if batch is None else overlap.fetch(batch, 10, sync=lambda: 0.0)
    metrics = StepMetrics()
    step = planner.build(raws, rollouts, global_step=10, metrics=metrics)
    return step.prepared, metrics.finalize()


_TENSORS = (
    "input_ids",
    "labels",
    "position_ids",
    "attention_mask",
    "coord_pos",
    "coord_bins",
    "coord_is_prefix",
)


def _tensors(prepared: list) -> list[torch.Tensor | None]:
    return [getattr(p["batch"], name) for p in prepared for name in _TENSORS]


@pytest.mark.parametrize(
    "orders",
    [[[0, 1, 2], [0, 1, 2], [0, 2, 1]], [[0, 1, 2], [0, 2], [0, 3, 1, 2]]],
    ids=["a-swap", "a-miss-and-a-false-positive"],
)
def test_rollouts_that_follow_the_listed_order_train_exactly_plain_sft(step_parts, orders) -> None:
    plain, _ = _step(step_parts, orders, warmup=11)
    reorder, metrics = _step(step_parts, orders, warmup=0)
    assert metrics["rollout/samples"] == 3 and metrics["rollout/matched"] > 0  # every rollout was used
    assert metrics["rollout/reorder_moved"] == 0  # no sample is taught another order than the listed one
    if step_parts[2] is not None:  # the image path: the rows carry the vision inputs too
        assert all(p["batch"].mm_inputs for p in reorder)
    for got, want in zip(_tensors(reorder), _tensors(plain), strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


def test_rollouts_that_follow_no_candidate_keep_each_samples_own_order(step_parts) -> None:
    orders = [[2, 1, 0], [1, 0, 2], [2, 0, 1]]  # pooled agreement with the listed order 1/3 < 0.75
    plain, _ = _step(step_parts, orders, warmup=11)
    reorder, metrics = _step(step_parts, orders, warmup=0)
    assert metrics["rollout/reorder_moved"] > 0
    pairs = zip(_tensors(reorder), _tensors(plain), strict=True)
    assert not all(torch.equal(a, b) for a, b in pairs if a is not None)


def test_a_run_reports_how_often_reorder_moved_the_targets(tmp_path) -> None:
    """`python -m learner` says whether `reorder` did anything (summary.json `reorder_moved_rate`)."""
    from learner.report import reorder_moved_rate

    path = tmp_path / "metrics.jsonl"
    rows = [
        {"step": 0, "environment": {}},
        {"step": 1, "loss": 1.0},  # a plain-GT step: no rollout counters
        {"step": 2, "loss": 1.0, "rollout/samples": 16.0, "rollout/reorder_moved": 4.0},
        {"step": 3, "loss": 1.0, "rollout/samples": 16.0, "rollout/reorder_moved": 0.0},
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert reorder_moved_rate(path) == 4.0 / 32.0
    path.write_text(json.dumps(rows[1]) + "\n")
    assert reorder_moved_rate(path) is None
