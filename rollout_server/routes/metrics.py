"""`GET /metrics`: the server's Prometheus series (`rollout_server.metrics`), behind the bearer token."""

from __future__ import annotations

from fastapi import APIRouter
from starlette.responses import Response

from rollout_server.deps import StateDep
from rollout_server.metrics import CONTENT_TYPE

__all__ = ["router"]

router = APIRouter(tags=["metrics"])


@router.get("/metrics", response_class=Response, responses={200: {"content": {CONTENT_TYPE: {}}}})
async def metrics(state: StateDep) -> Response:
    """Prometheus text exposition: HTTP, rollout, weight-sync, version and health series."""
    health = await state.health()
    body = state.metrics.render(status=health.status, weight_version=health.weight_version)
    return Response(body, media_type=CONTENT_TYPE)
