"""The evaluation run without an engine: the training evaluation's counts, object scores from log-probs,
config resolution for --model / --server, and atomic outputs."""

from __future__ import annotations

import json

import pytest
import yaml

from learner.config import RunConfig
from learner.evaluate.runner import EvalInputError, eval_run_config, evaluate_samples, write_outputs
from learner.trainers.build import sample_context
from learner.trainers.planner import StepPlanner
from shared_schemas.infer import Choice, InferResult
from tests.unit.learner.evaluate.helpers import gt, png, sample
from tests.unit.learner.raw_records import CAT as OBJ
from tests.unit.learner.raw_records import raw_record

_BOX = '"<|coord_{}|>", "<|coord_20|>", "<|coord_300|>", "<|coord_400|>"'
ANSWER = (
    '{"object_1": {"desc": "cat", "bbox_2d": [' + _BOX.format(10) + "]},"
    ' "object_2": {"desc": "cat", "bbox_2d": [' + _BOX.format(12) + "]}}"
)


class ScriptedSource:
    """Answers every request with ANSWER (one hit and one duplicate), log-probs -1 per token when asked."""

    endpoints = ("fake",)

    def __init__(self, tokenizer) -> None:
        self.ids = tokenizer.encode(ANSWER + "<|im_end|>", add_special_tokens=False)
        self.batches = []

    def infer(self, batch):
        self.batches.append(batch)
        lp = [-1.0] * len(self.ids) if batch.request_config.logprobs else None
        return [
            InferResult(
                index=batch.first_index + i,
                request_id=r.request_id,
                prompt_token_ids=[1],
                choices=[Choice(token_ids=self.ids, text=ANSWER, finish_reason="stop", logprobs=lp)],
                weight_version=0,
            )
            for i, r in enumerate(batch.infer_requests)
        ]

    def close(self) -> None:
        pass


def _sample(i: int) -> dict:
    return raw_record(i, [OBJ, {"desc": "dog", "bbox_2d": [600, 600, 700, 700]}])


@pytest.fixture()
def cfg(tiny_model_dir) -> RunConfig:
    return RunConfig.model_validate(
        {"model": {"path": str(tiny_model_dir)}, "data": {"train": ["x.jsonl"]}, "rollout": {"backend": "hf"}}
    )


def test_same_counts_as_the_training_evaluation_whatever_the_batch_size(cfg, tiny_tokenizer):
    samples = [_sample(i) for i in range(5)]
    ctx = sample_context(cfg, tiny_tokenizer)
    planner = StepPlanner.from_config(cfg, ScriptedSource(tiny_tokenizer), ctx, batch_size=8)
    training_sums = planner.evaluate(samples, batch_size=len(samples))
    source = ScriptedSource(tiny_tokenizer)
    metrics, preds = evaluate_samples(cfg, source, ctx, samples, batch_size=2)
    assert [len(b.infer_requests) for b in source.batches] == [2, 2, 1]
    assert all(b.request_config.logprobs for b in source.batches)
    # one hit, one duplicate, one miss per sample: P = R = F1 = 1/2
    assert metrics["eval_rollout_f1"] == pytest.approx(0.5)
    assert metrics["eval_rollout_matched"] == training_sums["matched"] == 5.0
    assert metrics["eval_rollout_duplicates"] == training_sums["duplicates"] == 5.0
    assert [p.index for p in preds] == [0, 1, 2, 3, 4]
    first = preds[0]
    assert first.preds[0].gt == 0 and first.preds[1].duplicate and first.gts[1].pred is None
    assert first.preds[0].score == pytest.approx(-1.0)  # mean of the object's token log-probs
    assert json.loads(json.dumps(first.to_json()))["f1"] == pytest.approx(0.5)


def test_seeds_do_not_depend_on_the_batch_size(cfg, tiny_tokenizer):
    ctx = sample_context(cfg, tiny_tokenizer)
    seeds = []
    for batch_size in (1, 5):
        source = ScriptedSource(tiny_tokenizer)
        evaluate_samples(cfg, source, ctx, [_sample(i) for i in range(5)], batch_size=batch_size)
        seeds.append([s for b in source.batches for s in b.seeds])
    assert seeds[0] == seeds[1]


def test_config_for_a_checkpoint_or_a_server(tmp_path, tiny_model_dir):
    config = tmp_path / "run.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "model": {"path": "/nonexistent/model"},
                "data": {"train": ["x.jsonl"]},
                "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:1"}]},
                "server": {"dtype": "float32", "vllm": {"max_model_len": 1024, "enforce_eager": True}},
            }
        )
    )
    local = eval_run_config(config, model=str(tiny_model_dir))
    assert local.rollout.mode == "colocate" and local.model.path == str(tiny_model_dir)
    assert local.rollout.vllm.max_model_len == 1024 and local.rollout.vllm.dtype == "float32"
    assert local.rollout.vllm.load_format == "auto" and local.rollout.vllm.enforce_eager
    served = eval_run_config(config, server="http://127.0.0.1:5")
    assert served.rollout.mode == "server" and served.rollout.servers[0].base_url == "http://127.0.0.1:5"
    with pytest.raises(EvalInputError, match="/nonexistent/model"):
        eval_run_config(config)
    with pytest.raises(EvalInputError, match="not both"):
        eval_run_config(config, model=str(tiny_model_dir), server="http://x")


def test_outputs_appear_whole_or_not_at_all(tmp_path, monkeypatch):
    image = png(tmp_path / "img.png")
    preds = [sample(0, [], [gt((1, 1, 500, 500))], image=image)]
    out = write_outputs(
        tmp_path / "eval", {"eval_rollout_f1": 0.0}, preds, gallery=3, gallery_select="spread"
    )
    assert sorted(p.name for p in out.iterdir()) == ["gallery.png", "metrics.json", "predictions.jsonl"]
    # a failure while drawing leaves the earlier result untouched and no temporary directory behind
    import learner.evaluate.runner as runner

    def boom(*args, **kwargs):
        raise RuntimeError("drawing failed")

    monkeypatch.setattr(runner, "write_gallery", boom)
    with pytest.raises(RuntimeError):
        write_outputs(out, {"eval_rollout_f1": 1.0}, preds, gallery=3, gallery_select="spread")
    assert json.loads((out / "metrics.json").read_text())["eval_rollout_f1"] == 0.0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["eval", "img.png"]
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(EvalInputError, match="not an evaluation output"):
        write_outputs(other, {}, preds, gallery=0, gallery_select="spread")
