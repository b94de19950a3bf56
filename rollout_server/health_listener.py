"""Probes that never wait behind generation: a small HTTP listener on a thread of its own (`server.health_port`).

The main port's routes run on the asyncio event loop; when the loop is busy (a long prefill's Python side, a
large request body being parsed, a sync's validation) a probe there waits with them — measured 1–3 s under a
saturated CPU. This listener answers from its own thread and socket, from a snapshot the event loop refreshes
(`HealthSnapshot`), so an answer never needs the loop. What it serves (GET only, no auth, like `/health`):

| path | 200 when | body |
|---|---|---|
| `/health/live` | the process is up (always, when it answers) | `{"status": "alive", "uptime_s", "snapshot_age_s"}` |
| `/health/ready` | the engine is loaded and `ok`, and no weight update is being applied | the `/health` body |
| `/health`, `/health/` | as the main port's `/health`: the engine is loaded and `ok` | the `/health` body |

Liveness is the process answering; readiness is what the engine can do. `snapshot_age_s` says how long ago
the event loop last refreshed the snapshot: a growing age with live answers means a stuck loop, which an
orchestrator may treat as it likes (the listener itself never judges it). Everything else is 404 in the
DESIGN error envelope.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from shared_schemas.health import Health

__all__ = ["HealthListener", "HealthSnapshot"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class HealthSnapshot:
    """What the probes answer from: the `/health` body, whether an update is being applied, and when.

    Attributes:
        health: the body the main port's `/health` would return now.
        applying: True while a weight update is being applied (not ready).
        taken_at: `time.monotonic()` when the event loop took it.
    """

    health: Health
    applying: bool
    taken_at: float

    @property
    def ready(self) -> bool:
        """Loaded, healthy and not mid-apply."""
        return self.health.status == "ok" and not self.applying


class HealthListener:
    """Serves the probes of the table above on `host:port` from a daemon thread.

    Args:
        host: bind address (the server's).
        port: `server.health_port`.
        started: `time.monotonic()` at server start (for `uptime_s`).
    """

    def __init__(self, host: str, port: int, started: float) -> None:
        self._started = started
        self.snapshot: HealthSnapshot | None = None
        """Replaced (never mutated) by the event loop; read by the listener thread."""
        listener = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's naming
                status, body = listener.answer(self.path)
                payload = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(payload)))
                self.end_headers()
                self.wfile.write(payload)

            def log_message(self, format: str, *args: Any) -> None:  # probes every few seconds: keep quiet
                return

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="health-listener", daemon=True
        )

    @property
    def port(self) -> int:
        """The bound port."""
        return self._server.server_address[1]

    def start(self) -> None:
        """Starts answering (before the engine loads: liveness holds during loading)."""
        self._thread.start()
        logger.info(
            "health probes on http://%s:%d/health/{live,ready}", self._server.server_address[0], self.port
        )

    def stop(self) -> None:
        """Stops the listener (idempotent)."""
        if self._thread.is_alive():
            self._server.shutdown()
        self._server.server_close()

    def answer(self, path: str) -> tuple[int, dict[str, Any]]:
        """Status and JSON body for one GET of `path` (pure: reads the current snapshot only)."""
        path = path.split("?", 1)[0]
        snapshot = self.snapshot
        now = time.monotonic()
        if path == "/health/live":
            age = round(now - snapshot.taken_at, 3) if snapshot else None
            return 200, {"status": "alive", "uptime_s": round(now - self._started, 3), "snapshot_age_s": age}
        if path in {"/health", "/health/", "/health/ready"}:
            if snapshot is None:
                return 503, {"status": "loading", "detail": "the server is starting"}
            ok = snapshot.ready if path == "/health/ready" else snapshot.health.status == "ok"
            body = snapshot.health.model_dump(mode="json")
            if snapshot.applying and path == "/health/ready":
                body["detail"] = "a weight update is being applied"
            return (200 if ok else 503), body
        return 404, {
            "error": {
                "type": "not_found",
                "message": f"{path} is not served on the health port; use /health/live, /health/ready or /health",
            }
        }
