"""The reference forward's CPU thread budget (learner/grpo/reference.py: threads_beside_rollout_engine)."""

from __future__ import annotations

import pytest
import torch

from learner.grpo.reference import threads_beside_rollout_engine


@pytest.fixture
def two_threads():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_cpu_leaves_one_core_to_the_engine_and_restores(two_threads) -> None:
    with threads_beside_rollout_engine(torch.device("cpu")):
        assert torch.get_num_threads() == 1
    assert torch.get_num_threads() == 2
    with pytest.raises(RuntimeError), threads_beside_rollout_engine(torch.device("cpu")):
        raise RuntimeError("forward failed")
    assert torch.get_num_threads() == 2  # restored on errors too


def test_accelerators_and_single_threads_are_untouched(two_threads) -> None:
    with threads_beside_rollout_engine(torch.device("cuda", 0)):
        assert torch.get_num_threads() == 2
    torch.set_num_threads(1)
    with threads_beside_rollout_engine(torch.device("cpu")):
        assert torch.get_num_threads() == 1
