"""Routes and error mapping of the rollout server with a fake engine (docs/ARCHITECTURE.md#the-contract)."""

from __future__ import annotations

import asyncio
import json
import threading
from typing import Any

import httpx
import pytest
from fastapi.testclient import TestClient

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from rollout_server.engines.base import Engine
from shared_schemas.errors import ErrorEnvelope
from shared_schemas.health import Health
from shared_schemas.infer import InferResponse, request_seed
from tests.unit.rollout_server.fakes import FakeEngine

USER = {"role": "user", "content": "find every object"}


def batch(**kw: Any) -> dict[str, Any]:
    return {
        "infer_requests": [{"messages": [USER], "request_id": "r0"}],
        "request_config": {"max_tokens": 8},
        **kw,
    }


def assert_envelope(resp: httpx.Response, status: int, error_type: str | None = None) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    body = ErrorEnvelope.model_validate(resp.json())
    assert set(resp.json()) == {"error"}
    if error_type is not None:
        assert body.error.type == error_type
    return resp.json()["error"]


def test_fake_engine_satisfies_protocol() -> None:
    assert isinstance(FakeEngine(), Engine)


def test_health_ok_on_both_paths(client: TestClient) -> None:
    for path in ("/health", "/health/"):
        resp = client.get(path)
        assert resp.status_code == 200
        health = Health.model_validate(resp.json())
        assert (health.status, health.engine, health.weight_version, health.max_model_len) == (
            "ok",
            "vllm",
            0,
            64,
        )


def test_infer_order_index_and_seeds(client: TestClient, engine: FakeEngine) -> None:
    body = {
        "infer_requests": [{"prompt_token_ids": [i + 1] * (i + 1), "request_id": f"q{i}"} for i in range(4)],
        "request_config": {"max_tokens": 4, "seed": 100, "n": 2},
        "first_index": 6,
    }
    resp = client.post("/infer/", json=body)
    assert resp.status_code == 200, resp.text
    out = InferResponse.model_validate(resp.json())
    assert [r.index for r in out.results] == [6, 7, 8, 9]
    assert [r.request_id for r in out.results] == ["q0", "q1", "q2", "q3"]
    assert [r.prompt_token_ids for r in out.results] == [[i + 1] * (i + 1) for i in range(4)]
    assert [r.choices[0].token_ids for r in out.results] == [[request_seed(100, 6 + i)] for i in range(4)]
    assert all(len(r.choices) == 2 for r in out.results)
    assert out.weight_version == 0 and out.timing.total_s >= 0
    assert len(engine.calls) == 1


def test_infer_without_trailing_slash(client: TestClient) -> None:
    assert client.post("/infer", json=batch()).status_code == 200


def test_empty_infer_list_never_reaches_engine(client: TestClient, engine: FakeEngine) -> None:
    resp = client.post("/infer/", json={"infer_requests": []})
    assert resp.status_code == 200
    assert resp.json()["results"] == []
    assert engine.calls == []


LONG = " ".join(["w"] * 60)

# (id, body or raw bytes, expected status, expected error type, field the message or detail must name)
MALFORMED: list[tuple[str, Any, int, str, str]] = [
    ("not-json", b"{not json", 422, "validation_error", "body"),
    ("json-array", [], 422, "validation_error", "body"),
    ("missing-infer_requests", {"request_config": {}}, 422, "validation_error", "infer_requests"),
    ("infer_requests-not-list", {"infer_requests": "x"}, 422, "validation_error", "infer_requests"),
    ("request-not-object", {"infer_requests": [5]}, 422, "validation_error", "infer_requests"),
    ("neither-messages-nor-ids", {"infer_requests": [{}]}, 422, "validation_error", "infer_requests"),
    ("empty-messages", {"infer_requests": [{"messages": []}]}, 422, "validation_error", "messages"),
    ("messages-not-list", {"infer_requests": [{"messages": "hi"}]}, 422, "validation_error", "messages"),
    (
        "message-without-role",
        {"infer_requests": [{"messages": [{"content": "x"}]}]},
        422,
        "validation_error",
        "role",
    ),
    (
        "both-messages-and-ids",
        {"infer_requests": [{"messages": [USER], "prompt_token_ids": [1]}]},
        422,
        "validation_error",
        "prompt_token_ids",
    ),
    (
        "ids-not-ints",
        {"infer_requests": [{"prompt_token_ids": ["a"]}]},
        422,
        "validation_error",
        "prompt_token_ids",
    ),
    (
        "negative-id",
        {"infer_requests": [{"prompt_token_ids": [-3]}]},
        422,
        "validation_error",
        "prompt_token_ids",
    ),
    (
        "images-not-strings",
        batch(infer_requests=[{"messages": [USER], "images": [1]}]),
        422,
        "validation_error",
        "images",
    ),
    (
        "unknown-image-scheme",
        batch(infer_requests=[{"messages": [USER], "images": ["ftp://h/a.png"]}]),
        422,
        "validation_error",
        "scheme",
    ),
    ("negative-max_tokens", batch(request_config={"max_tokens": -1}), 422, "validation_error", "max_tokens"),
    ("zero-max_tokens", batch(request_config={"max_tokens": 0}), 422, "validation_error", "max_tokens"),
    ("huge-max_tokens", batch(request_config={"max_tokens": 10**12}), 422, "validation_error", "max_tokens"),
    (
        "max_tokens-string",
        batch(request_config={"max_tokens": "many"}),
        422,
        "validation_error",
        "max_tokens",
    ),
    (
        "negative-temperature",
        batch(request_config={"temperature": -1}),
        422,
        "validation_error",
        "temperature",
    ),
    ("top_p-zero", batch(request_config={"top_p": 0}), 422, "validation_error", "top_p"),
    ("top_k-zero", batch(request_config={"top_k": 0}), 422, "validation_error", "top_k"),
    ("n-zero", batch(request_config={"n": 0}), 422, "validation_error", "n"),
    ("negative-first_index", batch(first_index=-1), 422, "validation_error", "first_index"),
    ("seeds-wrong-length", batch(seeds=[1, 2]), 422, "validation_error", "seeds"),
    (
        "prompt-too-long",
        {
            "infer_requests": [{"messages": [USER]}, {"messages": [{"role": "user", "content": LONG}]}],
            "first_index": 7,
            "request_config": {"max_tokens": 8},
        },
        400,
        "prompt_too_long",
        "request 8",
    ),
    (
        "prompt-plus-max_tokens",
        batch(request_config={"max_tokens": 62}),
        400,
        "prompt_too_long",
        "max_model_len",
    ),
    ("adapter-without-lora", batch(request_config={"adapter": "a1"}), 409, "lora_disabled", "adapter"),
]


@pytest.mark.parametrize(
    ("body", "status", "error_type", "names"), [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED]
)
def test_malformed_infer_requests(
    client: TestClient, body: Any, status: int, error_type: str, names: str
) -> None:
    if isinstance(body, bytes):
        resp = client.post("/infer/", content=body, headers={"content-type": "application/json"})
    else:
        resp = client.post("/infer/", json=body)
    error = assert_envelope(resp, status, error_type)
    assert names in json.dumps(error)
    if error_type == "validation_error":
        assert 1 <= len(error["detail"]) <= 10
        assert all(set(item) == {"loc", "msg"} for item in error["detail"])
    assert client.get("/health").status_code == 200


def test_malformed_list_is_long_enough() -> None:
    assert len(MALFORMED) >= 20


def test_validation_errors_are_capped_and_echo_no_input(client: TestClient) -> None:
    secret = "SECRET-INPUT-VALUE"
    body = {"infer_requests": [{"prompt_token_ids": [secret] * 3, "request_id": 5} for _ in range(10)]}
    error = assert_envelope(client.post("/infer/", json=body), 422, "validation_error")
    assert len(error["detail"]) == 10
    assert secret not in json.dumps(error)


def test_oversize_body_is_413(client: TestClient, engine: FakeEngine) -> None:
    big = {"infer_requests": [{"prompt_token_ids": [1] * 700_000}]}  # > 1 MiB of JSON
    assert_envelope(client.post("/infer/", json=big), 413, "payload_too_large")
    assert engine.calls == []
    assert client.get("/health").status_code == 200


def test_oversize_streamed_body_without_length_is_413(client: TestClient) -> None:
    def chunks():  # no Content-Length: the limit is enforced while reading
        for _ in range(20):
            yield b" " * 100_000

    resp = client.put("/sync_weights/" + "a" * 32 + "/buckets/0", content=chunks())
    assert_envelope(resp, 413, "payload_too_large")


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_envelope(client.get("/nope"), 404, "not_found")
    assert_envelope(client.get("/infer/"), 405, "method_not_allowed")


def test_engine_crash_is_500_and_server_stays_up(cfg: ServerConfig) -> None:
    engine = FakeEngine(fail=True)
    with TestClient(create_app(cfg, engine=engine), raise_server_exceptions=False) as c:
        error = assert_envelope(c.post("/infer/", json=batch()), 500, "internal_error")
        assert "simulated" not in error["message"]
        assert c.get("/health").status_code == 200
    assert engine.closed


AUTH_ROUTES = [
    ("post", "/infer/", {"infer_requests": []}),
    ("post", "/sync_weights/abort", {"sync_id": "a" * 32}),
]


@pytest.mark.parametrize(("method", "path", "body"), AUTH_ROUTES)
def test_bearer_auth_on_every_route_but_health(cfg: ServerConfig, method: str, path: str, body: Any) -> None:
    cfg = ServerConfig.model_validate({**cfg.model_dump(), "auth_token": "s3cret"})
    with TestClient(create_app(cfg, engine=FakeEngine())) as c:
        assert c.get("/health").status_code == 200
        assert_envelope(getattr(c, method)(path, json=body), 401, "unauthorized")
        bad = {"Authorization": "Bearer wrong"}
        assert_envelope(getattr(c, method)(path, json=body, headers=bad), 401, "unauthorized")
        good = {"Authorization": "Bearer s3cret"}
        assert getattr(c, method)(path, json=body, headers=good).status_code == 200


def test_health_is_loading_until_engine_ready(cfg: ServerConfig) -> None:
    release = threading.Event()
    engine = FakeEngine()

    async def slow_builder(_: ServerConfig) -> FakeEngine:
        await asyncio.to_thread(release.wait, 30)
        return engine

    with TestClient(create_app(cfg, engine_builder=slow_builder)) as c:
        resp = c.get("/health")
        assert resp.status_code == 503
        assert resp.json()["status"] == "loading"
        assert_envelope(c.post("/infer/", json=batch()), 503, "engine_loading")
        release.set()
        for _ in range(200):
            if c.get("/health").status_code == 200:
                break
            threading.Event().wait(0.02)
        assert c.get("/health").json()["status"] == "ok"
    assert engine.closed


def test_failed_load_reports_error(cfg: ServerConfig) -> None:
    failures: list[BaseException] = []

    async def broken_builder(_: ServerConfig) -> FakeEngine:
        raise FileNotFoundError("no model at /models/fake")

    with TestClient(create_app(cfg, engine_builder=broken_builder, on_load_failure=failures.append)) as c:
        for _ in range(200):
            if failures:
                break
            threading.Event().wait(0.01)
        resp = c.get("/health")
        assert resp.status_code == 503
        assert resp.json()["status"] == "error" and "no model" in resp.json()["detail"]
        assert_envelope(c.post("/infer/", json=batch()), 503, "engine_failed")
    assert len(failures) == 1


def test_health_answers_while_generation_runs(cfg: ServerConfig) -> None:
    engine = FakeEngine()
    engine.gate = asyncio.Event()
    with TestClient(create_app(cfg, engine=engine)) as c:
        results: list[httpx.Response] = []
        worker = threading.Thread(target=lambda: results.append(c.post("/infer/", json=batch())))
        worker.start()
        for _ in range(200):
            if engine.calls:
                break
            threading.Event().wait(0.01)
        assert c.get("/health").status_code == 200  # generation still blocked on the gate
        c.portal.call(engine.gate.set)  # type: ignore[union-attr]
        worker.join(10)
        assert results[0].status_code == 200


def test_create_app_twice_registers_routes_once(cfg: ServerConfig) -> None:
    paths = [sorted(r.path for r in create_app(cfg, engine=FakeEngine()).routes) for _ in range(2)]
    assert paths[0] == paths[1]
    assert paths[0].count("/infer/") == 1
