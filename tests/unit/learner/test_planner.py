"""Step planner: seeds, one batched call per step, stage-1 warm-up without rollouts or syncs."""

from __future__ import annotations

import pytest

from learner.config import RunConfig
from learner.metrics import StepMetrics
from learner.rollout.seeds import request_seed
from learner.trainers.build import sample_context
from learner.trainers.overlap import RolloutOverlap
from learner.trainers.planner import StepPlanner
from shared_schemas.infer import Choice, InferResult
from tests.unit.learner.raw_records import CAT as OBJ
from tests.unit.learner.raw_records import raw_record


class RecordingSource:
    """Answers every request with the GT answer of its sample (a perfect policy) and records the calls."""

    endpoints = ("fake",)

    def __init__(self, tokenizer, answer: str) -> None:
        self.tokenizer = tokenizer
        self.answer_ids = tokenizer.encode(answer + "<|im_end|>", add_special_tokens=False)
        self.batches = []

    def infer(self, batch):
        self.batches.append(batch)
        out = []
        for i, req in enumerate(batch.infer_requests):
            prompt = self.tokenizer.apply_chat_template(
                req.messages, tokenize=True, add_generation_prompt=True
            )
            prompt = prompt["input_ids"] if hasattr(prompt, "keys") else prompt
            out.append(
                InferResult(
                    index=batch.first_index + i,
                    request_id=req.request_id,
                    prompt_token_ids=list(prompt),
                    choices=[Choice(token_ids=self.answer_ids, text="", finish_reason="stop")],
                    weight_version=1,
                )
            )
        return out


def _sample(i: int) -> dict:
    return raw_record(i, [OBJ])


def plan(planner, raws, *, global_step, metrics, before_rollout):
    """The trainer's synchronous step: the step's one batch, fetched now (sync first), then built."""
    planner.new_window()
    batch = planner.step_batch(raws, global_step)
    overlap = RolloutOverlap(planner.source.infer, endpoints=planner.source.endpoints)
    rollouts = None if batch is None else overlap.fetch(batch, global_step, sync=before_rollout)
    return planner.build(raws, rollouts, global_step=global_step, metrics=metrics)


@pytest.fixture()
def planner_parts(tiny_model_dir, tiny_tokenizer):
    def make(warmup: int) -> tuple[StepPlanner, RecordingSource]:
        cfg = RunConfig.model_validate(
            {
                "model": {"path": str(tiny_model_dir)},
                "data": {"train": ["x.jsonl"]},
                "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
                "stage2": {"sft_warmup_steps": warmup},
                "training": {"seed": 17},
            }
        )
        answer = (
            '{"object_1": {"desc": "cat", "bbox_2d": '
            '["<|coord_10|>", "<|coord_20|>", "<|coord_300|>", "<|coord_400|>"]}}'
        )
        source = RecordingSource(tiny_tokenizer, answer)
        planner = StepPlanner.from_config(cfg, source, sample_context(cfg, tiny_tokenizer), batch_size=2)
        return planner, source

    return make


def test_one_batched_call_with_spec_seeds_and_a_sync_before_it(planner_parts):
    planner, source = planner_parts(warmup=0)
    syncs = []
    raws = [[_sample(0), _sample(1)], [_sample(2), _sample(3)]]
    metrics = StepMetrics()
    step = plan(planner, raws, global_step=10, metrics=metrics, before_rollout=lambda: syncs.append(1) or 0.0)
    assert len(source.batches) == 1 and len(source.batches[0].infer_requests) == 4
    # §5.3: micro 0 → requests 0, 1; micro 1 → requests 0, 1 again (request index restarts per micro-batch).
    assert source.batches[0].seeds == [request_seed(17, 10, m, i) for m in (0, 1) for i in (0, 1)]
    assert syncs == [1]
    assert len(step.prepared) == 2 and step.n_coord > 0
    out = metrics.finalize()
    assert out["rollout/f1"] == 1.0  # the perfect policy matches every GT object


def test_warmup_steps_make_no_request_and_no_sync(planner_parts):
    planner, source = planner_parts(warmup=5)
    syncs = []
    metrics = StepMetrics()
    step = plan(
        planner,
        [[_sample(0), _sample(1)]],
        global_step=4,
        metrics=metrics,
        before_rollout=lambda: syncs.append(1) or 0.0,
    )
    assert source.batches == [] and syncs == []
    # The empty rollout falls back to "{" + the whole GT: every coordinate is supervised in the tail.
    assert step.n_coord == 8 and step.n_ce > 0
    plan(
        planner,
        [[_sample(2), _sample(3)]],
        global_step=5,
        metrics=metrics,
        before_rollout=lambda: syncs.append(1) or 0.0,
    )
    assert len(source.batches) == 1 and syncs == [1]
