"""The training evaluation's gallery: fixed held-out images, one PNG per evaluation, a TensorBoard image."""

from __future__ import annotations

from learner.config import RunConfig
from learner.trainers.build import sample_context
from learner.trainers.eval_gallery import EvalGallery, _spread
from learner.trainers.planner import StepPlanner
from tests.unit.learner.evaluate.helpers import png
from tests.unit.learner.evaluate.test_runner import ScriptedSource, _sample


def test_spread_is_fixed_and_covers_both_ends():
    assert _spread(10, 4) == [0, 3, 6, 9]
    assert _spread(3, 6) == [0, 1, 2]
    assert _spread(5, 1) == [0]


def test_every_evaluation_draws_the_same_images(tmp_path, tiny_model_dir, tiny_tokenizer):
    cfg = RunConfig.model_validate(
        {"model": {"path": str(tiny_model_dir)}, "data": {"train": ["x.jsonl"]}, "rollout": {"backend": "hf"}}
    )
    image = png(tmp_path / "img.png")
    samples = [_sample(i) for i in range(6)]
    for s in samples[1:]:
        s["images"] = [str(image)]  # sample 0 is text-only: never drawn
    gallery = EvalGallery(samples, tmp_path / "run", 3, tensorboard_dir=str(tmp_path / "tb"))
    assert gallery.indices == {1, 3, 5}
    planner = StepPlanner.from_config(
        cfg, ScriptedSource(tiny_tokenizer), sample_context(cfg, tiny_tokenizer), batch_size=8
    )
    for step in (0, 20):
        gallery.begin()
        planner.evaluate(samples, batch_size=6, on_sample=gallery.on_sample)
        assert gallery.write(step, 0.5) == tmp_path / "run" / "gallery" / f"step_{step:04d}.png"
    gallery.close()
    assert sorted(p.name for p in (tmp_path / "run" / "gallery").iterdir()) == [
        "step_0000.png",
        "step_0020.png",
    ]
    assert list((tmp_path / "tb").glob("*.gallery"))
    assert not EvalGallery([_sample(0)], tmp_path, 6).enabled
