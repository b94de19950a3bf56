"""Helpers the end-to-end benches share: a free loopback port, waiting for the server launcher, stopping it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["free_port", "stop", "wait_ready"]


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
