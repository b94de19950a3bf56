"""`scripts/start_rollout_server.sh`: port preflight and early-death exit codes
(docs/ALGORITHM.md#grpo-launchers GRPO §6.1, §8).

No engine is started: the port test stops at the preflight, the death test points the HF backend at an
empty model directory so the server exits while loading.
"""

from __future__ import annotations

import os
import socket
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SCRIPT = REPO / "scripts" / "start_rollout_server.sh"


def config(tmp_path: Path, port: int, backend: str = "hf") -> Path:
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    path = tmp_path / "server.yaml"
    path.write_text(f"server:\n  model: {model}\n  backend: {backend}\n  port: {port}\n")
    return path


def run_launcher(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "http_proxy": "http://proxy.invalid:1"}
    return subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )


def test_port_in_use_exits_100_and_holder_survives(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = run_launcher(
            "--config", str(config(tmp_path, 1)), "--port", str(port), "--log-dir", str(tmp_path)
        )
        assert result.returncode == 100, result.stderr
        assert f"port {port} on 127.0.0.1 is already in use" in result.stderr
        # the holder still listens: a client can connect
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            pass
    assert not list(tmp_path.glob("*.log"))  # nothing was started


def test_invalid_config_exits_2(tmp_path: Path) -> None:
    result = run_launcher("--config", str(config(tmp_path, 8000)), "--host", "0.0.0.0")
    assert result.returncode == 2
    assert "server.host" in result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.mark.slow
def test_server_death_before_ready_exits_102(tmp_path: Path) -> None:
    port = free_port()
    result = run_launcher(
        "--config", str(config(tmp_path, port)), "--log-dir", str(tmp_path), "--wait-interval", "0.5"
    )
    assert result.returncode == 102, result.stdout + result.stderr
    assert "exited before becoming healthy" in result.stderr
    assert "engine failed to load" in result.stderr  # the log tail


@pytest.mark.slow
def test_wait_timeout_exits_101_stopping_only_its_own_group(tmp_path: Path) -> None:
    decoy = subprocess.Popen(["sleep", "120"], start_new_session=True)
    try:
        port = free_port()
        # A zero wait timeout expires at the first poll:
        # the server (python start-up alone takes longer) is stopped.
        result = run_launcher(
            "--config", str(config(tmp_path, port)), "--log-dir", str(tmp_path), "--wait-timeout", "0"
        )
        assert result.returncode == 101, result.stdout + result.stderr
        assert "not healthy after 0 s" in result.stderr
        (pid_file,) = tmp_path.glob("*.pid")
        server_pid = int(dict(line.split("=") for line in pid_file.read_text().split())["pid"])
        with pytest.raises(ProcessLookupError):
            os.kill(server_pid, 0)
        assert decoy.poll() is None  # another process group is never signalled
    finally:
        decoy.kill()
        decoy.wait()
