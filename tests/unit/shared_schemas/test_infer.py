"""`/infer/` wire models and per-request seeds (docs/ARCHITECTURE.md#infer,
#determinism; docs/ALGORITHM.md#seeds)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from shared_schemas.infer import (
    Choice,
    InferBatch,
    InferRequest,
    InferResult,
    RequestConfig,
    image_ref_kind,
    request_seed,
    resolve_seeds,
)

USER = {
    "role": "user",
    "content": [{"type": "image", "image": "/data/a.png"}, {"type": "text", "text": "hi"}],
}


def test_ms_swift_request_is_accepted_unchanged() -> None:
    body = {
        "infer_requests": [{"messages": [USER], "images": ["file:///data/b.png"], "objects": {"ref": []}}],
        "request_config": {"max_tokens": 8, "temperature": 0.0, "stream": False, "top_logprobs": None},
        "use_tqdm": False,
    }
    batch = InferBatch.model_validate(body)
    assert batch.first_index == 0
    assert batch.infer_requests[0].all_image_refs() == ["/data/a.png", "file:///data/b.png"]
    assert batch.request_config.max_tokens == 8


@pytest.mark.parametrize(
    ("request_body", "fragment"),
    [
        pytest.param({}, "exactly one", id="neither"),
        pytest.param({"messages": [USER], "prompt_token_ids": [1]}, "exactly one", id="both"),
        pytest.param({"messages": []}, "empty", id="empty-messages"),
        pytest.param({"prompt_token_ids": []}, "empty", id="empty-ids"),
        pytest.param({"prompt_token_ids": [-1]}, "greater than or equal", id="negative-id"),
        pytest.param({"messages": [{"content": "x"}]}, "role", id="no-role"),
        pytest.param({"messages": [{"role": "user", "content": 3}]}, "content", id="bad-content"),
        pytest.param({"messages": ["hello"]}, "valid dictionary", id="message-not-object"),
        pytest.param({"messages": [USER], "images": ["http://x/a.png"]}, "scheme", id="http-image"),
        pytest.param(
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "s3://b/k"}]}]},
            "scheme",
            id="s3-image-in-message",
        ),
        pytest.param({"messages": [USER], "images": [""]}, "empty image", id="empty-image"),
    ],
)
def test_invalid_requests(request_body: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        InferRequest.model_validate(request_body)


@pytest.mark.parametrize(
    ("ref", "kind"),
    [
        ("/a/b.png", "path"),
        ("rel/b.jpg", "path"),
        ("file:///a.png", "file"),
        ("data:image/png;base64,AA", "data"),
    ],
)
def test_image_ref_kinds(ref: str, kind: str) -> None:
    assert image_ref_kind(ref) == kind


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 10**9}, "max_tokens"),
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": 0}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"min_tokens": 9, "max_tokens": 8}, "min_tokens"),
        ({"seed": -1}, "seed"),
        ({"adapter": ""}, "adapter"),
    ],
)
def test_invalid_request_config(config: dict[str, Any], fragment: str) -> None:
    with pytest.raises(ValidationError, match=fragment):
        RequestConfig.model_validate(config)


def test_stop_string_becomes_list() -> None:
    assert RequestConfig.model_validate({"stop": "}"}).stop == ["}"]


def test_seeds_must_match_requests() -> None:
    with pytest.raises(ValidationError, match="one seed per request"):
        InferBatch.model_validate({"infer_requests": [{"prompt_token_ids": [1]}], "seeds": [1, 2]})


@pytest.mark.parametrize(
    ("step", "micro", "index", "expected"),
    [
        pytest.param(10, 0, 0, 10000047, id="spec-5.3-req0"),
        pytest.param(10, 0, 2, 10000049, id="spec-5.3-req2"),
        pytest.param(10, 0, 4, 10000051, id="spec-5.3-req4"),
        pytest.param(10, 1, 2, 10010056, id="spec-5.3-micro1-req2"),
    ],
)
def test_request_seed_reproduces_spec_formula(step: int, micro: int, index: int, expected: int) -> None:
    base = 17 + step * 1_000_003 + micro * 10_007
    assert request_seed(base, index) == expected


def test_request_seed_masks_to_31_bits() -> None:
    assert request_seed(0x7FFFFFFF, 1) == 0


def test_seeds_do_not_depend_on_chunking() -> None:
    batch = InferBatch.model_validate(
        {
            "infer_requests": [{"prompt_token_ids": [i + 1]} for i in range(5)],
            "request_config": {"seed": 99},
            "first_index": 3,
        }
    )
    whole = resolve_seeds(batch)
    assert whole == [request_seed(99, 3 + i) for i in range(5)]
    parts = resolve_seeds(batch.slice(0, 2)) + resolve_seeds(batch.slice(2, 5))
    assert parts == whole
    assert batch.slice(2, 5).first_index == 5


def test_explicit_seeds_win_and_survive_slicing() -> None:
    batch = InferBatch.model_validate(
        {"infer_requests": [{"prompt_token_ids": [1]}] * 3, "request_config": {"seed": 5}, "seeds": [7, 8, 9]}
    )
    assert resolve_seeds(batch) == [7, 8, 9]
    assert resolve_seeds(batch.slice(1, 3)) == [8, 9]


def test_missing_seed_uses_server_default() -> None:
    batch = InferBatch.model_validate({"infer_requests": [{"prompt_token_ids": [1]}] * 2, "first_index": 4})
    assert resolve_seeds(batch, default_seed=11) == [15, 16]


def test_results_are_frozen() -> None:
    result = InferResult(
        index=0,
        prompt_token_ids=[1],
        choices=[Choice(token_ids=[2], text="x", finish_reason="stop")],
        weight_version=0,
    )
    with pytest.raises(ValidationError):
        result.index = 1  # type: ignore[misc]
    with pytest.raises(ValidationError):
        Choice(token_ids=[], text="", finish_reason="eos")  # type: ignore[arg-type]
