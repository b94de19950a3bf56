"""`scripts/start_learner.sh`: health timeout, config errors, flag plumbing (docs/ALGORITHM.md#grpo-launchers
GRPO §6.2, §8).

No server and no learner is ever started: the health tests point at a closed loopback port, the others stop at
config validation. The "starts nothing" checks look for the launcher's start line and for the run's output.
"""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "start_learner.sh"
TINY_GRPO = REPO / "configs" / "grpo_tiny_cpu.yaml"


def closed_port() -> int:
    """A loopback port nobody listens on (bound then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def grpo_config(tmp_path: Path, port: int, **extra: str) -> Path:
    """The tiny CPU GRPO config aimed at ``port``, with existing (empty) model dirs so rule 10 passes."""
    model = tmp_path / "model"
    model.mkdir(exist_ok=True)
    lines = [
        f"extends: {TINY_GRPO}",
        f"output_dir: {tmp_path / 'run'}",
        f"model: {{path: {model}}}",
        f"rollout: {{servers: [{{base_url: 'http://127.0.0.1:{port}'}}]}}",
        f"server: {{port: {port}, model: {model}, host: {extra.get('host', '127.0.0.1')}}}",
    ]
    path = tmp_path / "grpo.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def stage2_config(tmp_path: Path, port: int) -> Path:
    path = tmp_path / "stage2.yaml"
    path.write_text(
        f"model: {{path: {tmp_path / 'model'}}}\n"
        f"data: {{train: [{tmp_path / 'train.jsonl'}]}}\n"
        f"output_dir: {tmp_path / 'run'}\n"
        "rollout:\n  mode: server\n"
        f"  servers: [{{base_url: 'http://127.0.0.1:{port}'}}]\n"
    )
    return path


def run_launcher(*args: str, timeout: float = 240) -> tuple[subprocess.CompletedProcess[str], float]:
    env = {**os.environ, "http_proxy": "http://proxy.invalid:1", "HTTPS_PROXY": "http://proxy.invalid:1"}
    started = time.monotonic()
    result = subprocess.run(
        ["bash", str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env
    )
    return result, time.monotonic() - started


@pytest.mark.parametrize("kind", ["grpo", "stage2"])
def test_health_timeout_exits_101_and_starts_nothing(tmp_path: Path, kind: str) -> None:
    """§8: against a closed port with wait_timeout 3 the launcher exits 101 after 3 s, starting nothing."""
    port = closed_port()
    config = grpo_config(tmp_path, port) if kind == "grpo" else stage2_config(tmp_path, port)
    result, elapsed = run_launcher("--config", str(config), "--wait-timeout", "3", "--wait-interval", "2")
    assert result.returncode == 101, result.stdout + result.stderr
    assert (
        f"rollout server at 127.0.0.1:{port} (http://127.0.0.1:{port}/health) not healthy after 3 s"
        in result.stderr
    )
    assert "scripts/start_rollout_server.sh" in result.stderr
    assert "starting learner" not in result.stdout
    assert not (tmp_path / "run").exists()
    if kind == "grpo":
        # >= 3: --wait-timeout 3 honoured; < 3 + 60 only catches a hang (wall time is no correctness check).
        assert 3 <= elapsed < 3 + 60, f"took {elapsed:.1f} s"
    # stage-2 configs are validated by learner.config (imports torch: tens of seconds on a loaded host), so
    # only the exit code and the message are checked there; the deadline counts from the launcher's start.


def test_invalid_grpo_config_exits_2_before_any_health_check(tmp_path: Path) -> None:
    port = closed_port()
    result, _ = run_launcher(
        "--config", str(grpo_config(tmp_path, port, host="0.0.0.0")), "--wait-timeout", "30"
    )
    assert result.returncode == 2, result.stderr
    assert "server.host" in result.stderr and "rule 2" in result.stderr
    assert "not healthy" not in result.stderr


def test_gpus_flag_that_breaks_the_batch_rule_exits_2(tmp_path: Path) -> None:
    # 32 completions = 8 per device × 1 learner × gas 4: three learners cannot divide it (rule 8).
    result, _ = run_launcher("--config", str(grpo_config(tmp_path, closed_port())), "--gpus", "1,2,3")
    assert result.returncode == 2, result.stderr
    assert "rule 8" in result.stderr


def test_nproc_that_disagrees_with_gpus_exits_2(tmp_path: Path) -> None:
    result, _ = run_launcher(
        "--config", str(stage2_config(tmp_path, closed_port())), "--gpus", "0,1", "--nproc", "3"
    )
    assert result.returncode == 2
    assert "disagrees" in result.stderr


def test_missing_config_exits_2(tmp_path: Path) -> None:
    result, _ = run_launcher("--config", str(tmp_path / "nope.yaml"))
    assert result.returncode == 2
    assert "does not exist" in result.stderr
