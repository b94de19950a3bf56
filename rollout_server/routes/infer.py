"""`POST /infer/`: generate for a batch of requests (docs/ARCHITECTURE.md#infer)."""

from __future__ import annotations

import asyncio
import logging
import time

from fastapi import APIRouter, Request
from starlette.responses import Response

from rollout_server.deps import EngineDep, StateDep
from rollout_server.engines.base import Engine, check_engine_results
from rollout_server.errors import ERROR_RESPONSES
from rollout_server.state import ServerState
from shared_schemas.infer import InferBatch, InferResponse, InferResult, Timing

logger = logging.getLogger(__name__)

__all__ = ["router"]

router = APIRouter(tags=["infer"])


@router.post("/infer/", response_model=InferResponse, responses=ERROR_RESPONSES)
@router.post("/infer", response_model=InferResponse, responses=ERROR_RESPONSES, include_in_schema=False)
async def infer(
    batch: InferBatch, engine: EngineDep, state: StateDep, request: Request
) -> InferResponse | Response:
    """Results in request order: `results[i].index == first_index + i`; an empty batch skips the engine."""
    started = time.perf_counter()
    if not batch.infer_requests:
        return InferResponse(
            results=[], weight_version=engine.weight_version, timing=Timing(total_s=0.0, engine_s=0.0)
        )
    samples = len(batch.infer_requests) * batch.request_config.n
    metrics = state.metrics
    metrics.calls_in_flight.inc()
    metrics.samples_in_flight.inc(samples)
    try:
        engine_started = time.perf_counter()
        generated = await _unless_disconnected(batch, engine, request, state)
        engine_s = time.perf_counter() - engine_started
    finally:
        metrics.calls_in_flight.dec()
        metrics.samples_in_flight.dec(samples)
    if generated is None:
        return Response(status_code=CLIENT_CLOSED_REQUEST)  # nobody reads it; keeps the access log honest
    results = check_engine_results(batch, generated)
    metrics.infer_done(results)
    total_s = time.perf_counter() - started
    logger.debug(
        "infer: %d requests from index %d in %.3f s (engine %.3f s)",
        len(results),
        batch.first_index,
        total_s,
        engine_s,
    )
    return InferResponse(
        results=results,
        weight_version=engine.weight_version,
        timing=Timing(total_s=total_s, engine_s=engine_s),
    )


CLIENT_CLOSED_REQUEST = 499
"""Status logged for an `/infer/` whose client went away (nginx's convention; never read by the client)."""


async def _unless_disconnected(
    batch: InferBatch, engine: Engine, request: Request, state: ServerState
) -> list[InferResult] | None:
    """Generates `batch`, or returns None when the client disconnects first: then it cancels the generation,
    which aborts the engine's requests (vLLM aborts a request whose output stream is closed), so a client that
    gave up stops costing at once instead of after its whole batch. A cancelled handler (graceful-shutdown
    timeout) cancels the generation the same way."""
    task = asyncio.ensure_future(engine.generate(batch))
    watcher = asyncio.ensure_future(_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
    if task.cancelled():
        state.metrics.disconnects.inc()
        logger.warning(
            "infer: client %s went away; %d requests from index %d aborted",
            request.client.host if request.client else "?",
            len(batch.infer_requests),
            batch.first_index,
        )
        return None
    return task.result()


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body was read already, so `receive` only waits for that)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
