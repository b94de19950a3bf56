"""`/sync_weights/...`: begin → buckets (HTTP body or shm file name) → [prepare] → commit | abort.

The route split is documented in `shared_schemas.sync`; the state machine lives in
`rollout_server.weights.staging`, each transport's way in in `rollout_server.weights.receivers`.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Request

from rollout_server.deps import EngineDep, StateDep, get_engine
from rollout_server.errors import ERROR_RESPONSES
from rollout_server.weights.receivers import HttpReceiver, ShmReceiver
from shared_schemas import sync as wire

__all__ = ["router"]

router = APIRouter(tags=["sync"])

SyncId = Annotated[str, Path(pattern=r"^[0-9a-f]{8,64}$")]
BucketIndex = Annotated[int, Path(ge=0)]

_BUCKET_ROUTE: dict[str, Any] = {
    "response_model": wire.BucketAck,
    "responses": ERROR_RESPONSES,
    "dependencies": [Depends(get_engine)],
}
"""The options of both bucket routes (HTTP body, shm file name): they answer a `BucketAck` and need the
engine loaded."""


@router.post(wire.SYNC_BEGIN_PATH, response_model=wire.SyncBeginResponse, responses=ERROR_RESPONSES)
async def begin(body: wire.SyncBeginRequest, state: StateDep, engine: EngineDep) -> wire.SyncBeginResponse:
    """Validates the manifest (names, dtypes, shapes, version, LoRA) and opens a staged sync."""
    return await state.staging.begin(body, engine)


@router.put(wire.BUCKET_PATH, **_BUCKET_ROUTE)
async def put_bucket(
    sync_id: SyncId, index: BucketIndex, request: Request, state: StateDep
) -> wire.BucketAck:
    """Stages one bucket sent as the safetensors body (`application/octet-stream`), streamed into its
    staging file as it arrives."""
    return await state.staging.receive(sync_id, index, request.stream(), HttpReceiver.name)


@router.post(wire.BUCKET_SHM_PATH, **_BUCKET_ROUTE)
async def put_shm_bucket(
    sync_id: SyncId, index: BucketIndex, body: wire.ShmBucketRef, state: StateDep
) -> wire.BucketAck:
    """Stages one bucket the learner wrote into the server's staging directory (named by file name)."""
    return await state.staging.receive(sync_id, index, body, ShmReceiver.name)


@router.post(wire.SYNC_PREPARE_PATH, response_model=wire.SyncPrepareResponse, responses=ERROR_RESPONSES)
async def prepare(body: wire.SyncPrepareRequest, state: StateDep) -> wire.SyncPrepareResponse:
    """Answers once the staged sync holds every bucket (collective: its receive has finished), so the commit
    will only apply; a learner with several servers prepares them all before it commits any."""
    return await state.staging.prepare(body.sync_id)


@router.post(wire.SYNC_COMMIT_PATH, response_model=wire.SyncCommitResponse, responses=ERROR_RESPONSES)
async def commit(body: wire.SyncCommitRequest, state: StateDep, engine: EngineDep) -> wire.SyncCommitResponse:
    """Applies the staged sync atomically; on any failure nothing is applied and the sync is discarded."""
    return await state.staging.commit(body.sync_id, engine)


@router.post(wire.SYNC_ABORT_PATH, response_model=wire.SyncAbortResponse, responses=ERROR_RESPONSES)
async def abort(body: wire.SyncAbortRequest, state: StateDep) -> wire.SyncAbortResponse:
    """Discards the staged sync (idempotent)."""
    return await state.staging.abort(body.sync_id)
