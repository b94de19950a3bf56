"""Overlapped GRPO generation (`rollout.async`): rank 0 generates the next step while every rank trains.

The GRPO twin of `learner.trainers.overlap` (whose `VersionLedger` and `WindowLookahead` it uses): after the
sync of step v commits, rank 0 runs `GroupGenerator.generate_step` for step v + 1's prompts on a background
thread — the same requests, per-request seeds and dynamic-sampling draws as a synchronous step v + 1 (they are
keyed by the step), generated with weights one step older. Step v + 1 takes the result when its requests
match; a result whose weights lag more than `max_staleness` steps (or an unknown version) is dropped, and the
step generates again after its own sync. The off-policy gap is corrected in the loss by truncated importance
sampling from the server's log-probs (`grpo.tis_mode`, `learner.grpo.loss.tis_weights`).

Holds no `torch.distributed`: every rank tracks which step has a background request (`pending_step`, decided
the same way on every rank); only rank 0 holds the future.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout

from learner.grpo.data import PromptRow
from learner.grpo.generation import StepRollout
from learner.trainers.overlap import RolloutWaitTimeout, VersionLedger

__all__ = ["GrpoPrefetch"]

logger = logging.getLogger(__name__)


class GrpoPrefetch:
    """The one outstanding background generation step of a GRPO run.

    Args:
        max_staleness: `rollout.async.max_staleness`.
        wait_timeout_s: limit of one wait for the background step.
        endpoints: the servers (named in a wait-timeout error).
    """

    def __init__(self, *, max_staleness: int, wait_timeout_s: float, endpoints: Sequence[str]) -> None:
        self.max_staleness = max_staleness
        self.wait_timeout_s = wait_timeout_s
        self.endpoints = tuple(endpoints)
        self.ledger = VersionLedger()
        self.pending_step: int | None = None
        self._future: Future[StepRollout] | None = None
        self._prompt_ids: list[str] = []
        self._pool: ThreadPoolExecutor | None = None

    def launch(
        self, step: int, prompts: Sequence[PromptRow], generate: Callable[[], StepRollout] | None
    ) -> None:
        """Marks step `step`'s generation as requested; rank 0 passes `generate` (run in the background)."""
        self.pending_step = step
        self._prompt_ids = [p.row_id for p in prompts]
        if generate is not None:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grpo-prefetch")
            self._future = self._pool.submit(generate)

    def take(self, step: int, prompts: Sequence[PromptRow]) -> StepRollout | None:
        """Rank 0: the background result for `step` when it answers these prompts and is fresh enough, else
        None (the caller generates now). Raises what the background generation raised.

        Raises:
            RolloutWaitTimeout: not back within `wait_timeout_s`.
        """
        future, self._future = self._future, None
        self.pending_step = None
        if future is None:
            return None
        if [p.row_id for p in prompts] != self._prompt_ids:
            future.cancel()
            logger.warning(
                "background GRPO generation does not answer step %d's prompts; generating now", step
            )
            return None
        try:
            rollout = future.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            raise RolloutWaitTimeout(
                f"the background GRPO generation of step {step} (servers {', '.join(self.endpoints)}) was "
                f"not back after {self.wait_timeout_s:.0f} s; check those servers' logs, or raise "
                "rollout.async.wait_timeout_s"
            ) from None
        lag = self.staleness(rollout, step)
        if lag is None or lag > self.max_staleness:
            logger.warning(
                "step %d: background GRPO groups lag %s steps (> rollout.async.max_staleness=%d); "
                "regenerating",
                step,
                lag,
                self.max_staleness,
            )
            return None
        rollout.staleness = lag
        return rollout

    def staleness(self, rollout: StepRollout, step: int) -> int | None:
        """Steps from the oldest weights that generated `rollout` to step `step` (None: unknown version)."""
        lags = []
        for version in {g.weight_version for g in rollout.groups}:
            synced = self.ledger.steps.get(version)
            if synced is None:
                return None
            lags.append(step - synced)
        return max(lags, default=0)

    def close(self) -> None:
        """Drops the outstanding request (end of training); a running call finishes unread."""
        if self._future is not None:
            self._future.cancel()
        self._future, self.pending_step = None, None
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None
