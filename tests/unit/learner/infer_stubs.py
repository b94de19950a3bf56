"""Stub engine answers for the learner's unit tests: one finished one-token choice per request."""

from __future__ import annotations

from collections.abc import Callable

from shared_schemas.infer import Choice, InferBatch, InferResult


def stub_results(batch: InferBatch, version: int | Callable[[int], int] = 0) -> list[InferResult]:
    """Results of `batch` in order: prompt `[1]`, one choice of token `[2]` stopped; `version` is the weight
    version, or a function of the result's index that gives it."""
    return [
        InferResult(
            index=batch.first_index + i,
            request_id=req.request_id,
            prompt_token_ids=[1],
            choices=[Choice(token_ids=[2], text="", finish_reason="stop")],
            weight_version=version if isinstance(version, int) else version(batch.first_index + i),
        )
        for i, req in enumerate(batch.infer_requests)
    ]
