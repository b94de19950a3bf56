"""The one typed object a server app keeps: config, engine (once loaded), load error, sync staging."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

from rollout_server.config import ServerConfig
from rollout_server.engines.base import Engine
from rollout_server.errors import EngineNotReadyError
from rollout_server.weights.staging import SyncStaging

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
        self.staging = SyncStaging(
            Path(cfg.shm_dir).expanduser() if cfg.shm_dir else None, default_timeout_s=cfg.sync_timeout_s
        )

    @property
    def uptime_s(self) -> float:
        """Seconds since the app was created."""
        return time.monotonic() - self.started

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
