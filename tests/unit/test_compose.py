"""compose.yaml and the Dockerfile: structure only (Docker cannot run here), checked against the config they
start, so the healthcheck port, the shared shm directory and the GPU split cannot drift from the YAML."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from learner.config import load_run_config
from rollout_server.config import load_server_config

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compose() -> dict:
    return yaml.safe_load((REPO / "compose.yaml").read_text())


def _default_config(compose: dict) -> Path:
    value = compose["services"]["learner"]["environment"]["ROLLMATCH_CONFIG"]
    match = re.fullmatch(r"\$\{ROLLMATCH_CONFIG:-(.+)\}", value)
    assert match, f"ROLLMATCH_CONFIG {value!r} should default to a config path"
    return REPO / match.group(1)


def _devices(service: dict) -> list[str]:
    devices = service["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1 and devices[0]["driver"] == "nvidia" and "gpu" in devices[0]["capabilities"]
    return devices[0]["device_ids"]


def test_two_services_from_one_image(compose: dict) -> None:
    services = compose["services"]
    assert set(services) == {"rollout-server", "learner"}
    builds = {(s["build"]["context"], s["build"]["dockerfile"], s["image"]) for s in services.values()}
    assert len(builds) == 1
    dockerfile = (REPO / services["learner"]["build"]["dockerfile"]).read_text()
    assert re.search(r"^FROM python:3\.11-slim\b", dockerfile, re.M)
    assert 'pip install -e ".[gpu]"' in dockerfile
    assert "curl" in dockerfile  # the healthcheck runs curl inside the server's container
    assert "python -m rollout_server" in " ".join(services["rollout-server"]["command"])
    assert "python -m learner" in " ".join(services["learner"]["command"])


def test_gpu_reservations_are_disjoint(compose: dict) -> None:
    server = _devices(compose["services"]["rollout-server"])
    learner = _devices(compose["services"]["learner"])
    assert server == ["0", "1", "2"] and learner == ["3"]
    assert not set(server) & set(learner)


def test_healthcheck_and_start_order(compose: dict) -> None:
    server = compose["services"]["rollout-server"]
    test = server["healthcheck"]["test"]
    assert test[:3] == ["CMD", "curl", "-f"]
    match = re.fullmatch(r"http://127\.0\.0\.1:(\d+)/health/ready", test[3])
    assert match, test
    cfg = load_server_config(_default_config(compose), overrides={"model": str(REPO)})
    assert int(match.group(1)) == cfg.health_port, "healthcheck port must be server.health_port of the config"
    # The container sees its reserved GPUs renumbered from 0.
    assert cfg.gpus == tuple(range(len(_devices(server))))
    assert compose["services"]["learner"]["depends_on"] == {
        "rollout-server": {"condition": "service_healthy"}
    }


def test_network_and_loopback_bind(compose: dict) -> None:
    cfg_path = _default_config(compose)
    server = load_server_config(cfg_path, overrides={"model": str(REPO)})
    run = load_run_config(cfg_path, overrides={"model": {"path": str(REPO)}})
    modes = {s.get("network_mode") for s in compose["services"].values()}
    if modes == {"host"}:
        # Shared host network: the server keeps its loopback bind and the learner uses 127.0.0.1.
        assert server.host in ("127.0.0.1", "localhost", "::1")
        assert all(s.base_url.startswith(f"http://127.0.0.1:{server.port}") for s in run.rollout.servers)
    else:
        # Bridge: the server must bind every interface, which the config only allows when told so.
        assert server.host == "0.0.0.0" and server.allow_non_loopback
        assert "ports" not in compose["services"]["rollout-server"]


def test_shared_shm_volume_and_the_sync_transport(compose: dict) -> None:
    cfg_path = _default_config(compose)
    server = load_server_config(cfg_path, overrides={"model": str(REPO)})
    run = load_run_config(cfg_path, overrides={"model": {"path": str(REPO)}})
    assert run.rollout.sync.transport in ("shm", "nccl")
    if run.rollout.sync.transport == "shm":
        assert server.shm_dir == run.rollout.sync.shm_dir
    else:  # nccl between the two containers: one IPC namespace for NCCL's GPU-to-GPU and shared-memory paths
        assert all(s.get("ipc") == "host" for s in compose["services"].values())
    for name, service in compose["services"].items():
        mounts = dict(v.split(":")[:2] for v in service["volumes"])
        assert mounts.get("rollmatch-shm") == server.shm_dir, name
    assert compose["volumes"]["rollmatch-shm"]["driver_opts"]["type"] == "tmpfs"
