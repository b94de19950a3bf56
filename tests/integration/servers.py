"""The one process handling of the integration tests' rollout servers: `python -m rollout_server --config …`
subprocesses on free loopback ports, in their own session (process group), logging to a file.

The callers write their own server YAML (`conftest.start_server`: the session fixtures' vLLM/VLM servers;
`learner_fixtures.spawn_server`: the learner-loop servers) and hand it to `spawn`; `wait_healthy` waits until
every `/health` answers 200 within `SERVER_DEADLINE_S` (`ROLLMATCH_SERVER_DEADLINE_S`). A server is stopped by
its own pid (SIGTERM, then SIGKILL of its own process group after a grace period) or killed as a crash would
(SIGKILL of the group).
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

__all__ = [
    "REPO",
    "SERVER_DEADLINE_S",
    "SHIM_DIR",
    "ServerProcess",
    "free_port",
    "server_env",
    "spawn",
    "wait_healthy",
]

REPO = Path(__file__).resolve().parents[2]
SHIM_DIR = REPO / "shared_schemas" / "vlm_shim"
SERVER_DEADLINE_S = float(os.environ.get("ROLLMATCH_SERVER_DEADLINE_S", "300"))
"""Seconds a server may take to become healthy (engine start is ~20 s alone, minutes on a busy machine)."""
STOP_GRACE_S = 60
"""Seconds a SIGTERM'd server may take to close its engines before its group is SIGKILLed."""


def free_port() -> int:
    """A free TCP port on 127.0.0.1."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class ServerProcess:
    """One `python -m rollout_server` subprocess."""

    name: str
    base_url: str
    proc: subprocess.Popen[bytes]
    log: Path
    shm_dir: Path
    backend: str = "vllm"
    started_s: float = 0.0
    """Seconds from spawn to healthy (set by `wait_healthy`)."""
    stopped: bool = False
    spawned_at: float = field(default_factory=time.monotonic)
    """`time.monotonic()` at spawn."""

    def url(self, path: str) -> str:
        """Absolute URL of a route."""
        return self.base_url + path

    def health(self) -> dict[str, Any]:
        """The `/health` body."""
        return httpx.get(self.url("/health"), timeout=10).json()

    def weight_version(self) -> int:
        """The served weight version (one per applied sync)."""
        return int(self.health()["weight_version"])

    def log_tail(self, chars: int = 4000) -> str:
        """The end of the server's log (for assertion messages)."""
        return self.log.read_text(errors="replace")[-chars:]

    def kill(self) -> None:
        """SIGKILL of the server's group, as a crash would (the tests' "server dies mid-run")."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.stopped = True

    def stop(self) -> None:
        """SIGTERM to the server's own pid (it closes its engines); SIGKILL of its group after
        `STOP_GRACE_S`, or at once if it had already exited (its vLLM children may outlive it); idempotent."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(STOP_GRACE_S)
                self.stopped = True
                return
            except subprocess.TimeoutExpired:
                pass
        try:  # the server's own session: its vLLM children only
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.stopped = True


def server_env(*, vlm: bool = False) -> dict[str, str]:
    """Environment of a server subprocess: no proxies, the repo (and the VLM shim) importable everywhere."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    paths = [str(REPO)] + ([str(SHIM_DIR)] if vlm else [])
    if env.get("PYTHONPATH"):
        paths.append(env["PYTHONPATH"])
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    return env


def spawn(
    name: str,
    config: Path,
    log: Path,
    *,
    port: int,
    shm_dir: Path,
    backend: str = "vllm",
    vlm: bool = False,
    args: tuple[str, ...] = (),
) -> ServerProcess:
    """Starts `python -m rollout_server --config config *args` in its own session, without waiting for it.

    Args:
        name: label used in messages.
        config: the server YAML (it names `port` and `shm_dir`).
        log: file for the server's stdout and stderr.
        port: the loopback port in `config`.
        shm_dir: the shm staging dir in `config`.
        backend: `server.backend` in `config`.
        vlm: put the torchvision-free shim on PYTHONPATH (Qwen-VL models).
        args: more command-line arguments.
    """
    with log.open("w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "rollout_server", "--config", str(config), *args],
            cwd=REPO,
            stdout=out,
            stderr=subprocess.STDOUT,
            env=server_env(vlm=vlm),
            start_new_session=True,
        )
    return ServerProcess(name, f"http://127.0.0.1:{port}", proc, log, shm_dir, backend)


def wait_healthy(servers: list[ServerProcess], deadline_s: float | None = None) -> None:
    """Waits until every server's `/health` is 200 (they start side by side) and sets their `started_s`; a
    failure stops them all.

    Args:
        servers: spawned servers.
        deadline_s: seconds from now (default `SERVER_DEADLINE_S`).

    Raises:
        AssertionError: a process exited or was not healthy within `deadline_s` (its log tail included).
    """
    deadline_s = SERVER_DEADLINE_S if deadline_s is None else deadline_s
    deadline = time.monotonic() + deadline_s
    waiting = list(servers)
    while waiting:
        server = waiting[0]
        problem = None
        if server.proc.poll() is not None:
            problem = f"server {server.name} exited with {server.proc.returncode}"
        else:
            try:
                if httpx.get(server.url("/health"), timeout=2).status_code == 200:
                    server.started_s = time.monotonic() - server.spawned_at
                    waiting.pop(0)
                    continue
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                problem = f"server {server.name} not healthy within {deadline_s:.0f} s"
        if problem is not None:
            for other in servers:
                other.stop()
            raise AssertionError(f"{problem}:\n{server.log_tail()}")
        time.sleep(0.25)
