"""The interface of an in-process generation backend (`ColocateBackend`) and what it reports about itself.

`learner.rollout.colocate.hf` and `learner.rollout.colocate.vllm` implement it; `ColocateRolloutSource`
(`learner.rollout.colocate`) drives whichever the run configures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Protocol

from learner.weights.types import WeightUpdate
from shared_schemas.infer import InferBatch, InferResult

__all__ = ["ColocateBackend", "EngineStartError", "EngineStatus"]


class EngineStartError(RuntimeError):
    """The colocated engine could not be created (the message suggests `rollout.backend: hf`)."""


@dataclass(frozen=True)
class EngineStatus:
    """What a colocated backend reports about itself (turned into a `Health` by the source).

    Attributes:
        ok: whether it can generate.
        engine: backend name.
        model: the served model (directory, or the training model's class for `hf`).
        weight_version: version of the weights generating now.
        tp: tensor-parallel size of the engine.
        lora_enabled: whether adapter syncs are applied as LoRA (`sync.mode: auto` reads it).
        max_model_len: prompt + new tokens limit.
        detail: why `ok` is False.
    """

    ok: bool
    engine: Literal["vllm", "hf"]
    model: str
    weight_version: int
    tp: int
    lora_enabled: bool
    max_model_len: int
    detail: str | None = None


class ColocateBackend(Protocol):
    """One in-process generation backend behind `ColocateRolloutSource`."""

    @property
    def name(self) -> Literal["vllm", "hf"]:
        """Backend name, for `endpoints` and `/health`-style reports."""
        ...

    @property
    def sends_weights(self) -> bool:
        """Whether this rank applies weight updates (False on TP-group members other than the leader)."""
        ...

    def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates a non-empty batch; results in request order (index `first_index + i`)."""
        ...

    def apply(self, update: WeightUpdate) -> int:
        """Applies an update all or nothing; returns the tensor bytes handed to the engine."""
        ...

    def status(self) -> EngineStatus:
        """Cheap status."""
        ...

    def close(self) -> None:
        """Releases the engine; idempotent."""
        ...
