"""`WeightUpdater` against a recording stand-in for `AsyncLLM` (the real engine is covered by the integration
tests): what reaches the workers when, and what is refused before anything is staged."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save

from rollout_server.engines.base import AdapterUpdate, FullUpdate
from rollout_server.engines.vllm.updates import WeightUpdater
from rollout_server.engines.vllm.worker import COMMIT_METHOD, DISCARD_METHOD, STAGE_METHOD
from rollout_server.errors import EngineError, LoraDisabledError, StaleVersionError, SyncValidationError

SPECS = {
    "model.layers.0.self_attn.q_proj.weight": ("F32", (2, 2)),
    "model.layers.0.self_attn.k_proj.weight": ("F32", (2, 2)),
    "model.layers.0.self_attn.v_proj.weight": ("F32", (2, 2)),
    "model.norm.weight": ("F32", (2,)),
}


class RecordingLlm:
    """Records engine calls; `fail` names a method that raises."""

    def __init__(self, fail: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.fail = fail

    async def collective_rpc(self, method: str, args: tuple = ()) -> list[Any]:
        self.calls.append((method, len(args[0]) if args else None))
        if method == self.fail:
            raise RuntimeError(f"{method} failed")
        if method == COMMIT_METHOD:  # the worker's report (`WeightLoadExtension.rollmatch_commit_weights`)
            return [{"tensors": 1, "via": "plan", "copy_s": 0.001}]
        return [1]

    async def add_lora(self, lora: Any) -> bool:
        self.calls.append(("add_lora", lora.lora_int_id))
        if self.fail == "add_lora":
            raise ValueError("bad adapter")
        return True

    async def remove_lora(self, lora_id: int) -> bool:
        self.calls.append(("remove_lora", lora_id))
        return True

    async def reset_prefix_cache(self) -> bool:
        self.calls.append(("reset_prefix_cache", None))
        return True

    async def reset_encoder_cache(self) -> None:
        self.calls.append(("reset_encoder_cache", None))


def _bucket(*names: str) -> bytes:
    return save({n: np.zeros(SPECS[n][1], np.float32) for n in names})


def _full(version: int, *buckets: bytes) -> FullUpdate:
    return FullUpdate(version=version, buckets=buckets or (_bucket(*SPECS),))


def _adapter(version: int, name: str = "pol", r: int = 4) -> AdapterUpdate:
    return AdapterUpdate(
        version=version, adapter_name=name, adapter_config={"r": r}, adapter_safetensors=b"x"
    )


def _updater(llm: RecordingLlm, lora: bool = False) -> WeightUpdater:
    return WeightUpdater(llm, SPECS, lora_enabled=lora, max_lora_rank=8)


def test_full_update_stages_per_bucket_then_commits_and_resets_caches() -> None:
    llm = RecordingLlm()
    updater = _updater(llm)
    update = _full(3, _bucket("model.norm.weight"), _bucket(*list(SPECS)[:3]))

    async def run() -> None:
        await updater.prepare(update)
        assert updater.version == 0  # nothing served changed yet
        await updater.commit()

    asyncio.run(run())
    assert updater.last_stages["commit_planned"] == 1.0 and updater.last_stages["worker_copy_s"] == 0.001
    assert [c[0] for c in llm.calls] == [
        DISCARD_METHOD,
        STAGE_METHOD,
        STAGE_METHOD,
        COMMIT_METHOD,
        "reset_prefix_cache",
        "reset_encoder_cache",
    ]
    assert updater.version == 3


def test_partial_layer_and_stale_version_are_refused_before_staging() -> None:
    llm = RecordingLlm()
    updater = _updater(llm)
    with pytest.raises(SyncValidationError, match="qkv_proj") as err:
        asyncio.run(updater.prepare(_full(1, _bucket("model.layers.0.self_attn.q_proj.weight"))))
    assert err.value.type == "partial_layer"
    updater.version = 5
    with pytest.raises(StaleVersionError):
        asyncio.run(updater.prepare(_full(4)))
    assert llm.calls == []


def test_failed_staging_discards_and_failed_commit_marks_the_engine_failed() -> None:
    llm = RecordingLlm(fail=STAGE_METHOD)
    with pytest.raises(EngineError, match="staging"):
        asyncio.run(_updater(llm).prepare(_full(1)))
    assert llm.calls[-1][0] == DISCARD_METHOD
    llm = RecordingLlm(fail=COMMIT_METHOD)
    updater = _updater(llm)

    async def run() -> None:
        await updater.prepare(_full(1))
        await updater.commit()

    with pytest.raises(EngineError, match="failed"):
        asyncio.run(run())
    assert updater.version == 0 and updater.failure is not None
    with pytest.raises(EngineError, match="cannot be updated"):
        asyncio.run(updater.prepare(_full(2)))


def test_adapter_updates() -> None:
    with pytest.raises(LoraDisabledError):
        asyncio.run(_updater(RecordingLlm()).prepare(_adapter(1)))
    with pytest.raises(SyncValidationError, match="rank 16"):
        asyncio.run(_updater(RecordingLlm(), lora=True).prepare(_adapter(1, r=16)))
    with pytest.raises(SyncValidationError, match="rejected"):
        asyncio.run(_updater(RecordingLlm(fail="add_lora"), lora=True).prepare(_adapter(1)))

    llm = RecordingLlm()
    updater = _updater(llm, lora=True)

    async def run() -> None:
        for version in (1, 2):
            await updater.prepare(_adapter(version))
            await updater.commit()
        first = updater.adapters.resolve(None)
        assert first is not None and first.lora_name == "pol-v2"
        await updater.prepare(_full(3))
        await updater.commit()

    asyncio.run(run())
    assert ("remove_lora", 1) in llm.calls  # the replaced adapter left vLLM
    assert updater.adapters.resolve(None) is None and updater.adapters.names == ("pol",)
    assert updater.version == 3


def test_abort_drops_the_staged_update() -> None:
    llm = RecordingLlm()
    updater = _updater(llm, lora=True)

    async def run() -> None:
        await updater.prepare(_adapter(1))
        await updater.abort()
        await updater.prepare(_full(1))
        await updater.abort()
        with pytest.raises(EngineError, match="no update is staged"):
            await updater.commit()

    asyncio.run(run())
    assert ("remove_lora", 1) in llm.calls and llm.calls[-1][0] == DISCARD_METHOD
    assert updater.version == 0
