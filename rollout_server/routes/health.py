"""`GET /health` (and `/health/`): 200 only when the engine is ready; never requires auth."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse

from rollout_server.deps import StateDep
from rollout_server.state import ServerState
from shared_schemas.health import Health

__all__ = ["build_health", "router"]

router = APIRouter(tags=["health"])


async def build_health(state: ServerState) -> Health:
    """The health body: the engine's own view when loaded, else the config's with `loading`/`error`."""
    cfg = state.cfg
    if state.engine is None:
        return Health(
            status="error" if state.load_error else "loading",
            engine=cfg.backend,
            model=str(cfg.model_path),
            weight_version=0,
            dp=cfg.vllm.data_parallel_size if cfg.backend == "vllm" else 1,
            tp=cfg.vllm.tensor_parallel_size if cfg.backend == "vllm" else 1,
            lora_enabled=cfg.vllm.enable_lora if cfg.backend == "vllm" else False,
            max_model_len=cfg.vllm.max_model_len,
            dtype=cfg.served_dtype,
            uptime_s=state.uptime_s,
            detail=state.load_error,
        )
    engine_health = await state.engine.health()
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
        uptime_s=state.uptime_s,
        detail=engine_health.detail,
    )


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
@router.get("/health/", response_model=Health, responses={503: {"model": Health}}, include_in_schema=False)
async def health(state: StateDep) -> JSONResponse:
    """Server status; 503 with the same body while loading or failed."""
    body = await build_health(state)
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if body.status == "ok" else 503)
