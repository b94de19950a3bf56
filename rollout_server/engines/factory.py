"""Builds the configured engine: `VllmEngine`, `EngineGroup` (data parallel > 1) or `HfEngine`.

Backends are imported only when chosen: vLLM is heavy and absent from client-only installs, and the HF
backend should not pay for it.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from collections.abc import Callable
from typing import Any

from rollout_server.config import ServerConfig
from rollout_server.engines.base import Engine

logger = logging.getLogger(__name__)

__all__ = ["build_engine", "engine_constructor"]


def engine_constructor(cfg: ServerConfig) -> Callable[[ServerConfig], Any]:
    """The `from_config` that builds the engine `cfg` asks for (module imported here, lazily)."""
    if cfg.backend == "hf":
        module, name = "rollout_server.engines.hf", "HfEngine"
    elif cfg.vllm.data_parallel_size > 1:
        module, name = "rollout_server.engines.group", "EngineGroup"
    else:
        module, name = "rollout_server.engines.vllm.engine", "VllmEngine"
    return getattr(importlib.import_module(module), name).from_config


async def build_engine(cfg: ServerConfig) -> Engine:
    """Builds the engine without blocking the event loop.

    A synchronous `from_config` runs in a worker thread; an async one is awaited on the server's loop (an
    engine bound to an event loop, such as vLLM's `AsyncLLM`, may prefer that).
    """
    constructor = engine_constructor(cfg)
    logger.info("building %s engine for %s", cfg.backend, cfg.model_path)
    if inspect.iscoroutinefunction(constructor):
        return await constructor(cfg)
    result = await asyncio.to_thread(constructor, cfg)
    if inspect.isawaitable(result):
        result = await result
    return result
