"""GRPO overlapped generation (`learner.grpo.overlap.GrpoPrefetch`): the rank-0 scheduling logic with scripted
generation steps. The real run (vLLM server, trainer) is `tests/integration/test_grpo_tiny.py`."""

from __future__ import annotations

import threading

import pytest

from learner.grpo.data import PromptRow
from learner.grpo.generation import StepRollout
from learner.grpo.overlap import GrpoPrefetch
from learner.grpo.rollouts import Group
from learner.trainers.overlap import RolloutWaitTimeout


def _rows(*ids: str) -> list[PromptRow]:
    return [
        PromptRow(index=i, row_id=r, messages=[], prompt_ids=[1], reward_row={}) for i, r in enumerate(ids)
    ]


def _rollout(*versions: int) -> StepRollout:
    row = _rows("a")[0]
    return StepRollout(groups=[Group(prompt_index=i, row=row, completions=[], weight_version=v) for i, v in
                               enumerate(versions)])  # fmt: skip


@pytest.fixture()
def prefetch() -> GrpoPrefetch:
    p = GrpoPrefetch(max_staleness=1, wait_timeout_s=2, endpoints=["http://s1"])
    p.ledger.record(7, 0)  # the sync of step 0 made version 7
    p.ledger.record(8, 1)
    return p


def test_a_fresh_background_step_is_taken_with_its_staleness(prefetch):
    prompts = _rows("a", "b")
    prefetch.launch(1, prompts, lambda: _rollout(7, 7))
    assert prefetch.pending_step == 1
    got = prefetch.take(1, prompts)
    assert got is not None and got.staleness == 1 and prefetch.pending_step is None


def test_too_stale_unknown_or_mismatched_steps_are_not_used(prefetch):
    prompts = _rows("a", "b")
    prefetch.launch(2, prompts, lambda: _rollout(7, 8))  # oldest group from step 0: lag 2 > 1
    assert prefetch.take(2, prompts) is None
    prefetch.launch(2, prompts, lambda: _rollout(99))  # a version no sync of this run made
    assert prefetch.take(2, prompts) is None
    prefetch.launch(2, prompts, lambda: _rollout(8))
    assert prefetch.take(2, _rows("a", "c")) is None  # other prompts


def test_other_ranks_only_track_the_step(prefetch):
    prefetch.launch(3, _rows("a"), None)
    assert prefetch.pending_step == 3
    assert prefetch.take(3, _rows("a")) is None and prefetch.pending_step is None


def test_failures_and_timeouts_surface_at_take(prefetch):
    def boom() -> StepRollout:
        raise RuntimeError("rollout server http://s1 failed request 0 twice")

    prefetch.launch(1, _rows("a"), boom)
    with pytest.raises(RuntimeError, match="http://s1"):
        prefetch.take(1, _rows("a"))
    gate = threading.Event()
    prefetch.wait_timeout_s = 0.05
    prefetch.launch(1, _rows("a"), lambda: gate.wait(5) and _rollout(8))
    with pytest.raises(RolloutWaitTimeout, match=r"step 1 .*http://s1.*rollout\.async\.wait_timeout_s"):
        prefetch.take(1, _rows("a"))
    gate.set()
    prefetch.close()
