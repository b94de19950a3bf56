"""The weight-sync types of the learner: the update a `RolloutSource` receives (`WeightUpdate`), what a
completed sync did (`SyncReport`), how one fails (`SyncError`, `SyncRejected`), and what the sync policy
needs of the rollout side (`SyncTarget`, which every `learner.rollout.base.RolloutSource` is)
(docs/ARCHITECTURE.md#weight-sync).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

import torch

from learner.weights.codec import tensor_spec
from shared_schemas.health import Health
from shared_schemas.sync import TensorSpec, TransportName

__all__ = ["SyncError", "SyncRejected", "SyncReport", "SyncTarget", "WeightUpdate"]


class SyncError(RuntimeError):
    """A weight sync failed; the rollout engine keeps serving its previous weights."""


class SyncRejected(SyncError):
    """The rollout engine refused the update as such (e.g. an adapter sync on an engine without LoRA).

    This is the trigger of `rollout.sync.fallback_to_full`.
    """


@dataclass(frozen=True)
class WeightUpdate:
    """One weight sync, in base-model names (full) or PEFT adapter names (adapter).

    `tensors` is either an ordered mapping name → tensor, or a one-shot lazy iterable of `(name, tensor)`
    pairs (ZeRO-3: parameters are gathered bucket by bucket while the iterable is consumed). A lazy iterable
    must come with `specs`, because the manifest (every name, dtype and shape) is declared before the first
    byte is sent; it must then yield exactly those tensors, in that order.

    Attributes:
        mode: `full` (merged base weights) or `adapter` (a PEFT adapter served as a LoRA).
        version: target weight version, strictly greater than every version the engine has served.
        tensors: the tensors to send (see above); consumed once.
        specs: names, safetensors dtype codes and shapes in send order; required for a lazy iterable,
            derived from the mapping otherwise.
        adapter_config: adapter mode only: the PEFT `adapter_config.json` content (JSON-able).
        adapter_name: adapter mode only: the name generate requests reference in `request_config.adapter`.
        parameters: full mode, optional: the learner's parameters behind `tensors`, which a same-host
            transport may move into its shared files once the sync has committed (`shm`:
            `rollout.sync.shm_share_parameters`); empty: no transport touches the learner's parameters.
    """

    mode: Literal["full", "adapter"]
    version: int
    tensors: Mapping[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]
    specs: tuple[TensorSpec, ...] | None = None
    adapter_config: dict[str, Any] | None = None
    adapter_name: str | None = None
    parameters: tuple[torch.Tensor, ...] = ()

    def __post_init__(self) -> None:
        if self.version < 1:
            raise ValueError(f"weight update version must be >= 1, got {self.version}")
        if self.mode == "adapter" and (self.adapter_config is None or not self.adapter_name):
            raise ValueError("an adapter update needs adapter_config and adapter_name")
        if self.mode == "full" and (self.adapter_config is not None or self.adapter_name is not None):
            raise ValueError("a full update takes no adapter_config or adapter_name")
        if self.specs is None and not isinstance(self.tensors, Mapping):
            raise ValueError("a lazy tensor iterable needs `specs` (names, dtypes, shapes) up front")

    def tensor_specs(self) -> tuple[TensorSpec, ...]:
        """Names, dtype codes and shapes of every tensor, in send order (no tensor data is read)."""
        if self.specs is not None:
            return self.specs
        assert isinstance(self.tensors, Mapping)
        return tuple(tensor_spec(name, t) for name, t in self.tensors.items())

    def iter_tensors(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Yields `(name, tensor)` in send order, checked against `tensor_specs()`.

        Raises:
            SyncError: the iterable yields a tensor other than the declared one, or too few / too many.
        """
        specs = self.tensor_specs()
        items = self.tensors.items() if isinstance(self.tensors, Mapping) else self.tensors
        count = 0
        for count, (name, tensor) in enumerate(items, start=1):
            if count > len(specs):
                raise SyncError(f"weight update yields tensor {name!r} beyond the {len(specs)} declared")
            got, want = tensor_spec(name, tensor), specs[count - 1]
            if got != want:
                raise SyncError(
                    f"weight update tensor {count - 1} is {got.name!r} {got.dtype} {list(got.shape)},"
                    f" declared {want.name!r} {want.dtype} {list(want.shape)}"
                )
            yield name, tensor
        if count != len(specs):
            raise SyncError(f"weight update yielded {count} tensors, {len(specs)} declared")


@dataclass(frozen=True)
class SyncReport:
    """What one completed sync did.

    Attributes:
        mode: `full` or `adapter`.
        version: the weight version now served.
        bytes: raw tensor bytes sent (per engine; safetensors headers excluded).
        seconds: wall time of the whole sync, export included.
        transport: how the bytes travelled: `http`, `shm`, `gloo`, `nccl` (server transports; an adapter sync
            of a collective source reports `http`, which carried it) or `in_process` (colocated engine).
        endpoints: where it was applied (server base URLs, or the colocated engine).
    """

    mode: Literal["full", "adapter"]
    version: int
    bytes: int
    seconds: float
    transport: Literal[TransportName, "in_process"]
    endpoints: tuple[str, ...] = field(default=())


class SyncTarget(Protocol):
    """Where a weight sync goes: the engines behind a rollout source (`RolloutSource` extends it)."""

    @property
    def endpoints(self) -> tuple[str, ...]:
        """Where generation runs (server base URLs, or e.g. `("colocate:vllm",)`), for logs."""
        ...

    def sync_weights(self, update: WeightUpdate) -> SyncReport:
        """Applies `update` atomically on every engine; raises `SyncError` (`SyncRejected` when refused)."""
        ...

    def health(self) -> Health:
        """Status of the engines (`lora_enabled` decides `sync.mode: auto`; `weight_version` the next)."""
        ...
