"""The vLLM per-step repeat guard cuts exactly where docs/ALGORITHM.md#repeat-guard says (vs. brute force)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_server.engines.vllm.guard import PrefixView, first_guard_cut
from shared_schemas.infer import RepeatTerminateConfig
from shared_schemas.repeat_guard import should_terminate

A, B, C, D = 1, 2, 3, 4
RUN3 = RepeatTerminateConfig(enabled=True, min_new_tokens=4, max_consecutive_token_repeats=3, ngram_size=0)
NGRAM = RepeatTerminateConfig(enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=2)


@pytest.mark.parametrize(
    ("tokens", "cfg", "cut"),
    [
        ([A, B, B, B, C], RUN3, 4),  # §20.4: [a,b,b,b] fires (before token 4)
        (
            [B, B, B, C],
            RUN3,
            None,
        ),  # §20.4: [b,b,b] does not (n < 4), and [b,b,b,c] has no run of 3 at its end
        ([A, B, C, D, C, D, A], NGRAM, 6),  # §20.4: [a,b,c,d,c,d] fires
        ([A, B, C, D, D, C, A], NGRAM, None),  # §20.4: [a,b,c,d,d,c] does not
    ],
    ids=["20.4-run-fires", "20.4-run-too-short", "20.4-ngram-fires", "20.4-ngram-no"],
)
def test_spec_examples(tokens: list[int], cfg: RepeatTerminateConfig, cut: int | None) -> None:
    assert first_guard_cut(tokens, 0, len(tokens), cfg, None) == cut


def test_text_rule_reads_the_prefix_text() -> None:
    cfg = RepeatTerminateConfig(
        enabled=True, min_new_tokens=0, max_consecutive_token_repeats=0, ngram_size=0, max_object_keys=2
    )
    texts = {
        0: "",
        1: '{"object_1": ',
        2: '{"object_1": {"object_2": ',
        3: '"object_1" "object_2" "object_3"',
    }
    assert first_guard_cut([7, 8, 9, 10], 0, 4, cfg, texts.__getitem__) == 3
    with pytest.raises(ValueError, match="text_of"):
        first_guard_cut([7, 8, 9, 10], 0, 4, cfg, None)


def test_disabled_guard_never_cuts() -> None:
    assert first_guard_cut([B] * 50, 0, 50, RunDisabled, None) is None


RunDisabled = RepeatTerminateConfig(enabled=False, min_new_tokens=0, max_consecutive_token_repeats=2)


def test_already_checked_prefixes_are_skipped() -> None:
    tokens = [A, B, B, B, B, B]
    assert first_guard_cut(tokens, 0, 6, RUN3, None) == 4
    assert first_guard_cut(tokens, 5, 6, RUN3, None) == 5


def test_prefix_view_reads_like_a_slice() -> None:
    tokens = [10, 11, 12, 13, 14]
    view = PrefixView(tokens, 3)
    assert len(view) == 3 and list(view) == [10, 11, 12]
    assert view[-1] == 12 and view[1:] == [11, 12] and view[-2:] == [11, 12]
    with pytest.raises(IndexError):
        _ = view[3]
    with pytest.raises(ValueError):
        PrefixView(tokens, 6)


@settings(max_examples=200, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), max_size=40),
    min_new=st.integers(0, 8),
    run=st.integers(0, 4),
    size=st.integers(0, 3),
    repeats=st.integers(2, 3),
    start=st.integers(0, 10),
)
def test_cut_is_the_first_prefix_where_the_rule_fires(
    tokens: list[int], min_new: int, run: int, size: int, repeats: int, start: int
) -> None:
    cfg = RepeatTerminateConfig(
        enabled=True,
        min_new_tokens=min_new,
        max_consecutive_token_repeats=run,
        ngram_size=size,
        ngram_repeats=repeats,
    )
    stop = len(tokens)
    expected = next((n for n in range(start, stop) if should_terminate(tokens[:n], None, cfg)), None)
    assert first_guard_cut(tokens, start, stop, cfg, None) == expected
