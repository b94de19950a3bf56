"""The probe listener (`server.health_port`): liveness and readiness from a process of its own, answering
while the event loop is blocked (a real uvicorn server in a thread, a fake engine whose generation blocks the
loop)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import uvicorn

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from rollout_server.health_listener import HealthListener, answer
from shared_schemas.errors import ErrorEnvelope
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferResult
from tests.unit.rollout_server.fakes import FakeEngine

BLOCK_S = 2.0


def _health(status: str = "ok") -> Health:
    return Health(
        status=status, engine="vllm", model="m", weight_version=3, dp=1, tp=1, lora_enabled=False,
        max_model_len=64, uptime_s=1.0,
    )  # fmt: skip


def test_answers_from_the_snapshot_only() -> None:
    ok = _health().model_dump(mode="json")

    def snap(health: dict[str, Any], applying: bool = False) -> dict[str, Any]:
        return {"health": health, "applying": applying, "taken_at": 9.0}

    assert answer("/health/live", None, 0.0, 10.0) == (
        200,
        {"status": "alive", "uptime_s": 10.0, "snapshot_age_s": None},
    )
    assert answer("/health/live", snap(ok), 0.0, 10.0)[1]["snapshot_age_s"] == 1.0
    assert answer("/health/ready", None, 0.0, 1.0)[0] == 503 and answer("/health", None, 0.0, 1.0)[0] == 503
    assert answer("/health/ready", snap(ok), 0.0, 10.0) == (200, ok)
    assert answer("/health?x=1", snap(ok), 0.0, 10.0)[0] == 200
    status, body = answer("/health/ready", snap(ok, applying=True), 0.0, 10.0)
    assert status == 503 and "being applied" in body["detail"]
    assert (
        answer("/health", snap(ok, applying=True), 0.0, 10.0)[0] == 200
    )  # /health keeps the main port's meaning
    assert answer("/health/ready", snap(_health("loading").model_dump(mode="json")), 0.0, 10.0)[0] == 503
    status, body = answer("/nope", snap(ok), 0.0, 10.0)
    assert status == 404 and ErrorEnvelope.model_validate(body).error.type == "not_found"


def _kernel_grants_real_time() -> bool:
    """True when a child of this process may take SCHED_RR (asked in a throwaway child, not here)."""
    probe = "import os; os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))"
    return subprocess.run([sys.executable, "-c", probe], capture_output=True, timeout=30).returncode == 0


def test_the_listener_process_follows_the_published_snapshot_and_refuses_a_taken_port() -> None:
    listener = HealthListener("127.0.0.1", 0, time.monotonic())
    listener.start()
    try:
        url = f"http://127.0.0.1:{listener.port}"
        # the priority it asked for is the one the kernel gave its process, and real-time wherever
        # the kernel grants it to us (root alone is not enough: a container may lack CAP_SYS_NICE)
        pid = listener.pid
        expected = {os.SCHED_RR: "SCHED_RR 1", os.SCHED_OTHER: None}[os.sched_getscheduler(pid)]
        if expected is None:
            expected = "nice -10" if os.getpriority(os.PRIO_PROCESS, pid) == -10 else "unchanged"
        assert listener.scheduling == expected
        if _kernel_grants_real_time():
            assert listener.scheduling == "SCHED_RR 1"
        assert httpx.get(f"{url}/health/live").status_code == 200
        assert httpx.get(f"{url}/health/ready").status_code == 503  # nothing published yet
        listener.publish(_health().model_dump(mode="json"), applying=False)
        assert httpx.get(f"{url}/health/ready").json()["weight_version"] == 3
        listener.publish(_health().model_dump(mode="json"), applying=True)
        assert httpx.get(f"{url}/health/ready").status_code == 503
        taken = HealthListener("127.0.0.1", listener.port, time.monotonic())
        with pytest.raises(OSError, match="did not start"):
            taken.start()
    finally:
        listener.stop()
    with pytest.raises(httpx.ConnectError):
        httpx.get(f"{url}/health/live", timeout=5)


class LoopBlockingEngine(FakeEngine):
    """Generation that holds the event loop (what native code without an await does)."""

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        time.sleep(BLOCK_S)
        return await super().generate(batch)


@pytest.fixture()
def served(cfg: ServerConfig) -> Iterator[tuple[str, str]]:
    listener = HealthListener("127.0.0.1", 0, time.monotonic())
    listener.start()
    app = create_app(cfg, LoopBlockingEngine(), health_listener=listener)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}", f"http://127.0.0.1:{listener.port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        listener.stop()


def test_probes_answer_while_the_event_loop_is_blocked(served: tuple[str, str]) -> None:
    main, probes = served
    deadline = time.monotonic() + 10
    while httpx.get(f"{probes}/health/ready").status_code != 200:  # first snapshot
        assert time.monotonic() < deadline
        time.sleep(0.05)
    body: dict[str, Any] = {
        "infer_requests": [{"prompt_token_ids": [1, 2]}],
        "request_config": {"max_tokens": 2},
    }
    blocker = threading.Thread(target=lambda: httpx.post(f"{main}/infer/", json=body, timeout=30))
    blocker.start()
    time.sleep(0.3)  # the loop is inside the blocking generation now
    started = time.monotonic()
    live = httpx.get(f"{probes}/health/live", timeout=5)
    ready = httpx.get(f"{probes}/health/ready", timeout=5)
    probe_s = time.monotonic() - started
    started = time.monotonic()
    assert httpx.get(f"{main}/health", timeout=30).status_code == 200
    main_s = time.monotonic() - started
    blocker.join()
    assert live.status_code == 200 and live.json()["status"] == "alive" and ready.status_code == 200
    assert live.json()["snapshot_age_s"] > 0.1  # the loop has not refreshed it: it is busy
    assert probe_s < 0.5 * BLOCK_S < main_s  # the main port waited for the loop, the listener did not
