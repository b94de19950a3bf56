"""scripts/vlm_pretrain.py trains the token path the learner teacher-forces (one path for stage 1 and 2)."""

from __future__ import annotations

import sys
from pathlib import Path

from learner.stage2.coords import CoordVocab
from tests.unit.learner.test_unmatched_prefix import CAT, FISH, _prepare, _raw

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "scripts"))
import vlm_pretrain  # noqa: E402

TREE = ("tree", "poly", [1, 2, 30, 4, 5, 60])


def test_stage1_rows_are_the_learners_plain_gt_targets(tiny_tokenizer, tiny_model_dir) -> None:
    gt = [CAT, TREE, FISH]
    _, segment, _ = _prepare(tiny_tokenizer, tiny_model_dir, "keep", [], gt, empty=True)
    start = segment.meta.prompt_len  # labels are unshifted: label i is the id at i (-100: not trained)
    supervised = [i for i, label in enumerate(segment.labels) if i >= start and label != -100]
    learner_ids = list(segment.input_ids[start : supervised[-1] + 1])  # answer ids up to <|im_end|>
    sample = {"gt_objects": [_raw(o) for o in gt], "sample_id": 0}
    ours = vlm_pretrain.answer_token_ids(sample, tiny_tokenizer, CoordVocab.from_tokenizer(tiny_tokenizer))
    assert ours == learner_ids
    # the opening brace is its own token, not the merged '{"' that encoding the whole text gives
    whole = tiny_tokenizer.encode(tiny_tokenizer.decode(ours[:-1]), add_special_tokens=False)
    assert tiny_tokenizer.decode(ours[:1]) == "{" and whole != ours[:-1]
