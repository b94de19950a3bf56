"""Weight updates of one vLLM engine: two-phase (stage, then commit) so a data-parallel group can apply an
update to all its members or to none (docs/ARCHITECTURE.md#sync-weights).

Staging happens while generations go on and changes nothing served: every worker maps the staged bucket files
by name (`worker`; bytes are sent through the RPC only for in-memory buckets), an adapter is written as a PEFT
folder and loaded into vLLM's LoRA cache. Commit closes the `UpdateGate` (new batches wait, running ones
finish on the old weights), swaps the update in, resets the prefix and encoder caches and sets the version. A
full sync may leave whole layers out, but a layer sent in part is refused before anything is staged (vLLM
rebuilds every layer it touches).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rollout_server.engines.base import (
    AdapterUpdate,
    BucketLayout,
    ParamSpec,
    ReceivedUpdate,
    Rendezvous,
    SharedUpdate,
    StagedUpdate,
)
from rollout_server.engines.gate import UpdateGate
from rollout_server.engines.vllm.adapters import AdapterStore, adapter_rank
from rollout_server.engines.vllm.params import incomplete_load_groups, safetensors_names
from rollout_server.engines.vllm.worker import (
    COMMIT_METHOD,
    DISCARD_METHOD,
    STAGE_FILES_METHOD,
    STAGE_IPC_METHOD,
    STAGE_METHOD,
    STAGE_RECEIVED_METHOD,
)
from rollout_server.errors import EngineError, LoraDisabledError, StaleVersionError, SyncValidationError

logger = logging.getLogger(__name__)

__all__ = ["WeightUpdater"]


class WeightUpdater:
    """Stages and commits updates for one `AsyncLLM`; owns the gate, the adapters and the weight version.

    Args:
        llm: the engine's `AsyncLLM`.
        specs: checkpoint parameter table (for the whole-layer check).
        lora_enabled: whether adapters may be served.
        max_lora_rank: largest adapter rank vLLM accepts.
    """

    def __init__(
        self, llm: Any, specs: Mapping[str, ParamSpec], *, lora_enabled: bool, max_lora_rank: int
    ) -> None:
        self._llm = llm
        self._specs = specs
        self._lora_enabled = lora_enabled
        self._max_lora_rank = max_lora_rank
        self.gate = UpdateGate()
        """Generations hold it shared, commits exclusively."""
        self.adapters = AdapterStore()
        """Synced adapters and the default one."""
        self.version = 0
        """Weight version served now."""
        self.failure: str | None = None
        """Set when a commit failed half-way (the engine must not serve)."""
        self.lock = asyncio.Lock()
        """Serializes whole updates (`apply_update`)."""
        self._pending: tuple[StagedUpdate, Any] | None = None  # staged update and its LoRARequest (adapters)
        self.last_stages: dict[str, float] = {}
        """Seconds per phase of the last full update (`workers_stage_s`: staging in the workers — decoding,
        mapping or opening the shared buffer; `load_s`: the commit's copy into the served weights), for
        profiling."""
        self.group: str | None = None
        """Token of the collective weight-sync group the workers are in (None: none)."""
        self._received_s = 0.0

    async def receive(self, rendezvous: Rendezvous, rank_offset: int, buckets: BucketLayout) -> None:
        """Collective transport: every worker joins the group (new token) and receives the buckets into its
        staging (`transfer.CollectiveTransferEngine`, vLLM's `update_weights` path); nothing served changes.

        Raises:
            EngineError: the rendezvous or a broadcast failed (the group is dropped; the next sync joins
                anew).
        """
        from vllm.distributed.weight_transfer.base import (
            WeightTransferInitRequest,
            WeightTransferUpdateRequest,
        )

        if self.failure:
            raise EngineError(f"engine cannot be updated: {self.failure}")
        started = time.perf_counter()
        try:
            if self.group != rendezvous.group:
                self.group = None
                init = {
                    "backend": rendezvous.backend,
                    "master_address": rendezvous.master_address,
                    "master_port": rendezvous.master_port,
                    "group": rendezvous.group,
                    "rank_offset": rank_offset,
                    "world_size": rendezvous.world_size,
                    "timeout_s": rendezvous.timeout_s,
                }
                await self._llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init))
                self.group = rendezvous.group
            update = {
                "buckets": [[list(t) for t in b] for b in buckets],
                "timeout_s": rendezvous.timeout_s,
                "staging": rendezvous.staging,
            }
            await self._llm.start_weight_update()
            await self._llm.update_weights(WeightTransferUpdateRequest(update_info=update))
            await self._llm.finish_weight_update()
        except Exception as exc:
            self.group = None
            raise EngineError(
                f"receiving weights over the {rendezvous.backend} group at {rendezvous.master_address}:"
                f"{rendezvous.master_port} failed ({type(exc).__name__}: {exc})"
            ) from exc
        self._received_s = time.perf_counter() - started

    async def prepare(self, update: StagedUpdate) -> None:
        """Phase 1 of an update, while generations go on: nothing served changes.

        Full: every worker decodes the buckets and keeps the tensors (a `SharedUpdate`: views of the
        sender's CUDA buffer). Adapter: the PEFT folder is written and
        loaded into vLLM's LoRA cache (unused until commit).

        Raises:
            LoraDisabledError: adapter update without LoRA (409).
            SyncValidationError: a layer sent in part, an adapter rank above the limit or an adapter vLLM
                rejects (400).
            StaleVersionError: version below the current one (409).
            EngineError: another update is staged, or the workers failed to decode the buckets.
        """
        if self.failure:
            raise EngineError(f"engine cannot be updated: {self.failure}")
        if self._pending is not None:
            raise EngineError(
                f"an update to version {self._pending[0].version} is staged; commit or abort it"
            )
        if update.version < self.version:
            # Equal is allowed: re-applying the current version reloads weights (colocate wake-up after
            # sleep).
            raise StaleVersionError(
                f"update version {update.version} < current weight_version {self.version};"
                f" send a version >= {self.version}"
            )
        if isinstance(update, AdapterUpdate):
            self._pending = (update, await self._load_adapter(update))
            return
        if isinstance(update, ReceivedUpdate | SharedUpdate):
            self._check_whole_layers(set(update.names))
        else:
            await asyncio.to_thread(
                lambda: self._check_whole_layers({n for b in update.buckets for n in safetensors_names(b)})
            )
        started = time.perf_counter()
        try:
            await self._llm.collective_rpc(DISCARD_METHOD)
            if isinstance(update, ReceivedUpdate):
                await self._llm.collective_rpc(STAGE_RECEIVED_METHOD)
            if isinstance(update, SharedUpdate):
                await self._llm.collective_rpc(STAGE_IPC_METHOD, args=(update.handoff,))
            for bucket in getattr(update, "buckets", ()):
                if isinstance(bucket, Path):
                    await self._llm.collective_rpc(STAGE_FILES_METHOD, args=([str(bucket)],))
                else:
                    await self._llm.collective_rpc(STAGE_METHOD, args=([bucket],))
            self.last_stages = {"workers_stage_s": time.perf_counter() - started}
            if isinstance(update, ReceivedUpdate):
                self.last_stages["workers_receive_s"] = self._received_s
        except Exception as exc:
            await self._discard_worker_stage()
            raise EngineError(
                f"staging weight version {update.version} in the vLLM workers failed"
                f" ({type(exc).__name__}: {exc})"
            ) from exc
        self._pending = (update, None)

    async def commit(self) -> None:
        """Phase 2: waits for running batches, swaps the staged update in, resets caches, bumps the version.

        Raises:
            EngineError: nothing staged, or loading failed (health then reports `error`: the workers may
                hold a partial load).
        """
        if self._pending is None:
            raise EngineError("no update is staged; prepare one first")
        update, lora = self._pending
        try:
            async with self.gate.exclusive():
                if lora is None:
                    await self._commit_full(update.version)
                else:
                    assert isinstance(update, AdapterUpdate)
                    previous = self.adapters.serve(update.adapter_name, lora)
                    if previous is not None:
                        await self._llm.remove_lora(previous.lora_int_id)
                        self.adapters.delete(previous)
                    logger.info("adapter version %d served as LoRA id %d", update.version, lora.lora_int_id)
                await self._reset_caches()
                self.version = update.version
        finally:
            self._pending = None

    async def abort(self) -> None:
        """Drops a staged update (no-op when none); the served weights never changed."""
        if self._pending is None:
            return
        _, lora = self._pending
        self._pending = None
        if lora is None:
            await self._discard_worker_stage()
            return
        with contextlib.suppress(Exception):
            await self._llm.remove_lora(lora.lora_int_id)
        self.adapters.delete(lora)

    def _check_whole_layers(self, staged: set[str]) -> None:
        partial = incomplete_load_groups(staged, set(self._specs))
        if partial:
            layer, missing = next(iter(partial.items()))
            raise SyncValidationError(
                f"layer {layer!r} is sent in part (missing {', '.join(missing)}); vLLM reloads whole"
                " layers, so send every tensor of each layer you update"
                f" ({len(partial)} layer(s) incomplete)",
                type="partial_layer",
                detail={"layers": sorted(partial)[:10]},
            )

    async def _commit_full(self, version: int) -> None:
        started = time.perf_counter()
        try:
            commits = await self._llm.collective_rpc(COMMIT_METHOD)
            self.last_stages["load_s"] = time.perf_counter() - started
            # the workers' own copy time: load_s less the RPC; commit_planned 1.0 when every worker replayed
            # its copy plan (rollout_server.engines.vllm.copy_plan), 0.0 when one went through load_weights
            self.last_stages["worker_copy_s"] = max(c["copy_s"] for c in commits)
            self.last_stages["commit_planned"] = float(all(c["via"] == "plan" for c in commits))
        except Exception as exc:
            self.failure = (
                f"weight version {version} failed to load ({type(exc).__name__}); restart the server"
            )
            raise EngineError(
                f"loading weight version {version} into the vLLM workers failed ({type(exc).__name__}: {exc})"
            ) from exc
        self.adapters.clear_default()
        logger.info(
            "vLLM weights version %d applied (%s tensors per worker, via %s)",
            version,
            commits[0]["tensors"],
            ", ".join(sorted({c["via"] for c in commits})),
        )

    async def _discard_worker_stage(self) -> None:
        try:
            await self._llm.collective_rpc(DISCARD_METHOD)
        except Exception:
            logger.warning("could not discard staged weights in the vLLM workers", exc_info=True)

    async def _load_adapter(self, update: AdapterUpdate) -> Any:
        if not self._lora_enabled:
            raise LoraDisabledError(
                "adapter sync refused: the server runs without LoRA; sync full weights or start the server"
                " with server.vllm.enable_lora: true"
            )
        rank = adapter_rank(update.adapter_config)
        if rank is not None and rank > self._max_lora_rank:
            raise SyncValidationError(
                f"adapter {update.adapter_name!r} has rank {rank} > server.vllm.max_lora_rank"
                f" {self._max_lora_rank}; raise max_lora_rank or train a smaller adapter",
                type="adapter_rank_too_large",
            )
        lora = await asyncio.to_thread(self.adapters.write, update)
        try:
            await self._llm.add_lora(lora)
        except Exception as exc:
            self.adapters.delete(lora)
            raise SyncValidationError(
                f"vLLM rejected adapter {update.adapter_name!r} ({type(exc).__name__}: {exc}); send a PEFT"
                " LoRA whose target modules exist in the served model",
                type="adapter_invalid",
            ) from exc
        return lora

    async def _reset_caches(self) -> None:
        # No request is running (the gate is held), so the reset cannot be refused for running requests.
        if not await self._llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset the prefix cache after a weight update")
        await self._llm.reset_encoder_cache()
