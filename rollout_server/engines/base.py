"""The narrow engine seam of the rollout server
(docs/ARCHITECTURE.md#rollout-source, #the-contract, #determinism).

Routes talk only to `Engine`; `VllmEngine`, `HfEngine` and `EngineGroup` (data parallel) satisfy it, so no
route ever sees DP or a backend. This module also holds the pieces every engine shares: the staged weight
update handed over at commit, the prompt-length check, the adapter check and the result-order check (the
chat-template helpers both processes use are `shared_schemas.torch_common.prompts`).

Dtypes are named with safetensors header codes (`"F32"`, `"BF16"`, …) everywhere on this seam.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol, runtime_checkable

from rollout_server.errors import (
    EngineError,
    LoraDisabledError,
    PromptTooLongError,
    UnknownAdapterError,
)
from shared_schemas.infer import InferBatch, InferResult
from shared_schemas.sync import CollectiveBackend

__all__ = [
    "AdapterUpdate",
    "BucketLayout",
    "CollectiveEngine",
    "Engine",
    "EngineHealth",
    "FullUpdate",
    "ParamSpec",
    "ReceivedUpdate",
    "Rendezvous",
    "SharedUpdate",
    "StagedUpdate",
    "check_adapter_request",
    "check_prompt_lengths",
    "check_engine_results",
    "gather_or_cancel",
]

ParamSpec = tuple[str, tuple[int, ...]]
"""`(safetensors dtype code, shape)` of one parameter, e.g. `("BF16", (1024, 128))`."""


@dataclass(frozen=True)
class FullUpdate:
    """A complete staged full-weight sync: every bucket received and validated against the manifest.

    Attributes:
        version: target weight version (> the engine's current version).
        buckets: safetensors buckets in manifest order; names are the base model's parameter names, dtypes
            and shapes already checked against `Engine.parameter_specs()`. Each is the encoded bytes, or the
            path of a staged safetensors file (the server's staging: engine workers map it by name, so the
            bytes never travel through an RPC; it stays unchanged until `apply_update` returns).
    """

    version: int
    buckets: tuple[bytes | Path, ...]
    mode: Literal["full"] = field(default="full", init=False)

    @property
    def nbytes(self) -> int:
        """Total encoded size of the buckets in bytes."""
        return sum(b.stat().st_size if isinstance(b, Path) else len(b) for b in self.buckets)


@dataclass(frozen=True)
class AdapterUpdate:
    """A complete staged adapter sync (PEFT LoRA/DoRA), served as a LoRA on later requests.

    Attributes:
        version: target weight version (> the engine's current version).
        adapter_name: name requests use in `request_config.adapter`; a re-sync under the same name
            replaces the adapter.
        adapter_config: the PEFT `adapter_config.json` content.
        adapter_safetensors: one safetensors blob with the adapter state dict (PEFT key names).
    """

    version: int
    adapter_name: str
    adapter_config: dict[str, Any]
    adapter_safetensors: bytes
    mode: Literal["adapter"] = field(default="adapter", init=False)


@dataclass(frozen=True)
class ReceivedUpdate:
    """A full sync whose tensors the engine already holds: received over the collective transport
    (`CollectiveEngine.receive_collective`) and staged aside, not yet served.

    Attributes:
        version: target weight version.
        names: the tensors' names (the manifest's, already checked against `Engine.parameter_specs()`).
    """

    version: int
    names: tuple[str, ...]
    mode: Literal["full"] = field(default="full", init=False)


@dataclass(frozen=True)
class SharedUpdate:
    """A full sync handed over as a CUDA buffer shared with the engine's worker on the same GPU (the colocated
    learner's `ipc` handoff, `shared_schemas.torch_common.cuda_ipc`); the workers stage views of it.

    Attributes:
        version: target weight version.
        handoff: the `cuda_ipc.export_buffer` message (names, dtypes and shapes already checked against
            `Engine.parameter_specs()`). The sender keeps the buffer alive and unwritten until
            `apply_update` returns.
    """

    version: int
    handoff: dict[str, Any]
    mode: Literal["full"] = field(default="full", init=False)

    @property
    def names(self) -> tuple[str, ...]:
        """The tensors' names."""
        return tuple(entry[0] for entry in self.handoff["entries"])


StagedUpdate = FullUpdate | AdapterUpdate | ReceivedUpdate | SharedUpdate
"""What `Engine.apply_update` receives at commit."""


@dataclass(frozen=True)
class Rendezvous:
    """Where and how an engine's receivers join the learner's weight-sync group (`weights.group_receive`).

    Attributes:
        backend: `gloo` or `nccl`.
        master_address: the learner's rendezvous store.
        master_port: its port.
        group: group token (a new token means a new group).
        world_size: the whole group: learner + every receiver of every server of the sync.
        timeout_s: limit of the rendezvous and of each broadcast.
        staging: where the receivers keep the received buckets until the commit (`server.sync_staging`:
            `device`, `host`, or `auto` = device when the GPU has room;
            `weights.group_receive.resolve_staging`).
        first_rank: rank of this server's first receiver (the learner gives each server its block of ranks).
    """

    backend: CollectiveBackend
    master_address: str
    master_port: int
    group: str
    world_size: int
    timeout_s: float
    staging: Literal["auto", "device", "host"] = "auto"
    first_rank: int = 1


BucketLayout = list[list[tuple[str, str, tuple[int, ...]]]]
"""Per manifest bucket, its tensors as `(name, safetensors dtype code, shape)` in order."""


@dataclass(frozen=True)
class EngineHealth:
    """An engine's view of itself; the app adds `status: loading` and `uptime_s`
    (docs/ARCHITECTURE.md#health).

    Attributes:
        status: `ok` when it can serve, `error` when it cannot (see `detail`).
        engine: backend name.
        model: resolved local model directory (or hub-less name) the engine serves.
        weight_version: version of the weights now served (0 = as loaded).
        dp: data-parallel engines behind this one.
        tp: tensor-parallel size of each engine.
        lora_enabled: whether adapter syncs and adapter requests are accepted.
        max_model_len: prompt + new tokens limit.
        detail: why the status is `error`.
    """

    status: Literal["ok", "error"]
    engine: Literal["vllm", "hf"]
    model: str
    weight_version: int
    dp: int
    tp: int
    lora_enabled: bool
    max_model_len: int
    detail: str | None = None


@runtime_checkable
class CollectiveEngine(Protocol):
    """An engine that can receive a full sync over the collective transport (vLLM and HF engines)."""

    @property
    def collective_ranks(self) -> int:
        """Receivers this engine brings into a weight-sync group (its workers)."""
        ...

    def holds_group(self, group: str) -> bool:
        """Whether every receiver is in the group `group` already (joined by an earlier sync)."""
        ...

    async def receive_collective(
        self, rendezvous: Rendezvous, first_rank: int, buckets: BucketLayout
    ) -> None:
        """Joins the group when needed (receivers as ranks `first_rank`...), then receives every bucket and
        stages it aside (served at `apply_update(ReceivedUpdate)`); nothing served changes.

        Raises:
            EngineError: the rendezvous or a broadcast failed or timed out (the group is dropped).
        """
        ...


@runtime_checkable
class Engine(Protocol):
    """What the routes need from a generation backend."""

    @property
    def lora_enabled(self) -> bool:
        """Whether adapter syncs and `request_config.adapter` are supported."""
        ...

    @property
    def weight_version(self) -> int:
        """Version of the weights served now; results carry the version that produced them."""
        ...

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request of `batch`; result i answers request i, with index first_index + i.

        Raises `PromptTooLongError` (400) for a request that cannot fit, `UnknownAdapterError` /
        `LoraDisabledError` for a bad `request_config.adapter`, `EngineError` on backend failure. Must not
        block the event loop; requests in flight when an update commits finish on the old weights.
        """
        ...

    async def apply_update(self, update: StagedUpdate) -> None:
        """Applies a staged update all or nothing, resets the prefix cache, sets `weight_version`.

        Raises `LoraDisabledError` for an adapter update without LoRA, `EngineError` when applying
        failed (the engine then still serves the previous weights).
        """
        ...

    async def health(self) -> EngineHealth:
        """Cheap status; must answer while a generation runs."""
        ...

    async def aclose(self) -> None:
        """Releases the engine (processes, threads, memory); idempotent."""
        ...

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Base-model parameter name → `(safetensors dtype code, shape)`, the table full syncs are checked
        against."""
        ...


def check_prompt_lengths(
    prompt_lengths: Sequence[int], max_tokens: int, max_model_len: int, first_index: int = 0
) -> None:
    """Rejects the batch when any prompt cannot fit with its `max_tokens` new tokens.

    Args:
        prompt_lengths: prompt token counts, in request order.
        max_tokens: new tokens asked per completion.
        max_model_len: the engine's limit on prompt + new tokens.
        first_index: global index of the first request (named in the message).

    Raises:
        PromptTooLongError: naming the first offending request's global index and the fix (400).
    """
    for i, length in enumerate(prompt_lengths):
        if length + max_tokens > max_model_len:
            index = first_index + i
            raise PromptTooLongError(
                f"request {index}: {length} prompt + {max_tokens} new tokens > max_model_len {max_model_len};"
                " lower max_tokens or raise server.vllm.max_model_len",
                detail={
                    "index": index,
                    "prompt_tokens": length,
                    "max_tokens": max_tokens,
                    "max_model_len": max_model_len,
                },
            )


def check_adapter_request(adapter: str | None, lora_enabled: bool, loaded: Sequence[str]) -> None:
    """Rejects a request that names an adapter the engine cannot serve.

    Raises:
        LoraDisabledError: an adapter is named but LoRA is off (409).
        UnknownAdapterError: LoRA is on but no adapter of that name was synced (404).
    """
    if adapter is None:
        return
    if not lora_enabled:
        raise LoraDisabledError(
            f"request_config.adapter {adapter!r} given but the server runs without LoRA;"
            " drop the adapter field or start the server with server.vllm.enable_lora: true"
        )
    if adapter not in loaded:
        names = ", ".join(sorted(loaded)) or "none"
        raise UnknownAdapterError(
            f"adapter {adapter!r} is not loaded (loaded: {names}); sync it with mode 'adapter' first"
        )


def check_engine_results(batch: InferBatch, results: Sequence[InferResult]) -> list[InferResult]:
    """Verifies count, order (`index == first_index + i`), request ids and `n` before returning results.

    Raises:
        EngineError: any mismatch (an engine bug, reported as 500).
    """
    if len(results) != len(batch.infer_requests):
        raise EngineError(f"engine returned {len(results)} results for {len(batch.infer_requests)} requests")
    n = batch.request_config.n
    for i, (request, result) in enumerate(zip(batch.infer_requests, results, strict=True)):
        if result.index != batch.first_index + i or result.request_id != request.request_id:
            raise EngineError(
                f"engine result {i} has index {result.index} / request_id {result.request_id!r}, expected"
                f" {batch.first_index + i} / {request.request_id!r}"
            )
        if len(result.choices) != n:
            raise EngineError(f"engine result {result.index} has {len(result.choices)} choices, expected {n}")
    return list(results)


async def gather_or_cancel(jobs: Sequence[Any]) -> list[Any]:
    """Runs coroutines concurrently; on the first failure cancels the rest and raises that failure."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
