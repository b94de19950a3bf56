"""`GET /metrics` with a fake engine: the Prometheus series exist, move with requests and syncs, and need the
bearer token like every route but `/health`."""

from __future__ import annotations

from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from tests.unit.rollout_server.fakes import FakeEngine
from tests.unit.rollout_server.test_sync import begin, full_sync, manifest_for, tensors


def scrape(client: TestClient, **headers: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    resp = client.get("/metrics", headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain")
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(resp.text)
        for sample in family.samples
    }


def test_series_move_with_requests_and_syncs(client: TestClient, engine: FakeEngine) -> None:
    before = scrape(client)
    assert before[("rollmatch_weight_version", ())] == 0
    assert before[("rollmatch_health_status", (("status", "ok"),))] == 1
    assert before[("rollmatch_health_status", (("status", "loading"),))] == 0
    assert before[("rollmatch_infer_samples_total", ())] == 0

    body = {
        "infer_requests": [{"prompt_token_ids": [1, 2, 3], "request_id": f"q{i}"} for i in range(3)],
        "request_config": {"max_tokens": 4, "n": 2},
    }
    assert client.post("/infer/", json=body).status_code == 200
    assert full_sync(client, tensors(seed=1), 1).status_code == 200
    sync_id = begin(client, manifest_for(tensors(seed=2), 2)).json()["sync_id"]
    assert client.post("/sync_weights/abort", json={"sync_id": sync_id}).status_code == 200
    after = scrape(client)

    assert after[("rollmatch_infer_samples_total", ())] == 6
    assert after[("rollmatch_prompt_tokens_total", ())] == 9
    assert after[("rollmatch_generation_tokens_total", ())] == 6  # the fake engine answers one token each
    assert after[("rollmatch_infer_batch_size_count", ())] == 1
    assert after[("rollmatch_infer_samples_in_flight", ())] == 0
    assert after[("rollmatch_weight_version", ())] == 1
    committed = (("mode", "full"), ("outcome", "committed"), ("transport", "http"))
    aborted = (("mode", "full"), ("outcome", "aborted"), ("transport", "http"))
    assert after[("rollmatch_weight_syncs_total", committed)] == 1
    assert after[("rollmatch_weight_syncs_total", aborted)] == 1
    assert after[("rollmatch_weight_sync_bytes_total", (("mode", "full"), ("transport", "http")))] > 0
    assert after[("rollmatch_weight_sync_seconds_count", (("mode", "full"), ("transport", "http")))] == 1
    infer_ok = (("handler", "/infer/"), ("method", "POST"), ("status", "2xx"))
    assert after[("http_requests_total", infer_ok)] == 1


def test_metrics_needs_the_bearer_token(cfg: ServerConfig, engine: FakeEngine) -> None:
    cfg = ServerConfig.model_validate({**cfg.model_dump(), "auth_token": "s3cret"})
    with TestClient(create_app(cfg, engine)) as client:
        assert client.get("/metrics").status_code == 401
        assert client.get("/health").status_code == 200
        assert scrape(client, Authorization="Bearer s3cret")[("rollmatch_weight_version", ())] == 0
