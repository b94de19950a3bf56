"""Overlapped rollouts (`rollout.async`, issue 13): servers generate the next window while the learner trains.

One code path for both schedules. Every optimizer step that rolls out asks `RolloutOverlap.fetch` for its
results with the step's one `InferBatch` (`StepPlanner.step_batch`: the §5.3 seeds of that step):

- synchronous (`rollout.async.enabled: false`): nothing was requested ahead, so `fetch` syncs (§5.6) and
  generates now, in the calling thread;
- overlapped: right after the sync of step v commits, the trainer `launch`es the next window's batch (built
  with the seeds of the step that will train it) on one background thread and trains step v meanwhile. When
  that step comes, `fetch` takes the background result instead of generating. A result whose weights lag the
  step by more than `max_staleness` optimizer steps is regenerated now (after this step's sync), never
  trained on. A background failure is raised by `fetch`, as the synchronous call would have raised it.

Staleness is measured per result from the `weight_version` the server stamped on it: `VersionLedger` maps
each version this run synced to the optimizer step whose weights it carries.

`WindowLookahead` gives the trainer the next windows before HF asks for them: it pulls them from HF's epoch
iterator early and hands them back, in order, when HF's loop asks. Nothing of it is checkpointed: after a
resume HF skips exactly the trained windows, and a window whose background rollout was in flight at save time
is simply requested again (same seeds), so no sample is skipped or repeated.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import Any, TypeVar

from learner.metrics import StepMetrics
from shared_schemas.infer import InferBatch, InferResult

__all__ = [
    "RolloutFailedElsewhere",
    "RolloutOverlap",
    "RolloutWaitTimeout",
    "Rollouts",
    "VersionLedger",
    "WindowLookahead",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")
InferFn = Callable[[InferBatch], list[InferResult]]
SyncFn = Callable[[], float]


class RolloutWaitTimeout(RuntimeError):
    """A background rollout was not back within `rollout.async.wait_timeout_s`."""


class RolloutFailedElsewhere(RuntimeError):
    """Another learner rank's rollout failed; this rank stops with it."""


@dataclass
class Rollouts:
    """The results of one step's rollout call, with where they came from.

    Attributes:
        results: `results[i]` answers request `i` of the step's batch.
        staleness: per result, optimizer steps between the weights that generated it and the step that trains
            on it (0 = on-policy).
        generate_s: wall time of the generate calls (in the background for a prefetched window).
        wait_s: time the step blocked on its rollouts (the whole call when synchronous).
        sync_s: weight sync done by `fetch` itself (a synchronous step's lazy sync).
        prefetched: results that came from a background request.
        regenerated: stale background results generated again.
    """

    results: list[InferResult]
    staleness: list[int]
    generate_s: float = 0.0
    wait_s: float = 0.0
    sync_s: float = 0.0
    prefetched: int = 0
    regenerated: int = 0

    def add_metrics(self, metrics: StepMetrics) -> None:
        """Adds the step's timers and `rollout/staleness_*` counters."""
        metrics.add_time("time/weight_sync_s", self.sync_s)
        metrics.add_time("time/rollout_generate_s", self.generate_s)
        metrics.add_time("time/rollout_wait_s", self.wait_s)
        if self.results:
            metrics.add(
                {
                    "rollout/staleness_sum": float(sum(self.staleness)),
                    "rollout/staleness_count": float(len(self.staleness)),
                    "rollout/staleness_max": float(max(self.staleness)),
                    "rollout/prefetched": float(self.prefetched),
                    "rollout/regenerated": float(self.regenerated),
                }
            )


@dataclass
class VersionLedger:
    """Weight version (as servers stamp results) → optimizer step whose weights it carries."""

    steps: dict[int, int] = field(default_factory=dict)

    def record(self, version: int, step: int) -> None:
        """The sync of step `step` committed as `version`."""
        self.steps[int(version)] = int(step)

    def staleness(self, result: InferResult, step: int) -> int | None:
        """Steps from `result`'s weights to step `step`; None for a version no sync of this run produced."""
        synced = self.steps.get(result.weight_version)
        return None if synced is None else step - synced


@dataclass
class _Pending:
    target_step: int
    batch: InferBatch
    future: Future[tuple[list[InferResult], float]]


class RolloutOverlap:
    """Fetches each step's rollouts: from a background request made a step (or more) earlier, else now.

    Args:
        infer: the `RolloutSource.infer` to call (server chunking, retries and errors included).
        endpoints: the servers' base URLs (named in wait-timeout errors).
        max_staleness: `rollout.async.max_staleness`.
        wait_timeout_s: limit of one wait for a background result.
        ledger: weight version → step of this run's syncs (the trainer records every sync).
        agree: with several learner ranks, an all-reduce OR of a flag, called by every rank at the same points
            of `fetch` (did any rank fail; does any rank regenerate); the default is a single process.
    """

    def __init__(
        self,
        infer: InferFn,
        *,
        endpoints: Sequence[str],
        max_staleness: int = 1,
        wait_timeout_s: float = 960.0,
        ledger: VersionLedger | None = None,
        agree: Callable[[bool], bool] = lambda flag: flag,
    ) -> None:
        self._infer = infer
        self._agree = agree
        self.endpoints = tuple(endpoints)
        self.max_staleness = max_staleness
        self.wait_timeout_s = wait_timeout_s
        self.ledger = ledger if ledger is not None else VersionLedger()
        self._pending: _Pending | None = None
        self._pool: ThreadPoolExecutor | None = None

    @property
    def busy(self) -> bool:
        """Whether a background request is outstanding (one at a time)."""
        return self._pending is not None

    @property
    def pending_step(self) -> int | None:
        """The step whose window is being generated in the background, if any."""
        return None if self._pending is None else self._pending.target_step

    def launch(self, batch: InferBatch, target_step: int) -> None:
        """Requests `batch` (the window that step `target_step` will train) in the background.

        Call only after this step's sync committed: the server then generates it with those weights.
        """
        if self._pending is not None:
            raise RuntimeError(
                f"a background rollout for step {self._pending.target_step} is still outstanding; "
                f"fetch it before launching the one of step {target_step}"
            )
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="rollout-prefetch")
        self._pending = _Pending(target_step, batch, self._pool.submit(self._generate, batch))
        logger.debug("background rollout for step %d: %d requests", target_step, len(batch.infer_requests))

    def fetch(self, batch: InferBatch, step: int, sync: SyncFn) -> Rollouts:
        """The results of step `step`'s `batch`: the background ones when they answer this very batch, else
        generated now (after `sync`, the lazy §5.6 sync). Stale background results are regenerated.

        Raises:
            RolloutWaitTimeout: the background request was not back within `wait_timeout_s`.
            Exception: whatever the rollout call raised (server errors name the server).
        """
        pending, self._pending = self._pending, None
        if pending is None:
            sync_s = sync()
            results, generate_s = self._everywhere(lambda: self._generate(batch))
            lags = [max(self.ledger.staleness(r, step) or 0, 0) for r in results]
            return Rollouts(results, lags, generate_s=generate_s, wait_s=generate_s, sync_s=sync_s)
        started = time.perf_counter()
        n = len(batch.infer_requests)
        if pending.target_step == step and _same_requests(pending.batch, batch):
            got, generate_s = self._everywhere(lambda: self._wait(pending))
            results: list[InferResult | None] = list(got)
            lags = [self.ledger.staleness(r, step) for r in got]
            stale = [i for i, lag in enumerate(lags) if lag is None or lag < 0 or lag > self.max_staleness]
        else:
            pending.future.cancel()
            logger.warning(
                "background rollout for step %d does not answer step %d's requests; generating them now",
                pending.target_step,
                step,
            )
            results, lags, stale, generate_s = [None] * n, [None] * n, list(range(n)), 0.0
        wait_s = time.perf_counter() - started
        sync_s = 0.0
        # Collective with several ranks: when any rank regenerates, every rank first meets in this
        # step's sync.
        if self._agree(bool(stale)):
            if stale:
                logger.warning(
                    "step %d: %d of %d background rollouts lag more than rollout.async.max_staleness=%d "
                    "steps; regenerating them",
                    step,
                    len(stale),
                    n,
                    self.max_staleness,
                )
            started = time.perf_counter()
            sync_s = sync()

            def regenerate() -> float:
                seconds = 0.0
                for start, stop in _runs(stale):
                    fresh, took = self._generate(batch.slice(start, stop))
                    seconds += took
                    results[start:stop] = fresh
                    lags[start:stop] = [max(self.ledger.staleness(r, step) or 0, 0) for r in fresh]
                return seconds

            generate_s += self._everywhere(regenerate)
            wait_s += time.perf_counter() - started - sync_s
        return Rollouts(
            [r for r in results if r is not None],
            [int(lag or 0) for lag in lags],
            generate_s=generate_s,
            wait_s=wait_s,
            sync_s=sync_s,
            prefetched=n - len(stale),
            regenerated=len(stale),
        )

    def discard(self) -> None:
        """Forgets the outstanding background request (end of training); a running call finishes unread."""
        if self._pending is not None:
            self._pending.future.cancel()
            logger.info("background rollout for step %d discarded", self._pending.target_step)
            self._pending = None

    def close(self) -> None:
        """Discards the outstanding request and stops the background thread (without waiting for it)."""
        self.discard()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    # -- internals ---------------------------------------------------------------------------------
    def _generate(self, batch: InferBatch) -> tuple[list[InferResult], float]:
        started = time.perf_counter()
        results = list(self._infer(batch))
        return results, time.perf_counter() - started

    def _everywhere(self, call: Callable[[], T]) -> T:
        """Runs this rank's part of a rollout; then every rank learns (through `agree`) whether any rank
        failed, so a failure on one rank stops all of them instead of leaving the others in the next
        collective."""
        failure: Exception | None = None
        try:
            value = call()
        except Exception as exc:  # re-raised below, after the other ranks learnt of it
            failure = exc
        if self._agree(failure is not None):
            if failure is not None:
                raise failure
            raise RolloutFailedElsewhere(
                "a rollout failed on another learner rank (that rank's log names the server and the cause); "
                "this rank stops with it"
            )
        return value

    def _wait(self, pending: _Pending) -> tuple[list[InferResult], float]:
        try:
            return pending.future.result(timeout=self.wait_timeout_s)
        except FutureTimeout:
            raise RolloutWaitTimeout(
                f"the background rollout of step {pending.target_step} ({len(pending.batch.infer_requests)} "
                f"requests to {', '.join(self.endpoints)}) was not back after {self.wait_timeout_s:.0f} s; "
                "check those servers' logs (a hung or overloaded engine), or raise "
                "rollout.async.wait_timeout_s"
            ) from None


def _same_requests(a: InferBatch, b: InferBatch) -> bool:
    """Same requests (ids and messages), seeds, decoding and indices: the same rollout call."""
    return a.model_dump(mode="json") == b.model_dump(mode="json")


def _runs(indices: Sequence[int]) -> Iterator[tuple[int, int]]:
    """Maximal contiguous `[start, stop)` runs of sorted `indices`."""
    start = prev = None
    for i in indices:
        if start is None:
            start = prev = i
        elif i == prev + 1:
            prev = i
        else:
            yield start, prev + 1
            start = prev = i
    if start is not None:
        yield start, prev + 1


class WindowLookahead:
    """Windows of raw micro-batches pulled from HF's epoch iterator before the step that trains them.

    `next` hands back, in order, what `peek` pulled early (then reads the iterator itself), so HF's loop sees
    exactly the batches it would have read. A new epoch iterator drops what was peeked from the old one.
    """

    def __init__(self) -> None:
        self._iterator: Any = None
        self._batches: deque[Any] = deque()
        self._exhausted = False

    def next(self, iterator: Iterator[Any], num_batches: int) -> list[Any]:
        """The next `num_batches` micro-batches (fewer when the epoch ends)."""
        self._bind(iterator)
        self._fill(num_batches)
        return [self._batches.popleft() for _ in range(min(num_batches, len(self._batches)))]

    def peek(self, iterator: Iterator[Any], distance: int, window: int) -> list[Any] | None:
        """The window of the step `distance` steps after the current one (whose window `next` handed out),
        assuming windows of `window` batches; None when the epoch ends before it."""
        self._bind(iterator)
        start = (distance - 1) * window
        self._fill(start + window)
        part = list(self._batches)[start : start + window]
        return part or None

    def _bind(self, iterator: Iterator[Any]) -> None:
        if iterator is self._iterator:
            return
        if self._batches:
            logger.warning("a new epoch started: %d micro-batches read ahead are dropped", len(self._batches))
        self._iterator, self._batches, self._exhausted = iterator, deque(), False

    def _fill(self, count: int) -> None:
        while len(self._batches) < count and not self._exhausted:
            try:
                self._batches.append(next(self._iterator))
            except StopIteration:
                self._exhausted = True
