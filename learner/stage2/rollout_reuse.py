"""Rollout reuse: the dataloader repeater and the E-step / M-step state machine
(docs/ALGORITHM.md#rollout-buffer).

With ``stage2.rollout_buffer.m_steps = m > 1`` every full window of ``gas`` raw micro-batches is
trained ``m`` times: once on fresh rollouts (E-step) and ``m - 1`` times on copies of the prepared
micro-batches cached by the E-step (M-steps). The state is keyed on the window the repeater tagged the
raw batches with, i.e. on the optimizer step, never on the micro-step.

Typical trainer use (one call per optimizer step, after pulling the step's ``gas`` tagged batches)::

    step = buffer.prepare_step(raws, build=plan_fresh_step, global_step=gs, training=model.training)
    # plan_fresh_step(raw_batches) does sync + rollout + parse/match/encode/pack and returns
    # (prepared_micro_batches, N_ce, N_coord); it is only called when step.decision.fresh_rollouts.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from pydantic import Field

from shared_schemas.config import ConfigSection

__all__ = [
    "BufferConsistencyError",
    "PreparedStep",
    "RepeatingLoader",
    "RolloutBuffer",
    "RolloutBufferConfig",
    "StepDecision",
    "TaggedBatch",
    "copy_prepared",
    "fingerprint",
    "repeated_len",
]

logger = logging.getLogger(__name__)

BuildFn = Callable[[list[Any]], tuple[Any, ...]]
"""Fresh-step planner: raw micro-batches -> (prepared micro-batches, N_ce, N_coord[, N_fp]); N_fp (penalized
false-positive tokens, §13.5) is 0 when not returned."""


class RolloutBufferConfig(ConfigSection):
    """Rollout-reuse knobs, YAML section ``stage2.rollout_buffer`` (§15.1)."""

    enabled: bool = False
    """Reuse each window's prepared micro-batches for `m_steps - 1` extra optimizer steps."""
    m_steps: int = Field(default=1, ge=1)
    """Optimizer steps per window: 1 E-step + (m_steps - 1) M-steps; 1 = no reuse."""


class BufferConsistencyError(RuntimeError):
    """The raw batches of a step do not fit the cached window (repeater broken or ``gas`` changed)."""


@dataclass(frozen=True)
class TaggedBatch:
    """A raw micro-batch tagged by the repeater; unpacks as ``batch, window_id, repetition``."""

    batch: Any
    window_id: int
    repetition: int

    def __iter__(self) -> Iterator[Any]:
        return iter((self.batch, self.window_id, self.repetition))


def repeated_len(n: int, gas: int, m_steps: int) -> int:
    """Length of the repeated loader: ``(n // gas) · gas · m_steps + n % gas`` (§15.2)."""
    return (n // gas) * gas * m_steps + n % gas


class RepeatingLoader:
    """Yields every full window of ``gas`` batches ``m_steps`` times, tagged (§15.2).

    The first pass streams batches as the inner loader produces them; later passes replay the stored
    window objects. A trailing partial window (< gas batches) is yielded once. Window ids keep
    increasing across epochs (re-iterations) so they never collide. Unknown attributes (``dataset``,
    ``sampler``, ``set_epoch``, ...) are delegated to the inner loader.

    Example: gas 3, m 2, batches A..D -> ``A B C A B C D`` (len 7).
    """

    def __init__(self, loader: Iterable[Any], gas: int, m_steps: int) -> None:
        if gas < 1 or m_steps < 1:
            raise ValueError(f"RepeatingLoader needs gas >= 1 and m_steps >= 1, got {gas} and {m_steps}")
        self.loader = loader
        self.gas = gas
        self.m_steps = m_steps
        self._next_window = 0

    def __len__(self) -> int:
        return repeated_len(len(self.loader), self.gas, self.m_steps)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_") or name == "loader":
            raise AttributeError(name)
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[TaggedBatch]:
        window: list[Any] = []
        for batch in self.loader:
            window.append(batch)
            yield TaggedBatch(batch, self._next_window, 0)
            if len(window) == self.gas:
                for rep in range(1, self.m_steps):
                    for replay in window:
                        yield TaggedBatch(replay, self._next_window, rep)
                window = []
                self._next_window += 1
        if window:
            self._next_window += 1


def fingerprint(raw_batch: Sequence[Mapping[str, Any]]) -> str:
    """``sha1(json.dumps([[base_idx, sample_id], ...]))`` of a raw micro-batch (§15.3)."""
    ids = [[int(s["base_idx"]), int(s["sample_id"])] for s in raw_batch]
    return hashlib.sha1(json.dumps(ids).encode()).hexdigest()


def copy_prepared(obj: Any) -> Any:
    """Copy-on-reuse (§15.3): new containers all the way down, tensors shared.

    Dicts, lists, tuples and dataclass instances are rebuilt recursively, so popping keys from the copy
    (or from its meta dicts) never touches the cache; tensors are returned as-is and must never be
    modified in place by the trainer.
    """
    if isinstance(obj, torch.Tensor):
        return obj
    if isinstance(obj, dict):
        return {k: copy_prepared(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [copy_prepared(v) for v in obj]
    if isinstance(obj, tuple) and not hasattr(obj, "_fields"):
        return tuple(copy_prepared(v) for v in obj)
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        changes = {f.name: copy_prepared(getattr(obj, f.name)) for f in dataclasses.fields(obj) if f.init}
        return dataclasses.replace(obj, **changes)
    return copy.copy(obj)


@dataclass(frozen=True)
class StepDecision:
    """What one optimizer step does (§15.3).

    Attributes:
        reuse: M-step: train on cached copies; no rollout, no weight sync, carry buffer untouched.
        window_id: repeater window of the step's raw batches (None when untagged / bypassed).
        repetition: pass number within the window (0 = first).
        cache: an E-step whose prepared micro-batches must be stored for later M-steps.
        partial: the step got fewer than ``gas`` raw batches (never cached).
    """

    reuse: bool
    window_id: int | None
    repetition: int
    cache: bool
    partial: bool

    @property
    def fresh_rollouts(self) -> bool:
        """Rollouts — and so the lazy once-per-step weight sync — are due (§5.6, §15.4)."""
        return not self.reuse


@dataclass(frozen=True)
class PreparedStep:
    """Prepared micro-batches of one optimizer step, with the step-global supervision counts."""

    prepared: list[Any]
    n_ce: int
    n_coord: int
    decision: StepDecision
    window_step0: int
    n_fp: int = 0

    def metrics(self) -> dict[str, float]:
        """``rollout/buffer_*`` of §19 for this step."""
        return {
            "rollout/buffer_reuse": float(self.decision.reuse),
            "rollout/buffer_window_step0": float(self.window_step0),
            "rollout/buffer_completed_steps": float(self.decision.repetition),
        }


@dataclass
class _CachedWindow:
    window_id: int
    fingerprints: list[str]
    prepared: list[Any]
    n_ce: int
    n_coord: int
    step0: int
    n_fp: int = 0


def _untag(raws: Sequence[Any]) -> tuple[list[Any], int | None, int | None]:
    """Raw batches and their common (window_id, repetition); untagged input gives (None, None)."""
    if not raws or not all(isinstance(r, TaggedBatch) for r in raws):
        if any(isinstance(r, TaggedBatch) for r in raws):
            raise BufferConsistencyError("a step mixes tagged and untagged raw batches")
        return list(raws), None, None
    tags = {(r.window_id, r.repetition) for r in raws}
    if len(tags) != 1:
        raise BufferConsistencyError(
            "the raw batches of one optimizer step span several (window_id, repetition) tags "
            f"{sorted(tags)}; the repeater's gas must equal the trainer's gradient_accumulation_steps"
        )
    (window_id, repetition) = tags.pop()
    return [r.batch for r in raws], window_id, repetition


class RolloutBuffer:
    """E-step / M-step state machine of §15.3, keyed on the repeater window of each optimizer step.

    Holds at most one window's prepared micro-batches. Not checkpointed: after resume the first step of
    a window that has no cache is an E-step. Bypassed (every step fresh, nothing cached) when disabled,
    when ``m_steps == 1`` and in eval mode.
    """

    def __init__(self, *, m_steps: int, gas: int, enabled: bool = True) -> None:
        if m_steps < 1 or gas < 1:
            raise ValueError(f"RolloutBuffer needs m_steps >= 1 and gas >= 1, got {m_steps} and {gas}")
        self.m_steps = m_steps
        self.gas = gas
        self.enabled = enabled and m_steps > 1
        self._cache: _CachedWindow | None = None

    @classmethod
    def from_config(cls, cfg: RolloutBufferConfig, gas: int) -> RolloutBuffer:
        """Buffer for ``stage2.rollout_buffer`` and the trainer's gradient accumulation steps."""
        return cls(m_steps=cfg.m_steps, gas=gas, enabled=cfg.enabled)

    @property
    def cached_window(self) -> int | None:
        """Window id currently cached, or None."""
        return self._cache.window_id if self._cache is not None else None

    def clear(self) -> None:
        """Forget the cached window."""
        self._cache = None

    def begin_step(self, raws: Sequence[Any], *, training: bool = True) -> StepDecision:
        """Decide E-step or M-step for the step's raw batches (tagged by :class:`RepeatingLoader`).

        Args:
            raws: the step's raw micro-batches (``gas`` of them, fewer when the loader ran out).
            training: False in eval mode, which bypasses the buffer.

        Raises:
            BufferConsistencyError: the raw batches carry different tags.
        """
        _, window_id, repetition = _untag(raws)
        partial = len(raws) < self.gas
        if not (self.enabled and training) or window_id is None:
            return StepDecision(False, window_id, repetition or 0, cache=False, partial=partial)
        assert repetition is not None
        if partial:
            if self._cache is not None and self._cache.window_id == window_id:
                self._cache = None
            logger.warning(
                "window %d has %d < gas=%d raw batches; it is trained once and never reused",
                window_id,
                len(raws),
                self.gas,
            )
            return StepDecision(False, window_id, repetition, cache=False, partial=True)
        if repetition > 0 and self._cache is not None and self._cache.window_id == window_id:
            return StepDecision(True, window_id, repetition, cache=False, partial=False)
        if repetition > 0:
            logger.info("no cached rollouts for window %d (e.g. after resume): running an E-step", window_id)
        # A repetition after which no further pass follows needs no cache.
        return StepDecision(False, window_id, repetition, cache=repetition < self.m_steps - 1, partial=False)

    def store(
        self,
        decision: StepDecision,
        raws: Sequence[Any],
        prepared: Sequence[Any],
        n_ce: int,
        n_coord: int,
        *,
        global_step: int,
        n_fp: int = 0,
    ) -> None:
        """Cache an E-step's prepared micro-batches (no-op unless ``decision.cache``), with the step-global
        counts (``n_fp``: penalized false-positive tokens, §13.5).

        The cache keeps its own copy of the containers, so the caller may consume ``prepared``.
        """
        if not decision.cache:
            return
        batches, window_id, _ = _untag(raws)
        if len(prepared) != len(batches):
            raise BufferConsistencyError(
                f"store got {len(prepared)} prepared micro-batches for {len(batches)} raw batches"
            )
        assert window_id is not None
        self._cache = _CachedWindow(
            window_id=window_id,
            fingerprints=[fingerprint(b) for b in batches],
            prepared=[copy_prepared(p) for p in prepared],
            n_ce=int(n_ce),
            n_coord=int(n_coord),
            step0=global_step,
            n_fp=int(n_fp),
        )

    def reuse(self, decision: StepDecision, raws: Sequence[Any]) -> PreparedStep:
        """Copies of the cached micro-batches for an M-step, after checking every fingerprint.

        Clears the cache after the window's last repetition.

        Raises:
            BufferConsistencyError: not an M-step of the cached window, or a raw batch's fingerprint
                differs from the cached one.
        """
        cache = self._cache
        if not decision.reuse or cache is None or cache.window_id != decision.window_id:
            raise BufferConsistencyError(
                f"reuse called for window {decision.window_id} but the cache holds "
                f"{self.cached_window}; call begin_step first and reuse only when decision.reuse"
            )
        batches, _, _ = _untag(raws)
        for m, batch in enumerate(batches):
            got = fingerprint(batch)
            if m >= len(cache.fingerprints) or got != cache.fingerprints[m]:
                self._cache = None
                raise BufferConsistencyError(
                    f"M-step of window {cache.window_id}, micro-batch {m}: raw-batch fingerprint {got[:12]} "
                    f"differs from the cached E-step's; the repeater is broken or gas changed"
                )
        out = PreparedStep(
            prepared=[copy_prepared(p) for p in cache.prepared],
            n_ce=cache.n_ce,
            n_coord=cache.n_coord,
            decision=decision,
            window_step0=cache.step0,
            n_fp=cache.n_fp,
        )
        if decision.repetition >= self.m_steps - 1:
            self._cache = None
        return out

    def prepare_step(
        self,
        raws: Sequence[Any],
        build: BuildFn,
        *,
        global_step: int,
        training: bool = True,
    ) -> PreparedStep:
        """One optimizer step's prepared micro-batches: cached copies on M-steps, ``build`` otherwise.

        Args:
            raws: the step's raw micro-batches (tagged).
            build: fresh-step planner called with the untagged raw batches on E-steps only; returns
                ``(prepared, N_ce, N_coord[, N_fp])`` with ``N_*`` already all-reduced over ranks.
            global_step: the optimizer step about to run.
            training: False in eval mode (buffer bypassed).
        """
        decision = self.begin_step(raws, training=training)
        if decision.reuse:
            return self.reuse(decision, raws)
        batches, _, _ = _untag(raws)
        prepared, n_ce, n_coord, *rest = build(batches)
        n_fp = int(rest[0]) if rest else 0
        prepared = list(prepared)
        self.store(decision, raws, prepared, n_ce, n_coord, global_step=global_step, n_fp=n_fp)
        return PreparedStep(
            prepared=prepared,
            n_ce=int(n_ce),
            n_coord=int(n_coord),
            decision=decision,
            window_step0=global_step,
            n_fp=n_fp,
        )
