"""HF ``generate`` with the degenerate-rollout guard equals the per-step stop check (spec/STAGE2.md §5.4)."""

from __future__ import annotations

import pytest
import torch

from learner.stage2.detok import decode_text, encode_text
from learner.stage2.guard import RepeatTerminateConfig, stop_check_stream
from learner.stage2.guard_hf import RepeatTerminateLogitsProcessor

pytestmark = pytest.mark.integration

MAX_NEW = 40


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()


def _generate(model, prompt_ids: list[int], eot: int, processors: list) -> list[int]:
    from transformers import LogitsProcessorList

    prompt = torch.tensor([prompt_ids])
    with torch.no_grad():
        out = model.generate(
            prompt,
            do_sample=False,
            max_new_tokens=MAX_NEW,
            eos_token_id=[eot],
            logits_processor=LogitsProcessorList(processors),
        )
    return out[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "cfg",
    [
        RepeatTerminateConfig(enabled=True, min_new_tokens=4, max_consecutive_token_repeats=3, ngram_size=0),
        RepeatTerminateConfig(enabled=True, min_new_tokens=5, max_consecutive_token_repeats=0, ngram_size=2),
    ],
    ids=["repeat", "ngram"],
)
def test_guarded_generate_equals_stop_check_on_the_free_run(model, tiny_tokenizer, cfg):
    tok = tiny_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    # A repetitive prompt makes the random tiny model (tied embeddings) fall into a loop within a few tokens.
    prompt = encode_text(tok, "<|coord_5|><|coord_5|><|coord_5|><|coord_5|>")
    free = _generate(model, prompt, eot, [])
    proc = RepeatTerminateLogitsProcessor(cfg, eot, prompt_len=len(prompt), tokenizer=tok)
    guarded = _generate(model, prompt, eot, [proc])
    ref, reason = stop_check_stream(free, cfg, eot, lambda g: decode_text(tok, g), max_new_tokens=MAX_NEW)
    assert reason == "repeat_terminate"  # the free run loops, so the guard must fire
    assert guarded == ref and guarded[-1] == eot and proc.fired_rows == {0}


class _Script:
    """Makes the real generate loop emit a fixed stream (the model's logits are overwritten)."""

    def __init__(self, stream: list[int], prompt_len: int) -> None:
        self.stream, self.prompt_len = stream, prompt_len

    def __call__(self, input_ids, scores):
        step = input_ids.shape[1] - self.prompt_len
        out = torch.full_like(scores, -1e4)
        out[:, self.stream[step] if step < len(self.stream) else 0] = 0.0
        return out


def test_object_key_rule_through_real_generate(model, tiny_tokenizer):
    tok = tiny_tokenizer
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    cfg = RepeatTerminateConfig(
        enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=0, max_object_keys=2
    )
    stream = encode_text(tok, "".join(f'"object_{n}": {{"desc": "猫"}}, ' for n in range(1, 6)))
    prompt = encode_text(tok, "{")
    proc = RepeatTerminateLogitsProcessor(cfg, eot, prompt_len=len(prompt), tokenizer=tok)
    guarded = _generate(model, prompt, eot, [_Script(stream, len(prompt)), proc])
    ref, reason = stop_check_stream(stream, cfg, eot, lambda g: decode_text(tok, g), max_new_tokens=MAX_NEW)
    assert reason == "repeat_terminate"
    assert guarded == ref and decode_text(tok, guarded).count('"object_') == 3
