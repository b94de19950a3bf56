"""Degenerate-rollout guard rule (docs/ALGORITHM.md#repeat-guard)."""

from __future__ import annotations

import pytest

from shared_schemas.infer import RepeatTerminateConfig
from shared_schemas.repeat_guard import needs_text, should_terminate


def cfg(**kw: object) -> RepeatTerminateConfig:
    base = {"enabled": True, "min_new_tokens": 0, "max_consecutive_token_repeats": 0, "ngram_size": 0}
    return RepeatTerminateConfig.model_validate({**base, **kw})


def test_disabled_never_fires() -> None:
    assert not should_terminate([5] * 500, None, RepeatTerminateConfig())


def test_min_new_tokens_gates_every_rule() -> None:
    c = cfg(min_new_tokens=10, max_consecutive_token_repeats=3)
    assert not should_terminate([5] * 9, None, c)
    assert should_terminate([5] * 10, None, c)


@pytest.mark.parametrize(
    ("tokens", "fires"),
    [([1, 2, 7, 7, 7], True), ([7, 7, 1, 7, 7], False), ([7, 7], False)],
    ids=["last-3-equal", "broken-run", "too-short"],
)
def test_rule_a_consecutive_repeats(tokens: list[int], fires: bool) -> None:
    assert should_terminate(tokens, None, cfg(max_consecutive_token_repeats=3)) is fires


@pytest.mark.parametrize(
    ("tokens", "fires"),
    [
        ([9, 1, 2, 3, 1, 2, 3], True),
        ([9, 1, 2, 3, 1, 2, 4], False),
        ([1, 2, 1, 2, 3], False),
    ],
    ids=["two-blocks", "differs", "not-at-tail"],
)
def test_rule_b_ngram_blocks(tokens: list[int], fires: bool) -> None:
    assert should_terminate(tokens, None, cfg(ngram_size=3, ngram_repeats=2)) is fires


def test_rule_b_three_repeats() -> None:
    c = cfg(ngram_size=2, ngram_repeats=3)
    assert should_terminate([4, 5, 4, 5, 4, 5], None, c)
    assert not should_terminate([0, 5, 4, 5, 4, 5], None, c)


def test_rule_c_object_keys_more_than_k() -> None:
    c = cfg(max_object_keys=2)
    assert needs_text(c)
    two = '{"object_1": {}, "object_2": {'
    assert not should_terminate([1], two, c)
    assert should_terminate([1], two + '}, "object_3', c)
    with pytest.raises(ValueError, match="decoded text"):
        should_terminate([1], None, c)
