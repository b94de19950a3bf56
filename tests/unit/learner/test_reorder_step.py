"""`reorder` on a whole step: where the step's rollouts follow the listed order, the step trains exactly what
plain SFT trains (the same tensors), whatever swaps and misses some samples have; where they follow none,
each sample keeps the model's order (tiny Qwen2 tokenizer, a scripted policy)."""

from __future__ import annotations

import pytest
import torch

from learner.config import RunConfig
from learner.metrics import StepMetrics
from learner.trainers.build import sample_context
from learner.trainers.overlap import RolloutOverlap
from learner.trainers.planner import StepPlanner
from shared_schemas.infer import Choice, InferResult
from tests.unit.learner.raw_records import raw_record

BOXES = [(10, 20, 110, 120), (300, 40, 400, 140), (50, 400, 150, 500), (500, 600, 700, 800)]
"""Four boxes listed in the ``sorted`` (y, x) anchor order."""


def _gt(k: int) -> dict:
    return {"desc": f"thing{k}", "bbox_2d": [f"<|coord_{v}|>" for v in BOXES[k]]}


def _answer(order: list[int]) -> str:
    """The answer a model emits with boxes ``order`` (GT indices; 3 is a false positive when absent)."""
    import json

    objects = {
        f"object_{n + 1}": {"desc": f"thing{k}", "bbox_2d": [f"<|coord_{v}|>" for v in BOXES[k]]}
        for n, k in enumerate(order)
    }
    return json.dumps(objects)


class ScriptedPolicy:
    """Answers request ``sample_id:i`` with the answer scripted for that sample."""

    endpoints = ("scripted",)

    def __init__(self, tokenizer, answers: dict[int, str]) -> None:
        self.tokenizer = tokenizer
        self.answers = answers

    def infer(self, batch):
        out = []
        for i, req in enumerate(batch.infer_requests):
            prompt = self.tokenizer.apply_chat_template(
                req.messages, tokenize=True, add_generation_prompt=True
            )
            prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
            answer = self.answers[int(req.request_id.split(":")[0])] + "<|im_end|>"
            ids = self.tokenizer.encode(answer, add_special_tokens=False)
            out.append(
                InferResult(
                    index=batch.first_index + i,
                    request_id=req.request_id,
                    prompt_token_ids=list(prompt),
                    choices=[Choice(token_ids=ids, text="", finish_reason="stop")],
                    weight_version=1,
                )
            )
        return out


def _step(tiny_model_dir, tokenizer, answers: dict[int, str], *, warmup: int) -> tuple[list, dict]:
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
            "stage2": {"sft_warmup_steps": warmup, "targets": {"unmatched_prefix": "reorder"}},
            "training": {"seed": 3},
        }
    )
    ctx = sample_context(cfg, tokenizer)
    planner = StepPlanner.from_config(cfg, ScriptedPolicy(tokenizer, answers), ctx, batch_size=len(answers))
    raws = [[raw_record(i, [_gt(k) for k in range(3)]) for i in sorted(answers)]]
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


def _tensors(prepared: list) -> list[torch.Tensor]:
    return [getattr(p["batch"], name) for p in prepared for name in _TENSORS]


@pytest.mark.parametrize(
    "answers",
    [
        {0: _answer([0, 1, 2]), 1: _answer([0, 1, 2]), 2: _answer([0, 2, 1])},  # one swap of three
        {0: _answer([0, 1, 2]), 1: _answer([0, 2]), 2: _answer([0, 3, 1, 2])},  # a miss; a false positive
    ],
    ids=["a-swap", "a-miss-and-a-false-positive"],
)
def test_rollouts_that_follow_the_listed_order_train_exactly_plain_sft(
    tiny_model_dir, tiny_tokenizer, answers
) -> None:
    plain, _ = _step(tiny_model_dir, tiny_tokenizer, answers, warmup=11)
    reorder, metrics = _step(tiny_model_dir, tiny_tokenizer, answers, warmup=0)
    assert metrics["rollout/reorder_moved"] == 0  # no sample is taught another order than the listed one
    for got, want in zip(_tensors(reorder), _tensors(plain), strict=True):
        assert (got is None and want is None) or torch.equal(got, want)


def test_rollouts_that_follow_no_candidate_keep_each_samples_own_order(
    tiny_model_dir, tiny_tokenizer
) -> None:
    answers = {0: _answer([2, 1, 0]), 1: _answer([1, 0, 2]), 2: _answer([2, 0, 1])}  # agreement 1/3 < 0.75
    plain, _ = _step(tiny_model_dir, tiny_tokenizer, answers, warmup=11)
    reorder, metrics = _step(tiny_model_dir, tiny_tokenizer, answers, warmup=0)
    assert metrics["rollout/reorder_moved"] > 0
    assert not all(
        torch.equal(a, b) for a, b in zip(_tensors(reorder), _tensors(plain), strict=True) if a is not None
    )


def test_a_run_reports_how_often_reorder_moved_the_targets(tmp_path) -> None:
    """`python -m learner` says whether `reorder` did anything (summary.json `reorder_moved_rate`)."""
    import json

    from learner.__main__ import reorder_moved_rate

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
