"""Overlapped rollouts (`learner.trainers.overlap`): pure scheduling logic with a scripted rollout function.

The real thing (vLLM server, trainer, resume, a killed server) is `tests/integration/test_async_rollouts.py`.
"""

from __future__ import annotations

import threading

import pytest

from learner.metrics import StepMetrics
from learner.trainers.overlap import (
    RolloutFailedElsewhere,
    RolloutOverlap,
    RolloutWaitTimeout,
    VersionLedger,
    WindowLookahead,
    _runs,
)
from shared_schemas.infer import Choice, InferBatch, InferRequest, InferResult, RequestConfig
from tests.unit.learner.infer_stubs import stub_results


def _batch(n: int = 4, seed0: int = 100) -> InferBatch:
    return InferBatch(
        infer_requests=[
            InferRequest(messages=[{"role": "user", "content": f"q{i}"}], request_id=f"{i}:{i}")
            for i in range(n)
        ],
        request_config=RequestConfig(max_tokens=4),
        first_index=0,
        seeds=[seed0 + i for i in range(n)],
    )


class Server:
    """Answers with the current `version`; `versions[i]` overrides the version of global index i once."""

    def __init__(self) -> None:
        self.version = 0
        self.calls: list[tuple[int, int]] = []
        self.versions: dict[int, int] = {}
        self.gate: threading.Event | None = None
        self.error: Exception | None = None

    def infer(self, batch: InferBatch) -> list[InferResult]:
        if self.gate is not None:
            self.gate.wait(5)
        if self.error is not None:
            raise self.error
        n = len(batch.infer_requests)
        self.calls.append((batch.first_index, batch.first_index + n))
        return stub_results(batch, lambda index: self.versions.pop(index, self.version))


@pytest.fixture()
def parts() -> tuple[Server, RolloutOverlap, list[int]]:
    server = Server()
    overlap = RolloutOverlap(server.infer, endpoints=["http://s1"], max_staleness=1, wait_timeout_s=2)
    syncs: list[int] = []
    return server, overlap, syncs


def _sync(server: Server, overlap: RolloutOverlap, syncs: list[int], step: int):
    def sync() -> float:
        if step not in syncs:
            syncs.append(step)
            server.version += 1
            overlap.ledger.record(server.version, step)
        return 0.0

    return sync


def test_nothing_requested_ahead_syncs_and_generates_now(parts):
    server, overlap, syncs = parts
    out = overlap.fetch(_batch(), 0, _sync(server, overlap, syncs, 0))
    assert syncs == [0] and server.calls == [(0, 4)]
    assert out.staleness == [0] * 4 and out.prefetched == 0 and out.regenerated == 0
    assert out.wait_s == out.generate_s


def test_background_results_are_taken_without_a_sync_and_carry_their_lag(parts):
    server, overlap, syncs = parts
    _sync(server, overlap, syncs, 0)()
    overlap.launch(_batch(), 1)
    assert overlap.busy and overlap.pending_step == 1
    out = overlap.fetch(_batch(), 1, _sync(server, overlap, syncs, 1))
    assert syncs == [0] and server.calls == [(0, 4)]
    assert out.staleness == [1] * 4 and out.prefetched == 4 and not overlap.busy
    metrics = StepMetrics()
    out.add_metrics(metrics)
    metrics.add({"rollout/samples": 4.0})
    logged = metrics.finalize()
    assert logged["rollout/staleness_mean"] == 1.0 and logged["rollout/staleness_max"] == 1.0
    assert logged["rollout/prefetched"] == 4.0 and logged["rollout/regenerated"] == 0.0


def test_results_older_than_max_staleness_are_regenerated_after_the_sync(parts):
    server, overlap, syncs = parts
    _sync(server, overlap, syncs, 0)()  # v1 = step 0
    _sync(server, overlap, syncs, 1)()  # v2 = step 1
    server.versions = {
        1: 1,
        2: 1,
        3: 7,
    }  # two from step 0 (lag 2), one from a version no sync of this run made
    overlap.launch(_batch(5), 2)
    out = overlap.fetch(_batch(5), 2, _sync(server, overlap, syncs, 2))
    assert syncs == [0, 1, 2]  # the regeneration runs on this step's weights
    assert server.calls == [(0, 5), (1, 4)]  # one contiguous run of stale indices, same seeds and indices
    assert [r.weight_version for r in out.results] == [2, 3, 3, 3, 2]
    assert [r.index for r in out.results] == [0, 1, 2, 3, 4]
    assert out.staleness == [1, 0, 0, 0, 1] and out.regenerated == 3 and out.prefetched == 2


def test_a_background_request_for_other_requests_is_dropped(parts):
    server, overlap, syncs = parts
    overlap.launch(_batch(seed0=1), 1)
    out = overlap.fetch(_batch(seed0=2), 1, _sync(server, overlap, syncs, 1))
    assert syncs == [1] and out.prefetched == 0 and out.staleness == [0] * 4


def test_a_background_failure_is_raised_by_the_step_that_needs_it(parts):
    server, overlap, syncs = parts
    server.error = RuntimeError("rollout server http://s1 failed request 0..3 twice")
    overlap.launch(_batch(), 1)
    with pytest.raises(RuntimeError, match="http://s1"):
        overlap.fetch(_batch(), 1, _sync(server, overlap, syncs, 1))
    assert not overlap.busy


def test_a_wait_past_the_timeout_names_the_servers_and_the_key(parts):
    server, overlap, syncs = parts
    server.gate = threading.Event()
    overlap.wait_timeout_s = 0.05
    overlap.launch(_batch(), 3)
    with pytest.raises(RolloutWaitTimeout, match=r"step 3 .*http://s1.*rollout\.async\.wait_timeout_s"):
        overlap.fetch(_batch(), 3, _sync(server, overlap, syncs, 3))
    server.gate.set()
    overlap.close()


def test_ledger_maps_versions_to_steps():
    ledger = VersionLedger()
    ledger.record(5, 2)
    result = InferResult(
        index=0,
        prompt_token_ids=[1],
        choices=[Choice(token_ids=[], text="", finish_reason="stop")],
        weight_version=5,
    )
    assert ledger.staleness(result, 3) == 1
    assert ledger.staleness(result.model_copy(update={"weight_version": 4}), 3) is None


def test_runs_are_maximal_contiguous_ranges():
    assert list(_runs([0, 1, 2, 5, 7, 8])) == [(0, 3), (5, 6), (7, 9)]
    assert list(_runs([])) == []


def test_lookahead_hands_back_peeked_windows_in_order():
    it = iter(range(10))
    look = WindowLookahead()
    assert look.next(it, 3) == [0, 1, 2]
    assert look.peek(it, 1, 3) == [3, 4, 5]
    assert look.peek(it, 2, 3) == [6, 7, 8]
    assert look.next(it, 3) == [3, 4, 5]
    assert look.peek(it, 1, 3) == [6, 7, 8]
    assert look.peek(it, 2, 3) == [9]  # the epoch's partial last window
    assert look.peek(it, 3, 3) is None
    assert look.next(it, 3) == [6, 7, 8]
    assert look.next(it, 1) == [9]
    assert look.next(it, 3) == []
    # A new epoch iterator starts clean.
    other = iter(range(100, 104))
    assert look.next(other, 2) == [100, 101]


def test_ranks_agree_on_regenerating_so_every_rank_meets_in_the_sync():
    server = Server()
    votes: list[bool] = []

    answers = iter(
        [False, True, False]
    )  # no rank failed; another rank had a stale result; its regeneration went fine

    def other_rank_is_stale(flag: bool) -> bool:  # an all-reduce OR over the ranks
        votes.append(flag)
        return next(answers)

    overlap = RolloutOverlap(server.infer, endpoints=["http://s1"], agree=other_rank_is_stale)
    syncs: list[int] = []
    _sync(server, overlap, syncs, 0)()
    overlap.launch(_batch(), 1)
    out = overlap.fetch(_batch(), 1, _sync(server, overlap, syncs, 1))
    assert votes == [False, False, False]  # this rank neither failed nor had anything stale...
    assert syncs == [0, 1] and server.calls == [(0, 4)]  # ...but joins the sync, and regenerates nothing
    assert out.prefetched == 4 and out.regenerated == 0 and out.staleness == [1] * 4


def test_a_failure_on_another_rank_stops_this_one_too():
    server = Server()
    overlap = RolloutOverlap(server.infer, endpoints=["http://s1"], agree=lambda failed_here: True)
    overlap.launch(_batch(), 1)
    with pytest.raises(RolloutFailedElsewhere, match="another learner rank"):
        overlap.fetch(_batch(), 1, lambda: 0.0)
    with pytest.raises(RolloutFailedElsewhere):  # the synchronous path too
        overlap.fetch(_batch(), 2, lambda: 0.0)
