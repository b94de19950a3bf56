"""A recording HTTP proxy for the GRPO integration tests: forwards every request to a real rollout server
unchanged and records what the server saw (generate requests and their results, sync phases), so the tests
can check the learner's traffic per step without touching the server or the learner.
"""

from __future__ import annotations

import json
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

__all__ = ["Event", "RecordingProxy"]

_FORWARDED_HEADERS = ("content-type", "authorization")


@dataclass
class Event:
    """One request the server answered.

    Attributes:
        kind: ``infer``, ``sync_begin``, ``sync_bucket``, ``sync_commit``, ``sync_abort`` or ``health``.
        status: the server's HTTP status.
        request: the decoded JSON body (None for buckets and GETs).
        response: the decoded JSON response (None when not JSON).
    """

    kind: str
    status: int
    request: dict[str, Any] | None = None
    response: dict[str, Any] | None = field(default=None, repr=False)


def _kind(method: str, path: str) -> str:
    if path.rstrip("/") == "/infer":
        return "infer"
    if path.startswith("/sync_weights/"):
        tail = path.removeprefix("/sync_weights/")
        if tail in ("begin", "commit", "abort"):
            return f"sync_{tail}"
        return "sync_bucket"
    return "health" if path.startswith("/health") else f"{method.lower()}:{path}"


class RecordingProxy:
    """``http://127.0.0.1:<port>`` → ``target``; ``events`` lists what was forwarded, in arrival order."""

    def __init__(self, target: str) -> None:
        self.target = target.rstrip("/")
        self.events: list[Event] = []
        self._lock = threading.Lock()
        self._client = httpx.Client(timeout=httpx.Timeout(600.0, connect=10.0), trust_env=False)
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _forward(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                body = self.rfile.read(length) if length else b""
                headers = {k: v for k, v in self.headers.items() if k.lower() in _FORWARDED_HEADERS}
                upstream = proxy._client.request(
                    self.command, proxy.target + self.path, content=body, headers=headers
                )
                proxy._record(self.command, self.path, body, upstream)
                self.send_response(upstream.status_code)
                self.send_header("content-type", upstream.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(upstream.content)))
                self.end_headers()
                self.wfile.write(upstream.content)

            do_GET = do_POST = do_PUT = do_DELETE = _forward

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - stdlib signature
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}"

    @property
    def port(self) -> int:
        return int(self._server.server_address[1])

    def _record(self, method: str, path: str, body: bytes, upstream: httpx.Response) -> None:
        kind = _kind(method, path)
        if kind in ("health", "sync_bucket"):
            request = None
        else:
            request = json.loads(body) if body else None
        try:
            response = upstream.json()
        except ValueError:
            response = None
        with self._lock:
            self.events.append(Event(kind, upstream.status_code, request, response))

    def take(self) -> list[Event]:
        """The events so far (health polls dropped), clearing the record."""
        with self._lock:
            events, self.events = self.events, []
        return [e for e in events if e.kind != "health"]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._client.close()
