"""The one rollout seam of the learner: `RolloutSource`, and the reassembly check every source applies to its
results (docs/ARCHITECTURE.md#rollout-source). The weight update a source receives, its report and errors,
and the weight-sync half of the seam (`SyncTarget`) are `learner.weights.types`.

The learner never knows whether rollouts come from rollout servers over HTTP (`ServerRolloutSource` in
`learner.rollout.server_source`) or from an in-process engine (`ColocateRolloutSource`); both take the wire
schema objects of `shared_schemas` and return `InferResult`s in request order.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

from learner.weights.types import SyncTarget
from shared_schemas.infer import InferBatch, InferResult

__all__ = ["ResultMismatchError", "RolloutSource", "check_results", "staleness"]


class ResultMismatchError(RuntimeError):
    """Results do not answer the batch one-to-one (missing, duplicated or extra index or request id)."""


@runtime_checkable
class RolloutSource(SyncTarget, Protocol):
    """Where rollouts come from: rollout servers over HTTP, or an engine in this process; also where weight
    syncs go (`SyncTarget`: `endpoints`, `sync_weights`, `health`)."""

    def infer(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request; `results[i]` answers `batch.infer_requests[i]`, index `first_index + i`.

        An empty batch returns `[]` without touching any engine. Raises on any failure — never returns
        fewer results (see `check_results`).
        """
        ...

    def close(self) -> None:
        """Releases connections, threads or engines; idempotent."""
        ...


def check_results(batch: InferBatch, results: Iterable[InferResult]) -> list[InferResult]:
    """Places results by index and verifies they answer `batch` exactly once each.

    Args:
        batch: the batch the results answer (global indices `first_index + i`).
        results: results in any order.

    Returns:
        Results in request order: `out[i].index == batch.first_index + i`.

    Raises:
        ResultMismatchError: an index outside the batch (extra), an index given twice (duplicated), an
            index never given (missing), or a `request_id` not echoing its request's.
    """
    n = len(batch.infer_requests)
    placed: list[InferResult | None] = [None] * n
    for result in results:
        i = result.index - batch.first_index
        if not 0 <= i < n:
            raise ResultMismatchError(
                f"result index {result.index} is outside the batch [{batch.first_index},"
                f" {batch.first_index + n}) (extra result)"
            )
        if placed[i] is not None:
            raise ResultMismatchError(f"result index {result.index} received twice (duplicated result)")
        want = batch.infer_requests[i].request_id
        if result.request_id != want:
            raise ResultMismatchError(
                f"result index {result.index} carries request_id {result.request_id!r}, expected {want!r}"
            )
        placed[i] = result
    missing = [batch.first_index + i for i, r in enumerate(placed) if r is None]
    if missing:
        raise ResultMismatchError(f"{len(missing)} results missing, indices {missing[:10]}")
    return [r for r in placed if r is not None]


def staleness(learner_version: int, results: Sequence[InferResult]) -> list[int]:
    """Per result, how many weight versions the generating weights lag the learner's (0 = on-policy)."""
    return [learner_version - r.weight_version for r in results]
