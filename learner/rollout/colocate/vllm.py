"""The `vllm` colocated backend: the rollout server's `VllmEngine`, built and driven inside the learner.

The one learner → server import allowed (docs/ARCHITECTURE.md#the-two-services):
`rollout_server.engines.vllm.engine.VllmEngine` (with its update dataclasses and errors) is imported
lazily, when a colocated vLLM engine is actually built, so a learner in server mode never loads vLLM or the
server package.

Threading: `AsyncLLM` binds to the event loop it first runs on, so every engine call goes through ONE
long-lived loop thread (`LoopThread`), never `asyncio.run` per call. Learner threads submit coroutines and
wait for their result.

Weights: a sync hands the tensors to the engine in-process — checked against its parameter table, cast to
the engine's served dtype and handed over by `rollout.vllm.weight_handoff` (resolved once at start,
`weights.resolve_weight_handoff`): `ipc` casts on the GPU into one buffer whose CUDA IPC handle the engine's
worker opens (`ipc`), `bytes` casts on the host into in-memory safetensors buckets (`weights`); either is
applied with the engine's `apply_update` (stage, then commit under the gate: all or nothing, prefix cache
reset). No HTTP, no files. `last_stages` holds each sync's `cast_s`, `handoff_s` (staging in the worker) and
`commit_s` (the copy into the served weights). An adapter sync becomes the engine's
`AdapterUpdate`; the colocated engine runs without LoRA, so it is refused (`SyncRejected`) and the policy's
`fallback_to_full` takes over.

Sleep (`rollout.vllm.sleep_level > 0`, GPU only): the engine sleeps after each rollout and wakes in the order
weights → sync → KV cache → generate. Level 2 discards the weights while asleep; when a rollout comes without
a sync since the last sleep (e.g. a second evaluation in the same step), the current weights are re-read
from the training model. On platforms without vLLM sleep mode (CPU) construction fails with a `ConfigError`
naming `rollout.vllm.sleep_level`.

Tensor parallelism (`tensor_parallel_size > 1`): see `learner.rollout.colocate.tp`.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Coroutine
from typing import TYPE_CHECKING, Any, Literal, TypeVar

from torch import nn

from learner.rollout.colocate.backend import EngineStartError, EngineStatus
from learner.rollout.colocate.ipc import pack_full_update
from learner.rollout.colocate.loop_thread import LoopThread
from learner.rollout.colocate.tp import TpGroup, TpLayout, current_cuda_device, engine_device_env, tp_layout
from learner.rollout.colocate.weights import (
    Handoff,
    encode_full_update,
    encode_tensors,
    resolve_weight_handoff,
)
from learner.weights.types import SyncError, SyncRejected, WeightUpdate
from learner.yaml_loader import ConfigError
from shared_schemas.infer import InferBatch, InferResult
from shared_schemas.server_config import ServerConfig, VllmServerConfig

if TYPE_CHECKING:
    from learner.config import RunConfig

logger = logging.getLogger(__name__)

__all__ = ["VllmColocateBackend", "server_config_for"]

T = TypeVar("T")


def server_config_for(cfg: RunConfig) -> Any:
    """The `ServerConfig` the colocated `VllmEngine` is built from (`rollout.vllm` + `model.path`).

    `load_format`, `sleep_level` (→ `enable_sleep_mode`) travel as `engine_kwargs`; LoRA is off. A Qwen-VL
    checkpoint gets `data.max_images_per_sample` images and no video per prompt (vLLM would otherwise profile
    a dummy video), and the learner processor's pixel bounds (`model.image_min_pixels` / `image_max_pixels`),
    so engine and learner expand images to the same token counts.
    """
    from learner.config import resolve_path
    from learner.policy import is_vl_checkpoint
    from shared_schemas.vlm_shim import ensure_vl_imports

    v = cfg.rollout.vllm
    is_vl = is_vl_checkpoint(resolve_path(cfg.model.path))
    if is_vl and v.load_format == "dummy":
        raise ConfigError(
            "rollout.vllm.load_format: dummy with a Qwen-VL checkpoint: vLLM's vision tower keeps state that"
            " is not in the checkpoint (Qwen3-VL's visual.input_norm), which dummy init randomizes and no"
            " weight sync restores; remove the key (default auto for VL models) or set it to auto"
        )
    extra: dict[str, Any] = {"load_format": v.load_format or ("auto" if is_vl else "dummy")}
    if v.sleep_level > 0:
        extra["enable_sleep_mode"] = True
    assert v.max_model_len is not None  # RunConfig requires it for a colocated vLLM engine
    mm: dict[str, Any] = {}
    if is_vl:
        ensure_vl_imports()  # the engine's processes inherit the shim path where torchvision is missing
        mm["limit_mm_per_prompt"] = {"image": max(1, cfg.data.max_images_per_sample), "video": 0}
        pixels = {"min_pixels": cfg.model.image_min_pixels, "max_pixels": cfg.model.image_max_pixels}
        if any(value is not None for value in pixels.values()):
            mm["mm_processor_kwargs"] = {k: value for k, value in pixels.items() if value is not None}
    return ServerConfig(
        model=cfg.model.path,  # relative paths resolve against the repository root, as the learner's do
        backend="vllm",
        dtype=v.dtype,
        seed=cfg.training_view.seed,
        vllm=VllmServerConfig(
            tensor_parallel_size=v.tensor_parallel_size,
            gpu_memory_utilization=v.gpu_memory_utilization,
            max_model_len=v.max_model_len,
            enable_prefix_caching=v.enable_prefix_caching,
            enforce_eager=v.enforce_eager,
            enable_lora=False,
            engine_kwargs=extra,
            **mm,
        ),
    )


class VllmColocateBackend:
    """`VllmEngine` in-process (see the module docstring).

    Args:
        engine: a started `VllmEngine` (None on TP-group members other than the leader).
        loop: the loop thread the engine was built on (None without an engine).
        layout: this rank's TP layout.
        group: the TP group's collectives (None when `tp == 1`).
        model: the training model (re-read after a level-2 sleep without a fresh sync).
        sleep_level: 0 (never sleep), 1 or 2.
        infer_timeout_s: bound of one generate call (`rollout.infer_timeout_s`).
        infer_batch_size: requests per engine call (`rollout.vllm.infer_batch_size`); None = all at once.
        model_name: what `status()` reports as the model.
        max_model_len: the engine's limit (`status()` on non-leaders).
        handoff: how full syncs reach the engine (`weights.resolve_weight_handoff`).
    """

    def __init__(
        self,
        engine: Any,
        loop: LoopThread | None,
        *,
        layout: TpLayout,
        group: TpGroup | None = None,
        model: nn.Module | None = None,
        sleep_level: int = 0,
        infer_timeout_s: float | None = None,
        infer_batch_size: int | None = None,
        model_name: str = "",
        max_model_len: int = 0,
        handoff: Handoff = "bytes",
    ) -> None:
        if (engine is None) == layout.is_leader:
            raise ValueError("exactly the TP-group leader holds the engine")
        self._engine = engine
        self._loop = loop
        self._layout = layout
        self._group = group
        self._model = model
        self._sleep_level = sleep_level
        self._timeout = infer_timeout_s
        self._infer_batch_size = infer_batch_size
        self._model_name = model_name
        self._max_model_len = max_model_len
        self.handoff = handoff
        """`ipc` or `bytes` (see the module docstring)."""
        self.last_stages: dict[str, float] = {}
        """Seconds per phase of the last full sync: `cast_s` (check, cast and pack or encode), `wake_s`,
        `handoff_s` (staging in the engine's workers), `commit_s` (copy into the served weights), `apply_s`
        (the engine's whole `apply_update`: handoff, commit, cache reset)."""
        self._version = 0
        self._asleep = False
        self._weights_awake = True
        self._synced_since_sleep = True
        self._closed = False
        self.engine_calls = 0
        """`generate` calls made on the engine (tests)."""

    @classmethod
    def from_config(cls, cfg: RunConfig, *, model: nn.Module | None = None) -> VllmColocateBackend:
        """Builds the engine for `cfg.rollout.vllm` (the leader of each TP group builds one).

        Raises:
            ConfigError: `tensor_parallel_size` does not divide the world size, `sleep_level > 0` where
                vLLM has no sleep mode, or `weight_handoff: ipc` where it cannot run.
            EngineStartError: vLLM failed to start (suggests `rollout.backend: hf`).
        """
        v = cfg.rollout.vllm
        world_size, rank = _world()
        layout = tp_layout(world_size, v.tensor_parallel_size, rank)
        if v.sleep_level > 0:
            _check_sleep_mode(v.sleep_level)
        handoff = resolve_weight_handoff(
            v.weight_handoff, cuda_device=current_cuda_device(), tensor_parallel_size=v.tensor_parallel_size
        )
        group = TpGroup(layout) if layout.tp > 1 else None
        # Each engine's workers go on its group's devices (tp 1: this rank's own device).
        env = group.device_env() if group is not None else engine_device_env([current_cuda_device()])
        if v.kv_cache_space_gb is not None:
            env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, math.ceil(v.kv_cache_space_gb)))
        server_cfg = server_config_for(cfg)
        kwargs: dict[str, Any] = {
            "layout": layout,
            "group": group,
            "model": model,
            "sleep_level": v.sleep_level,
            "infer_timeout_s": cfg.rollout.read_timeout_s,
            "infer_batch_size": v.infer_batch_size,
            "model_name": str(server_cfg.model_path),
            "max_model_len": v.max_model_len or 0,
            "handoff": handoff,
        }
        if not layout.is_leader:
            return cls(None, None, **kwargs)
        loop = LoopThread()
        try:
            from rollout_server.engines.vllm.engine import VllmEngine

            engine = loop.run(VllmEngine.from_config(server_cfg, env=env))
        except Exception as exc:
            loop.close()
            raise EngineStartError(
                f"could not start the colocated vLLM engine for {server_cfg.model_path}"
                f" ({type(exc).__name__}: {exc}); check rollout.vllm.* (gpu_memory_utilization"
                f" {v.gpu_memory_utilization}, max_model_len {v.max_model_len}) or set rollout.backend: hf to"
                " generate with the training model instead"
            ) from exc
        backend = cls(engine, loop, **kwargs)
        logger.info(
            "colocated vLLM engine ready: %s (tp %d, gpu_memory_utilization %.2f, sleep_level %d, weight"
            " handoff %s)",
            server_cfg.model_path,
            layout.tp,
            v.gpu_memory_utilization,
            v.sleep_level,
            handoff,
        )
        if v.sleep_level > 0:
            backend._sleep()  # the first sync wakes it; nothing is generated before
        return backend

    @property
    def name(self) -> Literal["vllm"]:
        """Always `vllm`."""
        return "vllm"

    @property
    def sends_weights(self) -> bool:
        """Only the TP-group leader holds an engine."""
        return self._layout.is_leader

    # -- generation -----------------------------------------------------------------------------------------
    def generate(self, batch: InferBatch) -> list[InferResult]:
        """Generates `batch` (TP > 1: the whole group's batches on the leader, each rank keeps its own)."""
        if self._group is None:
            return self._generate_all([batch])[0]
        batches = self._group.gather(batch.model_dump(mode="json"))
        dumped = None
        if self._layout.is_leader:
            results = self._generate_all([InferBatch.model_validate(b) for b in batches])
            dumped = [[r.model_dump(mode="json") for r in rs] for rs in results]
        everything = self._group.broadcast(dumped)
        return [InferResult.model_validate(r) for r in everything[self._layout.group_rank]]

    def _generate_all(self, batches: list[InferBatch]) -> list[list[InferResult]]:
        """Leader only: wakes the engine, runs every batch (chunked by `infer_batch_size`), sleeps again."""
        if self._closed:
            raise RuntimeError("the colocated vLLM engine is closed")
        chunks = [self._chunks(b) for b in batches]
        if not any(chunks):
            return [[] for _ in batches]
        self._wake_for_generation()
        try:
            out: list[list[InferResult]] = []
            for parts in chunks:
                results: list[InferResult] = []
                for part in parts:
                    results += self._call(self._engine.generate(part), self._timeout, what=_what(part))
                    self.engine_calls += 1
                out.append(results)
            return out
        finally:
            if self._sleep_level > 0:
                self._sleep()

    def _chunks(self, batch: InferBatch) -> list[InferBatch]:
        n = len(batch.infer_requests)
        if n == 0:
            return []
        size = self._infer_batch_size or n
        return [batch.slice(start, min(start + size, n)) for start in range(0, n, size)]

    # -- weights --------------------------------------------------------------------------------------------
    def apply(self, update: WeightUpdate) -> int:
        """Applies a full update (checked, cast, handed off: `handoff`) or an adapter update, all or nothing.

        Raises:
            SyncRejected: an adapter update (the colocated engine runs without LoRA).
            SyncError: a tensor the engine does not serve, or the engine failed to load the weights.
        """
        if not self._layout.is_leader:
            self._version = update.version
            return 0
        from rollout_server.engines.base import AdapterUpdate
        from rollout_server.errors import LoraDisabledError, RolloutServerError

        started = time.perf_counter()
        packed = None  # the ipc buffer: alive until apply_update returned (the worker reads it until then)
        if update.mode == "adapter":
            state = {n: t.detach().to("cpu").contiguous() for n, t in update.iter_tensors()}
            nbytes = sum(t.numel() * t.element_size() for t in state.values())
            staged: Any = AdapterUpdate(
                version=update.version,
                adapter_name=update.adapter_name or "adapter",
                adapter_config=update.adapter_config or {},
                adapter_safetensors=encode_tensors(state),
            )
        else:
            staged, packed, nbytes = self._full_update(update.iter_tensors(), update.version)
        cast_s = time.perf_counter() - started
        try:
            self._timed_apply(staged, cast_s, what=f"weight sync v{update.version}")
        except LoraDisabledError as exc:
            raise SyncRejected(
                f"colocated vLLM engine refused adapter sync v{update.version}: {exc}"
            ) from exc
        except RolloutServerError as exc:
            raise SyncError(f"colocated vLLM engine failed weight sync v{update.version}: {exc}") from exc
        finally:
            del packed
        self._version = update.version
        self._synced_since_sleep = True
        return nbytes

    def _full_update(self, items: Any, version: int) -> tuple[Any, Any, int]:
        """`(staged update, buffer to keep alive or None, tensor bytes)` of a full sync, by `handoff`."""
        import torch

        from rollout_server.engines.base import FullUpdate, SharedUpdate

        specs = dict(self._engine.parameter_specs())
        if self.handoff == "ipc":
            packed = pack_full_update(items, specs, torch.device("cuda", torch.cuda.current_device()))
            return SharedUpdate(version=version, handoff=packed.handoff), packed, packed.nbytes
        buckets, nbytes = encode_full_update(items, specs)
        return FullUpdate(version=version, buckets=tuple(buckets)), None, nbytes

    def _timed_apply(self, staged: Any, cast_s: float, *, what: str) -> None:
        """Wakes the weights, applies `staged` and records `last_stages`."""
        started = time.perf_counter()
        self._wake(["weights"])
        woken = time.perf_counter()
        self._call(self._engine.apply_update(staged), None, what=what)
        done = time.perf_counter()
        engine = dict(getattr(self._engine, "last_update_stages", {}) or {})
        self.last_stages = {
            "cast_s": cast_s,
            "wake_s": woken - started,
            "apply_s": done - woken,
        }
        if staged.mode == "full":
            self.last_stages["handoff_s"] = engine.get("workers_stage_s", 0.0)
            self.last_stages["commit_s"] = engine.get("load_s", 0.0)
            for key in ("worker_copy_s", "commit_planned"):  # the worker's copy alone; 1.0: via its copy plan
                if key in engine:
                    self.last_stages[key] = engine[key]

    def _reload_from_model(self) -> None:
        """Level-2 sleep discarded the weights and no sync came: re-send the training model's weights."""
        from learner.weights.export import full_state_items, merged_adapters

        if self._model is None:
            raise SyncError(
                "rollout.vllm.sleep_level 2 discarded the engine's weights and no sync preceded this rollout;"
                " pass the training model to ColocateRolloutSource.from_config or use sleep_level 1"
            )
        started = time.perf_counter()
        with merged_adapters(self._model):
            staged, packed, _ = self._full_update(full_state_items(self._model), self._version)
            self._timed_apply(staged, time.perf_counter() - started, what="weight reload after sleep")
        del packed
        self._synced_since_sleep = True

    # -- sleep ----------------------------------------------------------------------------------------------
    def _sleep(self) -> None:
        self._call(self._engine._llm.sleep(level=self._sleep_level), None, what="sleep")
        self._asleep, self._weights_awake, self._synced_since_sleep = True, False, False

    def _wake(self, tags: list[str]) -> None:
        if not self._asleep:
            return
        if "weights" in tags and self._weights_awake:
            return
        self._call(self._engine._llm.wake_up(tags), None, what=f"wake_up {tags}")
        if "weights" in tags:
            self._weights_awake = True
        if "kv_cache" in tags:
            self._asleep = False

    def _wake_for_generation(self) -> None:
        if not self._asleep:
            return
        self._wake(["weights"])
        if self._sleep_level >= 2 and not self._synced_since_sleep:
            self._reload_from_model()
        self._wake(["kv_cache"])

    # -- status and lifecycle -------------------------------------------------------------------------------
    def status(self) -> EngineStatus:
        """The engine's health (leader), or the recorded state (other members of a TP group)."""
        if not self._layout.is_leader or self._closed:
            return EngineStatus(
                ok=not self._closed,
                engine="vllm",
                model=self._model_name,
                weight_version=self._version,
                tp=self._layout.tp,
                lora_enabled=False,
                max_model_len=self._max_model_len,
                detail="engine closed" if self._closed else None,
            )
        h = self._call(self._engine.health(), 30.0, what="health")
        return EngineStatus(
            ok=h.status == "ok",
            engine="vllm",
            model=h.model,
            weight_version=h.weight_version,
            tp=h.tp,
            lora_enabled=h.lora_enabled,
            max_model_len=h.max_model_len,
            detail=h.detail,
        )

    def close(self) -> None:
        """Shuts the engine down and stops the loop thread; idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._engine is not None and self._loop is not None:
            try:
                self._loop.run(self._engine.aclose(), 120.0)
            finally:
                self._loop.close()

    def _call(self, coro: Coroutine[Any, Any, T], timeout_s: float | None, *, what: str) -> T:
        assert self._loop is not None
        try:
            return self._loop.run(coro, timeout_s)
        except TimeoutError as exc:
            raise TimeoutError(
                f"colocated vLLM engine: {what} did not finish within {timeout_s} s (rollout.infer_timeout_s)"
            ) from exc
        except Exception as exc:
            from rollout_server.errors import PromptTooLongError

            if isinstance(exc, PromptTooLongError):
                raise ValueError(
                    f"colocated vLLM engine: {exc.message.replace('server.vllm.', 'rollout.vllm.')}"
                ) from exc
            raise


def _what(batch: InferBatch) -> str:
    n = len(batch.infer_requests)
    return f"generate of requests {batch.first_index}..{batch.first_index + n - 1}"


def _world() -> tuple[int, int]:
    """(world size, rank) of the learner: from torch.distributed when initialized, else one process."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


def _check_sleep_mode(level: int) -> None:
    from vllm.platforms import current_platform

    if not current_platform.is_sleep_mode_available():
        raise ConfigError(
            f"rollout.vllm.sleep_level {level} needs vLLM sleep mode, which this platform"
            f" ({current_platform.device_name}) does not support; set rollout.vllm.sleep_level: 0"
        )
