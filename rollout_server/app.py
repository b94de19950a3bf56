"""The FastAPI app factory of the rollout server (docs/ARCHITECTURE.md#the-contract)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import Depends, FastAPI
from prometheus_fastapi_instrumentator import Instrumentator

from rollout_server.config import ServerConfig
from rollout_server.deps import require_bearer
from rollout_server.engines.base import Engine
from rollout_server.engines.factory import build_engine
from rollout_server.errors import install_exception_handlers
from rollout_server.health_listener import HealthListener
from rollout_server.middleware import BodySizeLimitMiddleware
from rollout_server.routes import health, infer, metrics, sync
from rollout_server.state import EngineBuilder, ServerState

logger = logging.getLogger(__name__)

__all__ = ["create_app"]


def create_app(
    cfg: ServerConfig,
    engine: Engine | None = None,
    *,
    engine_builder: EngineBuilder | None = None,
    on_load_failure: Callable[[BaseException], None] | None = None,
    health_listener: HealthListener | None = None,
) -> FastAPI:
    """Builds a rollout-server app; no globals, so it can be called many times in one process.

    Args:
        cfg: the server config.
        engine: a ready engine (tests); when None the lifespan builds one in the background and `/health`
            answers `loading` (503) until it is ready.
        engine_builder: how to build the engine (default: `build_engine`, per `cfg.backend`).
        on_load_failure: called when building the engine fails (`__main__` uses it to exit).
        health_listener: the probe listener (`server.health_port`), whose snapshot the lifespan keeps fresh.

    Returns:
        The app; the lifespan closes the engine on shutdown.
    """
    state = ServerState(cfg, engine)
    build = engine_builder or build_engine

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if cfg.unauthenticated_exposure:
            logger.warning(
                "UNAUTHENTICATED: serving %s:%d to other hosts without server.auth_token"
                " (server.allow_unauthenticated: true); anyone who reaches this port can generate and"
                " REPLACE THE SERVED WEIGHTS through /sync_weights/. Set server.auth_token unless this"
                " network is trusted.",
                cfg.host,
                cfg.port,
            )
        if cfg.shm_dir:
            Path(cfg.shm_dir).expanduser().mkdir(parents=True, exist_ok=True)
        tasks = [
            asyncio.create_task(state.sweep_forever(min(5.0, cfg.sync_timeout_s / 4)), name="sync-sweeper")
        ]
        if state.engine is None:
            tasks.append(asyncio.create_task(state.load_engine(build, on_load_failure), name="engine-load"))
        if health_listener is not None:
            tasks.append(
                asyncio.create_task(state.publish_health_forever(health_listener), name="health-snapshot")
            )
        try:
            yield
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            await state.close()

    app = FastAPI(title="rollmatch rollout server", lifespan=lifespan)
    app.state.server = state
    install_exception_handlers(app)
    app.add_middleware(BodySizeLimitMiddleware, max_bytes=cfg.max_body_bytes)
    app.include_router(health.router)
    app.include_router(infer.router, dependencies=[Depends(require_bearer)])
    app.include_router(sync.router, dependencies=[Depends(require_bearer)])
    app.include_router(metrics.router, dependencies=[Depends(require_bearer)])
    # HTTP series (requests by handler/method/status, latency) into the app's own registry. Its in-progress
    # gauge stays off: 8.1 registers it in the process-global registry whatever `registry` says (a second app
    # in one process then fails); `rollmatch_infer_*_in_flight` cover what is in progress.
    Instrumentator(registry=state.metrics.registry, excluded_handlers=["/metrics"]).instrument(app)
    return app
