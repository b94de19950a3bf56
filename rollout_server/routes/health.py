"""`GET /health` (and `/health/`), `/health/live`, `/health/ready` on the main port; never require auth.

These run on the event loop, so a busy loop delays them; `server.health_port` serves the same three paths from
a thread of its own (`rollout_server.health_listener`), which is what probes should use.
"""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import JSONResponse

from rollout_server.deps import StateDep
from shared_schemas.health import Health

__all__ = ["router"]

router = APIRouter(tags=["health"])


@router.get("/health", response_model=Health, responses={503: {"model": Health}})
@router.get("/health/", response_model=Health, responses={503: {"model": Health}}, include_in_schema=False)
async def health(state: StateDep) -> JSONResponse:
    """Server status; 503 with the same body while loading or failed."""
    body = await state.health()
    return JSONResponse(body.model_dump(mode="json"), status_code=200 if body.status == "ok" else 503)


@router.get("/health/ready", response_model=Health, responses={503: {"model": Health}})
async def ready(state: StateDep) -> JSONResponse:
    """Readiness: 200 when the engine is loaded and ok and no weight update is being applied, else 503."""
    snapshot = await state.snapshot()
    body = snapshot.health.model_dump(mode="json")
    if snapshot.applying:
        body["detail"] = "a weight update is being applied"
    return JSONResponse(body, status_code=200 if snapshot.ready else 503)


@router.get("/health/live")
async def live(state: StateDep) -> dict[str, object]:
    """Liveness: 200 whenever the process answers."""
    return {"status": "alive", "uptime_s": round(state.uptime_s, 3), "snapshot_age_s": 0.0}
