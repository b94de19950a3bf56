"""A fake `Engine` for route and error-mapping tests (never used in integration tests)."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping
from pathlib import Path

from rollout_server.engines.base import (
    AdapterUpdate,
    EngineHealth,
    FullUpdate,
    ParamSpec,
    StagedUpdate,
    check_adapter_request,
    check_prompt_lengths,
)
from rollout_server.errors import LoraDisabledError
from shared_schemas.buckets import decode_bucket
from shared_schemas.infer import Choice, InferBatch, InferRequest, InferResult, resolve_seeds

SPECS: dict[str, ParamSpec] = {
    "model.w": ("F32", (2, 3)),
    "model.b": ("BF16", (4,)),
    "lm_head.weight": ("F32", (3,)),
}


def fake_prompt_ids(request: InferRequest) -> list[int]:
    """One id per whitespace-separated word of string contents (enough for the length check)."""
    if request.prompt_token_ids is not None:
        return list(request.prompt_token_ids)
    words = [w for m in request.messages or [] if isinstance(m["content"], str) for w in m["content"].split()]
    return [len(w) for w in words] or [0]


class FakeEngine:
    """Records calls; answers each request with its seed as the only token."""

    def __init__(self, *, lora: bool = False, max_model_len: int = 64, fail: bool = False) -> None:
        self._lora = lora
        self.max_model_len = max_model_len
        self.fail = fail
        self.version = 0
        self.calls: list[InferBatch] = []
        self.applied: list[StagedUpdate] = []
        self.adapters: dict[str, dict] = {}
        self.weights: dict[str, bytes] = {}
        self.closed = False
        self.gate: asyncio.Event | None = None
        self.fail_apply = False

    @property
    def lora_enabled(self) -> bool:
        return self._lora

    @property
    def weight_version(self) -> int:
        return self.version

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        return SPECS

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        self.calls.append(batch)
        if self.gate is not None:
            await self.gate.wait()
        if self.fail:
            raise RuntimeError("simulated engine crash")
        cfg = batch.request_config
        check_adapter_request(cfg.adapter, self._lora, list(self.adapters))
        prompts = [fake_prompt_ids(r) for r in batch.infer_requests]
        check_prompt_lengths([len(p) for p in prompts], cfg.max_tokens, self.max_model_len, batch.first_index)
        seeds = resolve_seeds(batch)
        return [
            InferResult(
                index=batch.first_index + i,
                request_id=r.request_id,
                prompt_token_ids=prompts[i],
                choices=[Choice(token_ids=[seeds[i]], text=str(seeds[i]), finish_reason="length")] * cfg.n,
                weight_version=self.version,
            )
            for i, r in enumerate(batch.infer_requests)
        ]

    async def apply_update(self, update: StagedUpdate) -> None:
        if self.fail_apply:
            raise RuntimeError("simulated apply failure")
        if isinstance(update, AdapterUpdate):
            if not self._lora:
                raise LoraDisabledError("no LoRA")
            decode_bucket(update.adapter_safetensors)
            self.adapters[update.adapter_name] = update.adapter_config
        else:
            assert isinstance(update, FullUpdate)
            blobs = [b.read_bytes() if isinstance(b, Path) else b for b in update.buckets]
            staged = {t.name: bytes(t.data) for b in blobs for t in decode_bucket(b)}
            self.weights.update(staged)
        self.applied.append(update)
        self.version = update.version

    async def health(self) -> EngineHealth:
        return EngineHealth(
            status="ok",
            engine="vllm",
            model="/models/fake",
            weight_version=self.version,
            dp=1,
            tp=1,
            lora_enabled=self._lora,
            max_model_len=self.max_model_len,
        )

    async def aclose(self) -> None:
        self.closed = True
