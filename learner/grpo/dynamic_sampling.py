"""Dynamic sampling: replace zero-variance groups (docs/ALGORITHM.md#dynamic-sampling).

A group whose completions all have exactly the same total reward carries no signal. Such groups are
dropped and replaced by groups of new prompts, generated through a callback with the same weights, for at
most ``max_resample_times`` extra rounds. Slots still missing after the last round are filled with that
round's zero-variance groups in generation order (their advantages are 0).

The module is pure: generation and scoring happen inside the caller's ``resample`` callback.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar


class ScoredGroup(Protocol):
    """Anything carrying the total rewards of one prompt's completions."""

    @property
    def rewards(self) -> Sequence[float]: ...


G = TypeVar("G", bound=ScoredGroup)

ResampleFn = Callable[[int, int], Sequence[G]]
"""``resample(num_groups, round_index)`` → exactly ``num_groups`` freshly generated and scored groups;
``round_index`` starts at 1."""


def is_zero_variance(rewards: Sequence[float]) -> bool:
    """True iff every reward equals the first (exact comparison, as §3.4 says "exactly the same")."""
    return all(r == rewards[0] for r in rewards)


@dataclass(frozen=True)
class DynamicSampleResult(Generic[G]):
    """Selected groups and the §3.4 metrics.

    Attributes:
        groups: exactly ``num_groups`` groups: the kept groups in generation order, then the fillers.
        zero_var_groups: zero-variance groups in the first (regular) generation round.
        resample_rounds: extra generation rounds run.
        filled_with_zero_var: slots filled with zero-variance groups of the last round.
    """

    groups: list[G]
    zero_var_groups: int
    resample_rounds: int
    filled_with_zero_var: int

    def metrics(self) -> dict[str, float]:
        """The ``dynamic_sample/*`` metrics of §7."""
        return {
            "dynamic_sample/zero_var_groups": float(self.zero_var_groups),
            "dynamic_sample/resample_rounds": float(self.resample_rounds),
            "dynamic_sample/filled_with_zero_var": float(self.filled_with_zero_var),
        }


def dynamic_sample(
    groups: Sequence[G],
    resample: ResampleFn[G],
    *,
    max_resample_times: int,
    enabled: bool = True,
) -> DynamicSampleResult[G]:
    """Drops zero-variance groups and refills the slots (§3.4).

    Args:
        groups: the regular generation round, in generation order; its length is the number of slots.
        resample: callback generating and scoring new groups (see :data:`ResampleFn`).
        max_resample_times: extra rounds allowed (>= 0).
        enabled: ``dynamic_sample``; when false the groups are returned unchanged (metrics still counted).

    Returns:
        :class:`DynamicSampleResult` with ``len(groups)`` groups.

    Raises:
        ValueError: negative ``max_resample_times`` or a callback returning the wrong number of groups.
    """
    if max_resample_times < 0:
        raise ValueError(f"max_resample_times={max_resample_times} must be >= 0")
    num_slots = len(groups)
    last_round = list(groups)
    kept = [g for g in last_round if not is_zero_variance(g.rewards)]
    zero_var = num_slots - len(kept)
    if not enabled:
        return DynamicSampleResult(list(groups), zero_var, 0, 0)
    rounds = 0
    while len(kept) < num_slots and rounds < max_resample_times:
        rounds += 1
        missing = num_slots - len(kept)
        last_round = list(resample(missing, rounds))
        if len(last_round) != missing:
            raise ValueError(
                f"resample round {rounds} returned {len(last_round)} groups, asked for {missing}"
            )
        kept.extend(g for g in last_round if not is_zero_variance(g.rewards))
    missing = num_slots - len(kept)
    fillers = [g for g in last_round if is_zero_variance(g.rewards)][:missing]
    return DynamicSampleResult(kept + fillers, zero_var, rounds, len(fillers))
