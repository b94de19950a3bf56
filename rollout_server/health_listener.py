"""Probes that never wait behind generation: a small HTTP listener in a process of its own
(`server.health_port`).

The main port's routes run on the asyncio event loop; when the loop is busy (a long prefill's Python side, a
large request body being parsed, a sync's validation) a probe there waits with it — measured 1–3 s under a
saturated CPU. A thread in the server process is not enough: it still needs the GIL, and measured with the CPU
saturated its p99 was no better than the main port's (bench/RESULTS.md). So the listener is a child process
that imports only the standard library, answers on one thread, raises its own scheduling priority when allowed
(SCHED_RR 1, else nice -10: `_raise_priority`), and answers from a snapshot FILE the event loop rewrites every
0.2 s (`HealthListener.publish`, atomic rename on tmpfs); a probe never needs the server's loop, GIL or
memory. It serves (GET only, no auth, like `/health`):

| path | 200 when | body |
|---|---|---|
| `/health/live` | the server process is alive | `{"status": "alive", "uptime_s", "snapshot_age_s"}` |
| `/health/ready` | the engine is loaded and `ok`, and no weight update is being applied | `/health`'s body |
| `/health`, `/health/` | as the main port's `/health`: the engine is loaded and `ok` | the `/health` body |

Liveness is the server process being alive (the child checks its parent; it exits when the parent is gone);
readiness is what the engine can do. `snapshot_age_s` says how long ago the event loop last wrote the
snapshot: a growing age with live answers means a stuck loop, which an orchestrator may act on (the listener
never judges it). Everything else is 404 in the error envelope.

Run as `python -m rollout_server.health_listener --host H --port P --snapshot FILE --parent PID --started T`
(the server does this; `HealthListener` below is the server's side).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Any

__all__ = ["HealthListener", "answer"]

READY_LINE = "health-listener ready"


def answer(
    path: str, snapshot: dict[str, Any] | None, started: float, now: float
) -> tuple[int, dict[str, Any]]:
    """Status and JSON body of one GET (pure).

    Args:
        path: the request path (a query string is ignored).
        snapshot: `{"health": <the /health body>, "applying": bool, "taken_at": monotonic s}`, or None before
            the first one.
        started: `time.monotonic()` at server start.
        now: `time.monotonic()` now.
    """
    path = path.split("?", 1)[0]
    if path == "/health/live":
        age = round(now - snapshot["taken_at"], 3) if snapshot else None
        return 200, {"status": "alive", "uptime_s": round(now - started, 3), "snapshot_age_s": age}
    if path in {"/health", "/health/", "/health/ready"}:
        if snapshot is None:
            return 503, {"status": "loading", "detail": "the server is starting"}
        body = dict(snapshot["health"])
        healthy = body.get("status") == "ok"
        if path != "/health/ready":
            return (200 if healthy else 503), body
        if snapshot["applying"]:
            body["detail"] = "a weight update is being applied"
        return (200 if healthy and not snapshot["applying"] else 503), body
    return 404, {
        "error": {
            "type": "not_found",
            "message": f"{path} is not served on the health port; use /health/live, /health/ready or /health",
            "detail": None,
        }
    }


class HealthListener:
    """The server's handle on the listener process: starts it, publishes snapshots, stops it.

    Args:
        host: bind address (the server's).
        port: `server.health_port` (0: any free port, for tests).
        started: `time.monotonic()` at server start (for `uptime_s`).
    """

    def __init__(self, host: str, port: int, started: float) -> None:
        self._host, self._requested_port, self._started = host, port, started
        parent = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
        self._dir = Path(tempfile.mkdtemp(prefix="rollmatch-health-", dir=parent))
        self.snapshot_path = self._dir / "snapshot.json"
        self._proc: subprocess.Popen[str] | None = None
        self.port = port
        """The bound port (known after `start`)."""
        self.scheduling = "unknown"
        """What priority the listener got: "SCHED_RR 1", "nice -10" or "unchanged" (known after `start`)."""

    def start(self, timeout_s: float = 30.0) -> None:
        """Starts the listener process and waits until it is bound (liveness answers while the engine loads).

        Raises:
            OSError: the port cannot be bound, or the listener did not come up within `timeout_s`.
        """
        self._proc = subprocess.Popen(
            [
                sys.executable, "-m", "rollout_server.health_listener", "--host", self._host,
                "--port", str(self._requested_port), "--snapshot", str(self.snapshot_path),
                "--parent", str(os.getpid()), "--started", repr(self._started),
            ],
            stdout=subprocess.PIPE,
            text=True,
        )  # fmt: skip
        line: list[str] = []
        reader = threading.Thread(target=lambda: line.append(self._proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
        reader.start()
        reader.join(timeout_s)
        if not line or not line[0].startswith(READY_LINE):
            self.stop()
            raise OSError(
                f"the health listener on {self._host}:{self._requested_port} did not start (port in use?)"
            )
        words = line[0].split()
        self.port = int(words[-1])
        self.scheduling = words[-2].removeprefix("scheduling=").replace("+", " ")

    @property
    def pid(self) -> int | None:
        """The listener process's id (None before `start`)."""
        return None if self._proc is None else self._proc.pid

    def publish(self, health: dict[str, Any], applying: bool) -> None:
        """Replaces the snapshot the listener answers from (atomic: write, then rename)."""
        tmp = self.snapshot_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"health": health, "applying": applying, "taken_at": time.monotonic()}))
        os.replace(tmp, self.snapshot_path)

    def stop(self) -> None:
        """Stops the listener process and removes the snapshot (idempotent)."""
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        for path in self._dir.glob("*"):
            path.unlink(missing_ok=True)
        self._dir.rmdir() if self._dir.exists() else None


def _raise_priority() -> str:
    """Best effort, so a saturated host still runs the probe answer at once; returns what it got.

    First choice is SCHED_RR at the lowest real-time priority (1): the listener sleeps in `accept` and each
    answer is a file read and a few hundred bytes, so it preempts the engine and the clients only for those
    microseconds, and the kernel's real-time throttling (`sched_rt_runtime_us`, 95 % by default) bounds even a
    runaway. Measured with the CPU saturated (bench/bench_load.py), nice -10 alone left a p99 of 140-340 ms:
    CFS still makes a woken task wait for the running one's slice. Without CAP_SYS_NICE (or root) it falls
    back to nice -10, then to the server's priority, and says so on stderr.
    """
    try:
        os.sched_setscheduler(0, os.SCHED_RR, os.sched_param(1))
        return "SCHED_RR 1"
    except (OSError, AttributeError) as exc:
        realtime_error = exc
    try:
        os.setpriority(os.PRIO_PROCESS, 0, -10)
        return "nice -10"
    except OSError as exc:
        print(
            f"health listener: priority unchanged (SCHED_RR: {realtime_error}; nice: {exc});"
            " probes may wait on a saturated host: grant CAP_SYS_NICE to the server's container",
            file=sys.stderr,
        )
        return "unchanged"


def _serve(host: str, port: int, snapshot_path: Path, parent: int, started: float) -> None:
    priority = _raise_priority()

    def read_snapshot() -> dict[str, Any] | None:
        try:
            return json.loads(snapshot_path.read_text())
        except (OSError, ValueError):
            return None

    class Handler(BaseHTTPRequestHandler):
        timeout = 1.0

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            status, body = answer(self.path, read_snapshot(), started, time.monotonic())
            payload = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: keep quiet
            return

    # One thread answers every probe in turn (each answer is a file read and a few hundred bytes): no thread
    # to start per probe, which measured slower under a saturated CPU; a client that stalls mid-request is cut
    # off after a second (`Handler.timeout`), so it cannot hold the others up for longer.
    server = HTTPServer((host, port), Handler)

    def watch_parent() -> None:  # the server is gone: so are we (liveness must not outlive it)
        while os.getppid() == parent:
            time.sleep(0.5)
        server.shutdown()

    threading.Thread(target=watch_parent, daemon=True).start()
    print(f"{READY_LINE} scheduling={priority.replace(' ', '+')} {server.server_address[1]}", flush=True)
    server.serve_forever()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="rollmatch probe listener (started by the rollout server)")
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--snapshot", type=Path, required=True)
    parser.add_argument("--parent", type=int, required=True)
    parser.add_argument("--started", type=float, required=True)
    args = parser.parse_args(argv)
    try:
        _serve(args.host, args.port, args.snapshot, args.parent, args.started)
    except OSError as exc:
        print(f"health listener: {exc}", file=sys.stderr, flush=True)
        return 100
    return 0


if __name__ == "__main__":
    sys.exit(main())
