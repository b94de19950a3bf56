"""FastAPI dependencies: the server state, the engine and the bearer-token check."""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import Depends, Request

from rollout_server.engines.base import Engine
from rollout_server.errors import UnauthorizedError
from rollout_server.state import ServerState

__all__ = ["EngineDep", "StateDep", "get_engine", "get_state", "require_bearer"]


def get_state(request: Request) -> ServerState:
    """The app's `ServerState` (set once by `create_app`)."""
    return request.app.state.server


StateDep = Annotated[ServerState, Depends(get_state)]


def get_engine(state: StateDep) -> Engine:
    """The ready engine, else 503."""
    return state.require_engine()


EngineDep = Annotated[Engine, Depends(get_engine)]


def require_bearer(request: Request, state: StateDep) -> None:
    """Checks `Authorization: Bearer <token>` when `server.auth_token` is set (constant-time compare)."""
    token = state.cfg.auth_token
    if token is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    expected = token.get_secret_value().encode()
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), expected):
        raise UnauthorizedError(
            "missing or wrong bearer token; send 'Authorization: Bearer <server.auth_token>'"
        )
