"""Fixtures for rollout-server unit tests: a config, a fake engine and a TestClient around `create_app`."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from tests.unit.rollout_server.fakes import FakeEngine


@pytest.fixture
def shm_dir(tmp_path: Path) -> Path:
    path = tmp_path / "shm"
    path.mkdir()
    return path


@pytest.fixture
def cfg(shm_dir: Path) -> ServerConfig:
    return ServerConfig(model="/models/fake", max_body_mb=1, shm_dir=str(shm_dir), vllm={"max_model_len": 64})


@pytest.fixture
def engine() -> FakeEngine:
    return FakeEngine()


@pytest.fixture
def client(cfg: ServerConfig, engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(cfg, engine=engine)) as test_client:
        yield test_client
