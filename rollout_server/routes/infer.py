"""`POST /infer/`: generate for a batch of requests (DESIGN.md §3)."""

from __future__ import annotations

import logging
import time

from fastapi import APIRouter

from rollout_server.deps import EngineDep
from rollout_server.engines.base import check_results
from shared_schemas.errors import ErrorEnvelope
from shared_schemas.infer import InferBatch, InferResponse, Timing

logger = logging.getLogger(__name__)

__all__ = ["router"]

router = APIRouter(tags=["infer"])

_ERRORS = {code: {"model": ErrorEnvelope} for code in (400, 401, 404, 409, 413, 422, 500, 503)}


@router.post("/infer/", response_model=InferResponse, responses=_ERRORS)
@router.post("/infer", response_model=InferResponse, responses=_ERRORS, include_in_schema=False)
async def infer(batch: InferBatch, engine: EngineDep) -> InferResponse:
    """Results in request order: `results[i].index == first_index + i`; an empty batch never reaches the engine."""
    started = time.perf_counter()
    if not batch.infer_requests:
        return InferResponse(
            results=[], weight_version=engine.weight_version, timing=Timing(total_s=0.0, engine_s=0.0)
        )
    results = check_results(batch, await engine.generate(batch))
    engine_s = time.perf_counter() - started
    logger.debug("infer: %d requests from index %d in %.3f s", len(results), batch.first_index, engine_s)
    return InferResponse(
        results=results,
        weight_version=engine.weight_version,
        timing=Timing(total_s=time.perf_counter() - started, engine_s=engine_s),
    )
