"""Chunk plan (docs/ALGORITHM.md#chunking-and-retries, §20.5; docs/ARCHITECTURE.md#determinism)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared_schemas.chunking import plan_chunks


@pytest.mark.parametrize(
    ("n", "parts", "ranges"),
    [
        pytest.param(0, 3, [(0, 0), (0, 0), (0, 0)], id="spec-20.5-N0-S3-no-call"),
        pytest.param(5, 2, [(0, 3), (3, 5)], id="spec-20.5-N5-S2"),
        pytest.param(5, 3, [(0, 2), (2, 4), (4, 5)], id="spec-20.5-N5-S3"),
        pytest.param(10, 4, [(0, 3), (3, 6), (6, 9), (9, 10)], id="spec-20.5-N10-S4"),
        pytest.param(2, 4, [(0, 1), (1, 2), (2, 2), (2, 2)], id="parts-beyond-n-empty"),
        pytest.param(7, 1, [(0, 7)], id="one-part"),
    ],
)
def test_plan_chunks_examples(n: int, parts: int, ranges: list[tuple[int, int]]) -> None:
    chunks = plan_chunks(n, parts)
    assert [(c.start, c.stop) for c in chunks] == ranges
    assert [c.part for c in chunks] == list(range(parts))
    assert all(c.empty == (c.size == 0) for c in chunks)


def test_n_zero_means_no_call() -> None:
    assert [c for c in plan_chunks(0, 3) if not c.empty] == []


def test_ten_requests_over_four_reassemble_in_order() -> None:
    requests = [f"r{i}" for i in range(10)]
    answered = {i: requests[i] for c in plan_chunks(10, 4) for i in c.as_range()}
    assert [answered[i] for i in range(10)] == requests


@given(st.integers(min_value=0, max_value=500), st.integers(min_value=1, max_value=40))
def test_plan_covers_range_once_contiguously(n: int, parts: int) -> None:
    chunks = plan_chunks(n, parts)
    assert len(chunks) == parts
    covered = [i for c in chunks for i in c.as_range()]
    assert covered == list(range(n))
    size = -(-n // parts)
    assert all(c.size <= size for c in chunks)


def test_chunk_is_frozen() -> None:
    chunk = plan_chunks(3, 2)[0]
    with pytest.raises(ValueError):
        chunk.start = 1  # type: ignore[misc]


@pytest.mark.parametrize(("n", "parts"), [(-1, 2), (3, 0), (3, -1)])
def test_invalid_arguments(n: int, parts: int) -> None:
    with pytest.raises(ValueError):
        plan_chunks(n, parts)
