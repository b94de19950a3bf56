"""Helpers the end-to-end benches share: the Python to run, a free loopback port, waiting for the server
launcher, stopping it, and signals that unwind through the caller's `finally`."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

__all__ = ["exit_on_signals", "free_port", "repo_python", "stop", "wait_ready"]


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
