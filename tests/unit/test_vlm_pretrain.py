"""scripts/vlm_pretrain.py is a thin command over the learner: one row encoding, one collate, one loss.

- its rows (`learner.stage2.pipeline.stage1_segment`) are the learner's plain-GT token path, id for id, with
  every answer token and the end of turn labelled (one path for stage 1 and 2);
- a training step's loss is the learner's `micro_step_loss` of `pad_segments` on the step's rows, and that is
  the mean token cross-entropy over answer + `<|im_end|>` computed independently (each row alone, the model's
  own M-RoPE positions, full logits): the loss the shipped asset was trained with (real tiny Qwen3-VL);
- a tiny pretrain run on CPU writes its model folder, curve and snapshot, and `--steps 0` scores a model.
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from learner.batching.packed_batch import pad_segments
from learner.config import RunConfig
from learner.stage2.pipeline import stage1_segment
from learner.stage2.step import micro_step_loss
from learner.trainers.build import load_samples, sample_context
from tests.conftest import MODEL_CACHE
from tests.unit.learner.raw_records import raw_record
from tests.unit.learner.test_unmatched_prefix import CAT, FISH, _prepare, _raw

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import vlm_pretrain  # noqa: E402

TREE = ("tree", "poly", [1, 2, 30, 4, 5, 60])


@pytest.fixture(scope="module")
def vlm_dir() -> Path:
    """The tiny random Qwen3-VL test model (built offline on first use, idempotent)."""
    from build_tiny_vlm import MODEL_NAME, build_tiny_vlm

    return build_tiny_vlm(MODEL_CACHE / MODEL_NAME, seed=0)


@pytest.fixture(scope="module")
def image_data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A demo image set of 4 train and 2 held-out images (``learner.demo_data.images``)."""
    from learner.demo_data.images import write_image_dataset

    out = tmp_path_factory.mktemp("demo_vlm")
    write_image_dataset(out, n_train=4, n_eval=2, seed=0)
    return out


def test_stage1_rows_are_the_learners_plain_gt_targets(tiny_tokenizer, tiny_model_dir) -> None:
    gt = [CAT, TREE, FISH]
    _, learner_row, _ = _prepare(tiny_tokenizer, tiny_model_dir, "keep", [], gt, empty=True)
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_model_dir)},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "server", "servers": [{"base_url": "http://127.0.0.1:9"}]},
        }
    )
    row = stage1_segment(
        raw_record(0, [_raw(o) for o in gt], text="scene"), sample_context(cfg, tiny_tokenizer)
    )
    assert row.input_ids == learner_row.input_ids  # prompt, the plain-GT answer, <|im_end|>, "\n"
    start, eot = row.meta.prompt_len, len(row.input_ids) - 2
    # plain SFT: every answer token (coordinates included) and <|im_end|> get CE; prompt and "\n" do not
    assert list(row.labels) == [-100] * start + list(row.input_ids[start : eot + 1]) + [-100]
    assert row.coord_pos == () and row.input_ids[eot] == tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")
    # the opening brace is its own token, not the merged '{"' that encoding the whole text gives
    answer = list(row.input_ids[start:eot])
    whole = tiny_tokenizer.encode(tiny_tokenizer.decode(answer), add_special_tokens=False)
    assert tiny_tokenizer.decode(answer[:1]) == "{" and whole != answer


def _mean_answer_ce(model, rows, image_token_id: int) -> float:
    """Mean next-token CE over the labelled positions of ``rows``, each row forwarded alone with the model
    computing its own M-RoPE positions and every logit (no learner code)."""
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows:
            ids = torch.tensor([row.input_ids])
            logits = model(
                input_ids=ids, mm_token_type_ids=(ids == image_token_id).long(), **row.mm_inputs
            ).logits
            labels = torch.tensor(row.labels)
            total += float(F.cross_entropy(logits[0, :-1], labels[1:], reduction="sum", ignore_index=-100))
            count += int((labels[1:] != -100).sum())
    return total / count


def test_a_training_step_is_the_learners_loss_on_the_learners_batch(vlm_dir, image_data) -> None:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    from learner.data.prompt_encoding import PromptEncoder

    cfg = vlm_pretrain.PretrainConfig(steps=1, batch=4)
    run = vlm_pretrain.run_config(cfg, vlm_dir, image_data, "sorted")
    processor = AutoProcessor.from_pretrained(vlm_dir)
    torch.manual_seed(0)
    model = AutoModelForImageTextToText.from_pretrained(vlm_dir, dtype=torch.float32)
    ctx = sample_context(
        run, processor.tokenizer, PromptEncoder.for_model(model, processor.tokenizer, processor)
    )
    rows = [stage1_segment(s, ctx) for s in load_samples(run.data.train, run)]
    assert len(rows) == 4 and all(row.mm_inputs for row in rows)
    coord_ids = torch.tensor(ctx.coord_vocab.ids)
    model.train()
    with torch.no_grad():
        learners = micro_step_loss(
            model,
            pad_segments(rows, processor.tokenizer.pad_token_id),
            coord_ids=coord_ids,
            eos_id=ctx.eot_id,
        ).loss.item()
    independent = _mean_answer_ce(model, rows, model.config.image_token_id)
    before = copy.deepcopy(model.state_dict())
    losses: list[float] = []
    assert vlm_pretrain.pretrain(model, rows, cfg, ctx, "cpu", lambda _, loss: losses.append(loss)) == 1
    # one step over all 4 rows: the script's loss is the learner's loss of the same rows ...
    assert losses[0] == pytest.approx(learners, rel=1e-5)
    # ... which is the mean token CE over answer + <|im_end|>, the shipped asset's training loss
    assert learners == pytest.approx(independent, rel=1e-5) and 5.0 < independent < 20.0
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())  # and it trained


def test_a_tiny_pretrain_run_writes_its_outputs(vlm_dir, image_data, tmp_path, capsys) -> None:
    out = tmp_path / "stage1"
    common = ["--model-dir", str(vlm_dir), "--data", str(image_data), "--device", "cpu"]
    common += ["--n-eval", "2", "--max-new-tokens", "4", "--batch", "2"]
    code = vlm_pretrain.main(
        [*common, "--out", str(out), "--steps", "2", "--eval-at", "1", "--snapshot-at", "1"]
    )
    assert code == 0
    info = json.loads((out / "pretrain_info.json").read_text())
    assert info["steps"] == 2 and info["config"]["batch"] == 2 and info["object_ordering"] == "sorted"
    assert [point["step"] for point in info["curve"]] == [1, 2]
    assert set(info["curve"][0]) == {"step", "loss", *vlm_pretrain.CURVE_METRICS}
    assert {"model.safetensors", "config.json", "processor_config.json", "tokenizer.json"} <= {
        p.name for p in out.iterdir()
    }
    assert (tmp_path / "stage1.step_1.safetensors").is_file()
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == info["curve"]
    # --steps 0 scores the model it is given: the eval_rollout_* metrics of 2 held-out images
    assert vlm_pretrain.main([*common, "--out", str(tmp_path / "unused"), "--steps", "0"]) == 0
    metrics = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert metrics["eval_rollout_gt_objects"] > 0 and "eval_rollout_f1" in metrics
    assert not (tmp_path / "unused").exists()
