"""Fuzzing the wire contract: schemathesis generates requests for every route of the app's own OpenAPI schema
(a fixed example budget, derandomized, schema-valid and schema-violating data) against a real app with a fake
engine. Every answer is below 500, and every error is the error envelope
`{"error": {"type", "message", "detail"}}`.

Hypothesis drives each operation's strategy directly (schemathesis' pytest plugin does not load under this
pytest), one test per operation.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from shared_schemas.errors import ErrorEnvelope
from tests.unit.rollout_server.fakes import FakeEngine

EXAMPLES = 30
"""Examples per operation (a fixed budget: the whole file runs in seconds)."""


def _started_once(app: Any) -> Any:
    """The app as one long-lived server sees it: schemathesis opens a client (lifespan startup and shutdown)
    per call, and a shut-down app has closed its engine; here the lifespan messages are acknowledged and the
    app keeps its (fake) engine."""

    async def asgi(scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "lifespan":
            return await app(scope, receive, send)
        while True:
            message = await receive()
            await send({"type": message["type"] + ".complete"})
            if message["type"] == "lifespan.shutdown":
                return

    return asgi


def _schema(tmp: Path) -> Any:
    cfg = ServerConfig.model_validate({"model": str(tmp), "shm_dir": str(tmp / "shm")})
    return schemathesis.openapi.from_asgi("/openapi.json", _started_once(create_app(cfg, FakeEngine())))


def _labels() -> list[str]:
    app = create_app(ServerConfig.model_validate({"model": "."}), FakeEngine())
    schema = schemathesis.openapi.from_asgi("/openapi.json", _started_once(app))
    return sorted(result.ok().label for result in schema.get_all_operations())


@pytest.fixture(scope="module")
def schema(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return _schema(tmp_path_factory.mktemp("fuzz"))


def test_every_route_is_fuzzed() -> None:
    assert {"POST /infer/", "GET /health", "GET /metrics", "POST /sync_weights/begin"} <= set(_labels())


@pytest.mark.parametrize("mode", list(GenerationMode), ids=lambda m: m.value)
@pytest.mark.parametrize("label", _labels())
def test_no_5xx_and_every_error_is_the_envelope(schema: Any, label: str, mode: GenerationMode) -> None:
    """Positive (schema-valid) and negative (schema-violating) requests alike."""
    operation = schema.find_operation_by_label(label)

    @given(case=operation.as_strategy(generation_mode=mode))
    @settings(
        max_examples=EXAMPLES,
        derandomize=True,
        deadline=None,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
        database=None,
    )
    def fuzz(case: Any) -> None:
        response = case.call()
        assert response.status_code < 500, f"{label}: {response.status_code} {response.text[:300]}"
        if response.status_code >= 400:
            ErrorEnvelope.model_validate(json.loads(response.text))

    try:
        fuzz()
    except Unsatisfiable:
        assert mode is GenerationMode.NEGATIVE
        pytest.skip(f"{label} takes no input that could violate its schema")
