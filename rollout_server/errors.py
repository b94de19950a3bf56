"""Server error families and the handlers that render them in the one error envelope
(docs/ARCHITECTURE.md#errors).

Every error leaves the server as `{"error": {"type", "message", "detail"}}`. Caller mistakes are
4xx (400/401/404/409/413/422), 503 means not ready, 500 an engine failure; the server stays up.
`type` is a stable snake_case string clients can switch on.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse

from shared_schemas.errors import ErrorBody, ErrorEnvelope

logger = logging.getLogger(__name__)

__all__ = [
    "ERROR_RESPONSES",
    "BadRequestError",
    "ConflictError",
    "EngineError",
    "EngineNotReadyError",
    "LoraDisabledError",
    "NotFoundError",
    "PayloadTooLargeError",
    "PromptTooLongError",
    "RolloutServerError",
    "StaleVersionError",
    "SyncValidationError",
    "UnauthorizedError",
    "UnknownAdapterError",
    "UnknownSyncError",
    "error_response",
    "install_exception_handlers",
    "validation_detail",
]

MAX_REPORTED_ERRORS = 10
"""At most this many {loc, msg} items are reported for one invalid request."""

ERROR_RESPONSES: dict[int | str, dict[str, Any]] = {
    code: {"model": ErrorEnvelope} for code in (400, 401, 404, 409, 413, 422, 500, 503)
}
"""`responses=` of every protected route: the statuses it may answer in the error envelope (OpenAPI docs)."""


class RolloutServerError(Exception):
    """Base of every error the server reports on purpose.

    Args:
        message: human text naming the item, the value, the limit and the fix.
        type: stable snake_case type (defaults to the class's `default_type`).
        detail: optional JSON-able structure (never the caller's input values).
        status: HTTP status (defaults to the class's `status`).
    """

    status: int = 500
    default_type: str = "internal_error"

    def __init_subclass__(
        cls, *, status: int | None = None, default_type: str | None = None, **kw: Any
    ) -> None:
        """A family is declared in its class line, `class X(RolloutServerError, status=404,
        default_type="x")`; a subfamily names only its `default_type` and keeps its base's status."""
        super().__init_subclass__(**kw)
        if status is not None:
            cls.status = status
        if default_type is not None:
            cls.default_type = default_type

    def __init__(
        self, message: str, *, type: str | None = None, detail: Any = None, status: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.type = type or self.default_type
        self.detail = detail
        if status is not None:
            self.status = status

    def envelope(self) -> ErrorEnvelope:
        """The wire form of this error."""
        return ErrorEnvelope(error=ErrorBody(type=self.type, message=self.message, detail=self.detail))


class BadRequestError(RolloutServerError, status=400, default_type="bad_request"):
    """400: a well-formed request the server cannot serve as asked."""


class PromptTooLongError(BadRequestError, default_type="prompt_too_long"):
    """400: prompt + max_tokens exceeds max_model_len."""


class SyncValidationError(BadRequestError, default_type="sync_invalid"):
    """400: a weight-sync manifest or bucket does not match the engine's parameters or the manifest."""


class UnauthorizedError(RolloutServerError, status=401, default_type="unauthorized"):
    """401: missing or wrong bearer token."""


class NotFoundError(RolloutServerError, status=404, default_type="not_found"):
    """404: the named thing (route, sync id, adapter) does not exist."""


class UnknownSyncError(NotFoundError, default_type="unknown_sync"):
    """404: no staged sync with this id (never begun, committed, aborted or timed out)."""


class UnknownAdapterError(NotFoundError, default_type="unknown_adapter"):
    """404: the request names an adapter the server has not loaded."""


class ConflictError(RolloutServerError, status=409, default_type="conflict"):
    """409: the request conflicts with the server's state."""


class LoraDisabledError(ConflictError, default_type="lora_disabled"):
    """409: adapter sync or adapter request on a server without LoRA (triggers fallback_to_full)."""


class StaleVersionError(ConflictError, default_type="stale_version"):
    """409: a sync whose target version is not greater than the current one."""


class PayloadTooLargeError(RolloutServerError, status=413, default_type="payload_too_large"):
    """413: request body above `server.max_body_mb`."""


class EngineNotReadyError(RolloutServerError, status=503, default_type="engine_not_ready"):
    """503: the engine is loading or failed to load."""


class EngineError(RolloutServerError, status=500, default_type="engine_error"):
    """500: the engine failed while serving a valid request."""


def error_response(err: RolloutServerError) -> JSONResponse:
    """Renders an error as the error envelope with its status."""
    headers = {"WWW-Authenticate": "Bearer"} if err.status == 401 else None
    return JSONResponse(err.envelope().model_dump(mode="json"), status_code=err.status, headers=headers)


def _loc_part(part: Any) -> str | int:
    return part if isinstance(part, int) else str(part)


def validation_detail(errors: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reduces pydantic error dicts to at most `MAX_REPORTED_ERRORS` `{loc, msg}` items (no input)."""
    items = []
    for err in errors[:MAX_REPORTED_ERRORS]:
        loc = [_loc_part(p) for p in err.get("loc", ())]
        items.append({"loc": loc, "msg": str(err.get("msg", "invalid value"))})
    return items


def _validation_message(errors: list[dict[str, Any]]) -> str:
    if not errors:
        return "invalid request"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"request body is not valid JSON ({first.get('msg', 'decode error')}); send a JSON object"
    loc = ".".join(str(p) for p in first.get("loc", ()) if p != "body") or "body"
    more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"invalid request: {loc}: {first.get('msg', 'invalid value')}{more}"


async def _handle_server_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RolloutServerError)
    if exc.status >= 500:
        logger.error("%s %s failed: %s", request.method, request.url.path, exc.message)
    else:
        logger.debug("%s %s rejected (%s): %s", request.method, request.url.path, exc.type, exc.message)
    return error_response(exc)


async def _handle_validation(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    errors = list(exc.errors())
    err = RolloutServerError(
        _validation_message(errors), type="validation_error", detail=validation_detail(errors), status=422
    )
    return error_response(err)


async def _handle_http(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    types = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 401: "unauthorized"}
    message = exc.detail if isinstance(exc.detail, str) else "HTTP error"
    if exc.status_code == 404:
        message = f"no route {request.method} {request.url.path}; see GET /docs for the routes"
    err = RolloutServerError(message, type=types.get(exc.status_code, "http_error"), status=exc.status_code)
    return error_response(err)


async def _handle_unexpected(request: Request, exc: Exception) -> JSONResponse:
    request_id = request.headers.get("x-request-id", "-")
    logger.exception(
        "unhandled error in %s %s (x-request-id %s)", request.method, request.url.path, request_id
    )
    err = EngineError(f"internal error ({type(exc).__name__}); see the server log", type="internal_error")
    return error_response(err)


def install_exception_handlers(app: FastAPI) -> None:
    """Registers handlers from specific to catch-all so every error uses the error envelope."""
    app.add_exception_handler(RolloutServerError, _handle_server_error)
    app.add_exception_handler(RequestValidationError, _handle_validation)
    app.add_exception_handler(StarletteHTTPException, _handle_http)
    app.add_exception_handler(Exception, _handle_unexpected)
