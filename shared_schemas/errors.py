"""The one error envelope of the wire contract, `{"error": {"type", "message", "detail"}}`
(docs/ARCHITECTURE.md#errors)."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

__all__ = ["ErrorBody", "ErrorEnvelope"]


class ErrorBody(BaseModel):
    """What went wrong, for a program (`type`) and for a person (`message`)."""

    model_config = ConfigDict(frozen=True, extra="ignore", use_attribute_docstrings=True)

    type: str
    """Stable snake_case type, e.g. `prompt_too_long`, `lora_disabled`, `stale_version`,
    `validation_error`."""
    message: str
    """Names the item, the value, the limit and the fix."""
    detail: Any = None
    """Optional structure; for validation errors a list of at most 10 `{loc, msg}` items (no input values)."""


class ErrorEnvelope(BaseModel):
    """Body of every non-2xx response."""

    model_config = ConfigDict(frozen=True, extra="ignore")

    error: ErrorBody
