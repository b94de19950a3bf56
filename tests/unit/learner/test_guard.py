"""Degenerate-rollout guard: the learner's config section and the shared rule on the §20.4 examples (the HF
decode loop's guard: tests/unit/rollout_server/test_hf_decode.py; vLLM's: test_vllm_guard.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from learner.rollout.repeat_guard import RepeatTerminateConfig
from shared_schemas.repeat_guard import should_terminate

A, B, C, D = 11, 12, 13, 14


def cfg(**kw) -> RepeatTerminateConfig:
    base = dict(
        enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=0, ngram_repeats=2
    )
    return RepeatTerminateConfig(**{**base, **kw})


def test_consecutive_repeats():
    c = cfg(min_new_tokens=4, max_consecutive_token_repeats=3)
    assert should_terminate([A, B, B, B], "", c)
    assert not should_terminate([B, B, B], "", c)  # n = 3 < min_new_tokens 4
    assert not should_terminate([B, B, A, B], "", c)


def test_ngram_blocks():
    c = cfg(ngram_size=2, ngram_repeats=2)
    assert should_terminate([A, B, C, D, C, D], "", c)
    assert not should_terminate([A, B, C, D, D, C], "", c)
    assert should_terminate([A, B, C, A, B, C, A, B, C], "", cfg(ngram_size=3, ngram_repeats=3))
    assert not should_terminate([C, A, B, C, A, B], "", cfg(ngram_size=2, ngram_repeats=3))


def test_object_keys():
    c = cfg(max_object_keys=2)
    three = '{"object_1": {}, "object_2": {}, "object_3'
    assert should_terminate([A], three, c)
    assert not should_terminate([A], three.rsplit(",", 1)[0], c)


def test_disabled_and_defaults():
    assert not should_terminate(
        [A] * 500, '"object_' * 9, cfg(enabled=False, max_consecutive_token_repeats=3)
    )
    d = RepeatTerminateConfig()
    assert (d.enabled, d.min_new_tokens, d.max_consecutive_token_repeats, d.ngram_size, d.ngram_repeats) == (
        False,
        256,
        64,
        64,
        2,
    )
    assert d.max_object_keys is None
    with pytest.raises(ValidationError):
        RepeatTerminateConfig(unknown=1)
    with pytest.raises(ValidationError):
        RepeatTerminateConfig(min_new_tokens=-1)
