"""ASGI middleware: request body size limit (413 in the error envelope)."""

from __future__ import annotations

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from rollout_server.errors import PayloadTooLargeError, error_response

__all__ = ["BodySizeLimitMiddleware", "BodyTooLarge"]


class BodyTooLarge(HTTPException):
    """Raised from `receive` once a streamed body passes the limit.

    An `HTTPException` because FastAPI re-raises those from body parsing (anything else becomes a 400).
    """

    def __init__(self, limit: int) -> None:
        super().__init__(
            status_code=413,
            detail=f"request body exceeds server.max_body_mb ({limit / 2**20:g} MiB); send less",
        )


class BodySizeLimitMiddleware:
    """Rejects bodies over `max_bytes`: early from `Content-Length`, else while streaming.

    Args:
        app: the wrapped ASGI app.
        max_bytes: the limit in bytes.
    """

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        received = 0

        async def limited_receive() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    raise BodyTooLarge(self.max_bytes)
            return message

        await self.app(scope, limited_receive, send)

    async def _reject(self, scope: Scope, receive: Receive, send: Send) -> None:
        err = PayloadTooLargeError(
            f"request body of {int(dict(scope['headers'])[b'content-length']) / 2**20:.1f} MiB exceeds"
            f" server.max_body_mb ({self.max_bytes / 2**20:g} MiB); send smaller buckets or raise the limit"
        )
        await error_response(err)(scope, receive, send)
