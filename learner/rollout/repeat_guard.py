"""The learner's `rollout.decoding.repeat_terminate` section: the degenerate-rollout guard's knobs.

The guard's rule lives once, in `shared_schemas.repeat_guard` (every backend applies it: the server's
engines and the colocated ones); see docs/ALGORITHM.md#repeat-guard.
"""

from __future__ import annotations

from pydantic import ConfigDict

from shared_schemas.infer import RepeatTerminateConfig as WireRepeatTerminateConfig

__all__ = ["RepeatTerminateConfig"]


class RepeatTerminateConfig(WireRepeatTerminateConfig):
    """``rollout.decoding.repeat_terminate``: the wire contract's fields and bounds (ONE definition, so a
    value the server would refuse fails when the config loads, not at the first rollout), strict about unknown
    keys as every config section is."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
