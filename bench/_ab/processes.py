"""The harness's child processes: one learner run (``python -m learner``) and the task's rollout server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

from _ab.tables import PY, REPO

SHM_DIR = f"/dev/shm/rollmatch-ab-{os.getpid()}"
"""The harness's server and learners share this staging dir (shm syncs), apart from any other server's."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_learner(config: dict[str, Any], path: Path, log: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    with log.open("w") as fh:
        rc = subprocess.run(
            [PY, "-m", "learner", "--config", str(path)],
            cwd=REPO,
            env=env,
            stdout=fh,
            stderr=subprocess.STDOUT,
        ).returncode
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"learner run {path} failed with exit code {rc}; log {log}:\n{tail}")


def start_server(task_config: Path, model: Path, out: Path) -> tuple[subprocess.Popen, str]:
    """The task's rollout server (its ``server:`` section) on the base checkpoint, on a free port."""
    port = free_port()
    cfg = {
        "extends": str(REPO / task_config),
        "server": {"port": port, "model": str(model), "shm_dir": SHM_DIR},
    }
    path = out / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    log = (out / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    proc = subprocess.Popen(
        ["bash", str(REPO / "scripts/start_rollout_server.sh"), "--config", str(path), "--port", str(port)],
        cwd=REPO,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"rollout server exited with {proc.returncode}; see {out / 'server.log'}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(2)
    proc.terminate()
    raise SystemExit(f"rollout server on {url} not healthy after 300 s; see {out / 'server.log'}")


def stop_server(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    except (ProcessLookupError, subprocess.TimeoutExpired):
        os.killpg(proc.pid, signal.SIGKILL)
