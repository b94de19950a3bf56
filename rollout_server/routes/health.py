"""`GET /health` (and `/health/`), `/health/live`, `/health/ready` on the main port; never require auth.

These run on the event loop, so a busy loop delays them; `server.health_port` serves the same three paths from
a process of its own (`rollout_server.health_listener`), which is what probes should use. Both answer through
`health_listener.answer`.
"""

from __future__ import annotations

import time

from fastapi import APIRouter
from starlette.responses import JSONResponse

from rollout_server.deps import StateDep
from rollout_server.health_listener import answer
from rollout_server.state import ServerState
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
    status, body = answer("/health/ready", await _snapshot(state), state.started, time.monotonic())
    return JSONResponse(body, status_code=status)


@router.get("/health/live")
async def live(state: StateDep) -> dict[str, object]:
    """Liveness: 200 whenever the process answers."""
    return answer("/health/live", await _snapshot(state), state.started, time.monotonic())[1]


async def _snapshot(state: ServerState) -> dict[str, object]:
    health = await state.health()
    return {
        "health": health.model_dump(mode="json"),
        "applying": state.staging.applying,
        "taken_at": time.monotonic(),
    }
