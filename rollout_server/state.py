"""The one typed object a server app keeps: config, engine (if loaded), load error, sync staging, metrics."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollout_server.config import ServerConfig
from rollout_server.engines.base import CollectiveEngine, Engine
from rollout_server.errors import EngineError, EngineNotReadyError
from rollout_server.health_listener import HealthListener
from rollout_server.metrics import ServerMetrics
from rollout_server.weights.staging import SyncStaging
from shared_schemas.health import Health
from shared_schemas.torch_common.gpu_ids import gpu_uuids

logger = logging.getLogger(__name__)

__all__ = ["EngineBuilder", "ServerState"]

EngineBuilder = Callable[[ServerConfig], Awaitable[Engine]]


class ServerState:
    """Per-app state (never module-global, so `create_app` can run many times in one process).

    Args:
        cfg: the server config.
        engine: a ready engine (tests), or None to load one in the background.
    """

    def __init__(self, cfg: ServerConfig, engine: Engine | None = None) -> None:
        self.cfg = cfg
        self.started = time.monotonic()
        self.engine = engine
        self.load_error: str | None = None
        self.metrics = ServerMetrics()
        self.staging = SyncStaging(
            Path(cfg.shm_dir).expanduser() if cfg.shm_dir else None,
            default_timeout_s=cfg.sync_timeout_s,
            on_finish=self.metrics.sync_finished,
            collective_staging=cfg.sync_staging,
        )
        self._gpu_uuids: list[str] | None = None

    @property
    def uptime_s(self) -> float:
        """Seconds since the app was created."""
        return time.monotonic() - self.started

    async def health(self) -> Health:
        """The `/health` body: the engine's own view when loaded, else the config's with `loading`/`error`."""
        cfg = self.cfg
        if self.engine is None:
            return Health(
                status="error" if self.load_error else "loading",
                engine=cfg.backend,
                model=str(cfg.model_path),
                weight_version=0,
                dp=cfg.vllm.data_parallel_size if cfg.backend == "vllm" else 1,
                tp=cfg.vllm.tensor_parallel_size if cfg.backend == "vllm" else 1,
                lora_enabled=cfg.vllm.enable_lora if cfg.backend == "vllm" else False,
                max_model_len=cfg.vllm.max_model_len,
                dtype=cfg.served_dtype,
                uptime_s=self.uptime_s,
                detail=self.load_error,
            )
        engine_health = await self.engine.health()
        return Health(
            status=engine_health.status,
            engine=engine_health.engine,
            model=engine_health.model,
            weight_version=engine_health.weight_version,
            dp=engine_health.dp,
            tp=engine_health.tp,
            lora_enabled=engine_health.lora_enabled,
            max_model_len=engine_health.max_model_len,
            dtype=cfg.served_dtype,
            uptime_s=self.uptime_s,
            detail=engine_health.detail,
            collective_ranks=_collective_ranks(self.engine),
            gpu_uuids=self._engine_gpus(engine_health.dp * engine_health.tp),
        )

    def _engine_gpus(self, count: int) -> list[str]:
        """UUIDs of the first `count` visible CUDA devices (the engine's: dp x tp workers, one device each),
        read once, after the engine started (its processes are spawned before this process touches CUDA)."""
        if self._gpu_uuids is None:
            self._gpu_uuids = gpu_uuids(range(count))
        return self._gpu_uuids

    async def publish_health_forever(self, listener: HealthListener, interval_s: float = 0.2) -> None:
        """Keeps the probe listener's snapshot fresh (a failed refresh keeps the last one and logs)."""
        while True:
            try:
                health = await self.health()
                listener.publish(health.model_dump(mode="json"), self.staging.applying)
            except Exception:
                logger.exception("health snapshot failed; the probe listener keeps the previous one")
            await asyncio.sleep(interval_s)

    def require_engine(self) -> Engine:
        """The engine, or 503 while loading / after a failed load."""
        if self.engine is not None:
            return self.engine
        if self.load_error is not None:
            raise EngineNotReadyError(
                f"engine failed to load: {self.load_error}; fix the server config and restart the server",
                type="engine_failed",
            )
        raise EngineNotReadyError(
            "engine is loading; poll /health until it answers 200", type="engine_loading"
        )

    async def load_engine(
        self, build: EngineBuilder, on_failure: Callable[[BaseException], None] | None
    ) -> None:
        """Builds the engine; on failure records the reason (health says `error`) and calls `on_failure`."""
        started = time.perf_counter()
        try:
            self.engine = await build(self.cfg)
        except asyncio.CancelledError:
            logger.warning("engine load cancelled (server shutting down)")
            raise
        except Exception as exc:
            self.load_error = f"{type(exc).__name__}: {exc}"
            logger.exception("engine failed to load")
            if on_failure is not None:
                on_failure(exc)
            return
        logger.info("engine ready in %.1f s", time.perf_counter() - started)

    async def sweep_forever(self, interval_s: float) -> None:
        """Discards timed-out staged syncs so their buckets do not stay in memory."""
        while True:
            await asyncio.sleep(interval_s)
            self.staging.sweep()

    async def close(self) -> None:
        """Closes the engine and removes the sync staging files (idempotent)."""
        self.staging.close()
        engine, self.engine = self.engine, None
        if engine is not None:
            await engine.aclose()
            logger.info("engine closed")


def _collective_ranks(engine: Engine) -> int | None:
    """Receivers the engine brings into a collective weight-sync group (None: it cannot receive over one)."""
    try:
        if not isinstance(engine, CollectiveEngine):
            return None
        ranks = engine.collective_ranks
    except EngineError:
        return None  # e.g. an engine group whose members cannot receive
    return ranks if ranks >= 1 else None
