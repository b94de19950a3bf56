"""HF ``generate`` with the degenerate-rollout guard equals the per-step stop check (spec/STAGE2.md §5.4)."""

from __future__ import annotations

import pytest
import torch

from learner.stage2.detok import decode_text
from learner.stage2.guard import RepeatTerminateConfig, stop_check_stream
from learner.stage2.guard_hf import RepeatTerminateLogitsProcessor

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    "cfg",
    [
        RepeatTerminateConfig(enabled=True, min_new_tokens=4, max_consecutive_token_repeats=3, ngram_size=0),
        RepeatTerminateConfig(enabled=True, min_new_tokens=4, max_consecutive_token_repeats=0, ngram_size=2),
        RepeatTerminateConfig(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=0,
                              max_object_keys=0),
    ],
    ids=["repeat", "ngram", "object-keys"],
)
def test_guarded_generate_equals_stop_check_on_the_unguarded_stream(tiny_model_dir, tiny_tokenizer, cfg):
    from transformers import AutoModelForCausalLM, LogitsProcessorList

    tok = tiny_tokenizer
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    eot = tok.convert_tokens_to_ids("<|im_end|>")
    prompts = ['{"object_1": {"desc": "cat", "bbox_2d": [', '{"object_1": {"desc": "dog"}, "object_2": {"desc": "cat']
    for text in prompts:
        prompt = torch.tensor([tok.encode(text, add_special_tokens=False)])
        n = prompt.shape[1]
        with torch.no_grad():
            free = model.generate(prompt, do_sample=False, max_new_tokens=40, eos_token_id=[eot])[0, n:].tolist()
            proc = RepeatTerminateLogitsProcessor(cfg, eot, prompt_len=n, tokenizer=tok)
            guarded = model.generate(
                prompt, do_sample=False, max_new_tokens=40, eos_token_id=[eot],
                logits_processor=LogitsProcessorList([proc]),
            )[0, n:].tolist()
        # The object-key rule sees the prompt text too when the prompt is part of the decoded stream: here it is not
        # (only generated tokens count), exactly like stop_check_stream.
        ref, reason = stop_check_stream(free, cfg, eot, lambda g: decode_text(tok, g), max_new_tokens=40)
        assert guarded == ref
        assert (reason == "repeat_terminate") == bool(proc.fired_rows)
