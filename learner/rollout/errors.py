"""Typed errors of the rollout-server client: one class per thing a caller handles differently.

| error | when | retried by `ServerRolloutSource.infer` |
|---|---|---|
| `ServerError` | a non-2xx answer, parsed from the error envelope (docs/ARCHITECTURE.md#errors) | 5xx only |
| `ServerConflict` | 409 (adapter sync without LoRA, stale version); also a `SyncRejected` | never |
| `ServerNotReady` | 503 (engine loading, or failed) | once, never split |
| `ServerUnreachable` | transport failure (refused, reset, timeout) | once; split unless the connect failed |
| `InferFailed` | a request failed twice after retries and splits | — |
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import httpx
from pydantic import ValidationError

from learner.weights.types import SyncRejected
from shared_schemas.errors import ErrorEnvelope

__all__ = [
    "InferFailed",
    "RolloutClientError",
    "ServerConflict",
    "ServerError",
    "ServerNotReady",
    "ServerUnreachable",
    "error_from_response",
    "format_indices",
]


class RolloutClientError(RuntimeError):
    """Base of the client's errors; `url` names the server (base URL, or the full request URL)."""

    def __init__(self, message: str, *, url: str) -> None:
        super().__init__(message)
        self.url = url


class ServerError(RolloutClientError):
    """The server answered with a non-2xx status.

    Attributes:
        status: HTTP status.
        type: the envelope's stable snake_case type (`prompt_too_long`, `lora_disabled`, ...), or
            `http_error` when the body was not an envelope.
        message: the envelope's message (names item, value, limit and fix).
        detail: the envelope's optional detail.
    """

    def __init__(self, status: int, type: str, message: str, *, url: str, detail: Any = None) -> None:
        super().__init__(f"{url} answered {status} {type}: {message}", url=url)
        self.status = status
        self.type = type
        self.message = message
        self.detail = detail

    @property
    def is_caller_error(self) -> bool:
        """4xx other than 408/429: the request itself is wrong, so retrying cannot help."""
        return 400 <= self.status < 500 and self.status not in (408, 429)


class ServerConflict(ServerError, SyncRejected):
    """409: the server refuses in its current state (`lora_disabled`, `stale_version`, `shm_disabled`)."""


class ServerNotReady(ServerError):
    """503: the engine is loading or failed to load (see the server's `/health` detail)."""


class ServerUnreachable(RolloutClientError):
    """No HTTP answer: connection refused or reset, DNS failure, or a connect/read timeout.

    Attributes:
        connect_failed: True when no connection could be opened (the server is down, not busy).
    """

    def __init__(self, message: str, *, url: str, connect_failed: bool) -> None:
        super().__init__(message, url=url)
        self.connect_failed = connect_failed


class InferFailed(RolloutClientError):
    """Requests could not be generated after the retry policy ran out.

    See docs/ALGORITHM.md#chunking-and-retries.

    Attributes:
        indices: global request indices that got no result.
    """

    def __init__(self, message: str, *, url: str, indices: Sequence[int]) -> None:
        super().__init__(message, url=url)
        self.indices = list(indices)


def format_indices(indices: Sequence[int]) -> str:
    """`index 7`, `indices 4..7` (contiguous) or `indices [1, 5, 9]`."""
    items = list(indices)
    if len(items) == 1:
        return f"index {items[0]}"
    if items and items == list(range(items[0], items[-1] + 1)):
        return f"indices {items[0]}..{items[-1]}"
    return f"indices {items[:10]}{' ...' if len(items) > 10 else ''}"


def error_from_response(response: httpx.Response) -> ServerError:
    """Turns a non-2xx response into the typed error for its status (the §3 envelope when present)."""
    url = str(response.request.url)
    try:
        body = ErrorEnvelope.model_validate_json(response.content).error
        type_, message, detail = body.type, body.message, body.detail
    except (ValidationError, json.JSONDecodeError, UnicodeDecodeError):
        type_, message, detail = "http_error", response.text[:200] or response.reason_phrase, None
    cls = {409: ServerConflict, 503: ServerNotReady}.get(response.status_code, ServerError)
    return cls(response.status_code, type_, message, url=url, detail=detail)
