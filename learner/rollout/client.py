"""HTTP client of ONE rollout server — one method per route, schema models in and out.

`RolloutClient` owns one pooled `httpx.Client` with explicit timeouts (connect `min(10, timeout_s)`, read
`infer_timeout_s`), so a wedged server can never hang training. It never retries: the retry policy of
docs/ALGORITHM.md#chunking-and-retries lives in `learner.rollout.server_source.ServerRolloutSource`, the
`RolloutSource` over one or more servers (which re-exports this module's names). Weight-sync phases are
never retried. Errors are the typed ones of `learner.rollout.errors`.

Example:
    >>> with RolloutClient("http://127.0.0.1:8000", timeout_s=240) as client:  # doctest: +SKIP
    ...     client.wait_healthy(deadline_s=60)
    ...     results = client.infer(batch)
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import httpx

from learner.rollout.base import check_results
from learner.rollout.errors import ServerError, ServerNotReady, ServerUnreachable, error_from_response
from learner.weights.session import SyncSession
from shared_schemas import sync as wire
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferResponse, InferResult

logger = logging.getLogger(__name__)

__all__ = ["LAUNCH_HINT", "RolloutClient", "normalize_base_url"]

LAUNCH_HINT = "start it with scripts/start_rollout_server.sh --config <yaml> and check its log"
"""The fix named by every 'server not reachable' message."""

_HEALTH_POLL_S = 0.5
"""Pause between `/health` probes while waiting for a server."""

_SEND_CHUNK = 4 << 20
"""Bytes handed to the HTTP stack at a time when a bucket streams from its parts (cache-sized pieces)."""


def _chunks(parts: Sequence[memoryview]) -> Iterator[bytes]:
    # httpx/h11 join each chunk into bytes before the socket write: pieces of a few MiB keep that copy in
    # cache and the memory bounded.
    for part in parts:
        view = part.cast("B") if part.format != "B" else part
        for start in range(0, view.nbytes, _SEND_CHUNK):
            yield view[start : start + _SEND_CHUNK]  # type: ignore[misc]


def normalize_base_url(base_url: str) -> str:
    """`http(s)://host:port` with the trailing `/` stripped.

    Raises:
        ValueError: not an http(s) URL with a host.
    """
    url = httpx.URL(base_url.rstrip("/"))
    if url.scheme not in ("http", "https") or not url.host:
        raise ValueError(f"rollout server base_url {base_url!r} must look like http://host:port")
    return str(url).rstrip("/")


class RolloutClient:
    """Client of one rollout server: `/health`, `/infer/` and the `/sync_weights/` phases.

    Args:
        base_url: `http(s)://host:port` (a trailing `/` is stripped).
        timeout_s: connect timeout cap (`min(10, timeout_s)`), write/pool timeout, and the default
            deadline of `wait_healthy`.
        infer_timeout_s: read timeout of every call but `/health` (default `timeout_s`).
        auth_token: sent as `Authorization: Bearer <token>` when set.
        transport_factory: builds the httpx transport of each (re)connection; tests pass
            `lambda: httpx.MockTransport(handler)`. Default: httpx's pooled HTTP transport.

    Calls are thread-safe (httpx's pool is), `reconnect` is not; use it as a context manager or call
    `close()`. Its weight-sync side is the `learner.weights.session.SyncClient` a sync uses.
    """

    errors: ClassVar[tuple[type[Exception], ...]] = (ServerError, ServerUnreachable)
    """What a call raises when the server answers an error or does not answer (`SyncClient.errors`)."""

    def __init__(
        self,
        base_url: str,
        *,
        timeout_s: float = 240.0,
        infer_timeout_s: float | None = None,
        auth_token: str | None = None,
        transport_factory: Callable[[], httpx.BaseTransport] | None = None,
    ) -> None:
        if timeout_s <= 0 or (infer_timeout_s is not None and infer_timeout_s <= 0):
            raise ValueError(
                f"timeouts must be > 0, got timeout_s={timeout_s}, infer_timeout_s={infer_timeout_s}"
            )
        self.base_url = normalize_base_url(base_url)
        self.timeout_s = timeout_s
        self.infer_timeout_s = infer_timeout_s if infer_timeout_s is not None else timeout_s
        self._timeout = httpx.Timeout(
            connect=min(10.0, timeout_s), read=self.infer_timeout_s, write=timeout_s, pool=timeout_s
        )
        # /health must answer at once (it never waits on the engine), so a short read timeout.
        self._health_timeout = httpx.Timeout(min(10.0, timeout_s))
        self._headers = {"Authorization": f"Bearer {auth_token}"} if auth_token else {}
        self._transport_factory = transport_factory
        self._client = self._connect()
        # Calls in flight per pool: a retry's `reconnect` must not close a pool that another thread (a
        # background rollout, a sync from the main thread) still uses; the last caller closes a replaced pool.
        self._in_use: dict[int, int] = {}
        self._pool_lock = threading.Lock()

    def _connect(self) -> httpx.Client:
        transport = self._transport_factory() if self._transport_factory is not None else None
        # trust_env=False: a corporate proxy must never sit between the learner and its servers.
        return httpx.Client(
            base_url=self.base_url,
            timeout=self._timeout,
            headers=self._headers,
            transport=transport,
            trust_env=False,
        )

    def reconnect(self) -> None:
        """Drops every pooled connection; the next call opens a fresh one (the §5.5 retry). Calls still
        running on the old pool (other threads) finish on it; it is closed when the last of them returns."""
        with self._pool_lock:
            old, self._client = self._client, self._connect()
            idle = self._in_use.get(id(old), 0) == 0
        if idle:
            old.close()

    def close(self) -> None:
        """Closes the connection pool; idempotent."""
        self._client.close()

    def __enter__(self) -> RolloutClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RolloutClient({self.base_url!r})"

    def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP call, any status; no answer → `ServerUnreachable`."""
        with self._pool_lock:
            client = self._client
            self._in_use[id(client)] = self._in_use.get(id(client), 0) + 1
        try:
            return client.request(method, path, **kwargs)
        except httpx.TransportError as exc:
            connect_failed = isinstance(exc, httpx.ConnectError | httpx.ConnectTimeout)
            raise ServerUnreachable(
                f"rollout server {self.base_url} did not answer {method} {path}"
                f" ({type(exc).__name__}: {exc or 'no detail'}); is it running? {LAUNCH_HINT}",
                url=self.base_url,
                connect_failed=connect_failed,
            ) from exc
        finally:
            with self._pool_lock:
                left = self._in_use[id(client)] = self._in_use[id(client)] - 1
                if left == 0:
                    del self._in_use[id(client)]
            if left == 0 and client is not self._client:
                client.close()  # replaced by `reconnect` while this call ran

    def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        """One HTTP call; non-2xx → typed `ServerError`, no answer → `ServerUnreachable`."""
        response = self._send(method, path, **kwargs)
        if response.is_error:
            raise error_from_response(response)
        return response

    # -- /health ---------------------------------------------------------------------------------
    def health(self) -> Health:
        """`GET /health`: the server's status, also while it is loading (503 with the same body).

        Raises:
            ServerUnreachable: no answer.
            ServerError: an answer that is not a health body.
        """
        response = self._send("GET", "/health", timeout=self._health_timeout)
        if response.status_code in (200, 503):
            try:
                return Health.model_validate_json(response.content)
            except ValueError:
                pass  # not a health body (e.g. a proxy's 503 page): report it as an error below
        if response.is_success:
            raise ServerError(
                response.status_code,
                "bad_health",
                "/health answered without a health body",
                url=self.base_url,
            )
        raise error_from_response(response)

    def wait_healthy(self, deadline_s: float | None = None) -> Health:
        """Polls `/health` until the server reports `ok`.

        Args:
            deadline_s: overall seconds to wait (default `timeout_s`).

        Returns:
            The first `ok` health body.

        Raises:
            ServerUnreachable: never answered within the deadline.
            ServerNotReady: answered, but not `ok` within the deadline (or `error`: load failed).
        """
        deadline_s = self.timeout_s if deadline_s is None else deadline_s
        give_up = time.monotonic() + deadline_s
        last: Exception | Health | None = None
        while True:
            try:
                last = self.health()
                if last.status == "ok":
                    return last
                if last.status == "error":
                    break
            except (ServerUnreachable, ServerError) as exc:
                last = exc
            if time.monotonic() + _HEALTH_POLL_S > give_up:
                break
            time.sleep(_HEALTH_POLL_S)
        if isinstance(last, Health):
            raise ServerNotReady(
                503,
                "not_ready",
                f"rollout server {self.base_url} reports status {last.status!r} after {deadline_s:.0f} s"
                f" ({last.detail or 'no detail'}); {LAUNCH_HINT}",
                url=self.base_url,
            )
        raise ServerUnreachable(
            f"rollout server {self.base_url} not reachable within {deadline_s:.0f} s ({last}); {LAUNCH_HINT}",
            url=self.base_url,
            connect_failed=True,
        ) from last

    # -- /infer/ ---------------------------------------------------------------------------------
    def infer(self, batch: InferBatch) -> list[InferResult]:
        """`POST /infer/`: results in request order, checked by index and request id.

        An empty batch returns `[]` without any HTTP call.

        Raises:
            ServerError / ServerUnreachable: the call failed (no retry here).
            ResultMismatchError: the server's results do not answer the batch one-to-one.
        """
        if not batch.infer_requests:
            return []
        response = self._request("POST", "/infer/", json=batch.model_dump(mode="json", exclude_none=True))
        return check_results(batch, InferResponse.model_validate_json(response.content).results)

    # -- /sync_weights/ --------------------------------------------------------------------------
    def sync_begin(
        self,
        manifest: wire.SyncManifest,
        *,
        timeout_s: float | None = None,
        collective: wire.CollectiveSpec | None = None,
    ) -> wire.SyncBeginResponse:
        """Opens a sync: the server validates names, dtypes, shapes, version and LoRA up front. With
        `collective`, its receivers start joining that group (the buckets are then broadcast, not uploaded).

        Raises:
            ServerConflict: 409 (`lora_disabled` for an adapter sync without LoRA, `stale_version`).
            ServerError: 400 (`unknown_parameter`, `parameter_mismatch`) and others.
        """
        body = wire.SyncBeginRequest(manifest=manifest, timeout_s=timeout_s, collective=collective)
        response = self._request("POST", wire.SYNC_BEGIN_PATH, json=body.model_dump(mode="json"))
        return wire.SyncBeginResponse.model_validate_json(response.content)

    def upload_bucket(self, sync_id: str, index: int, data: bytes | Sequence[memoryview]) -> wire.BucketAck:
        """Sends one safetensors bucket as the request body: a blob, or its parts (header, then each tensor's
        bytes), streamed from the caller's memory with an exact `Content-Length` (no assembled copy)."""
        if isinstance(data, bytes | bytearray | memoryview):
            content: bytes | Iterator[bytes] = bytes(data)
            length = len(content)
        else:
            content = _chunks(data)
            length = sum(part.nbytes for part in data)
        response = self._request(
            "PUT",
            wire.BUCKET_PATH.format(sync_id=sync_id, index=index),
            content=content,
            headers={"Content-Type": "application/octet-stream", "Content-Length": str(length)},
        )
        return wire.BucketAck.model_validate_json(response.content)

    def upload_bucket_shm(self, sync_id: str, index: int, file_name: str) -> wire.BucketAck:
        """Names one bucket file already written into the server's staging directory (same host)."""
        body = wire.ShmBucketRef(file_name=file_name)
        response = self._request(
            "POST",
            wire.BUCKET_SHM_PATH.format(sync_id=sync_id, index=index),
            json=body.model_dump(mode="json"),
        )
        return wire.BucketAck.model_validate_json(response.content)

    def sync_prepare(self, sync_id: str, *, timeout_s: float | None = None) -> wire.SyncPrepareResponse:
        """Returns once the server holds every bucket of the sync (collective: its receive has finished), so
        the commit will only apply; `timeout_s` bounds the wait (default the read timeout).

        Raises:
            ServerError: 400 `collective_failed` (the receive failed; the server discarded the sync) or
                `missing_bucket`; 404 when the sync is gone.
            ServerUnreachable: no answer within `timeout_s` (the server died or hangs).
        """
        body = wire.SyncPrepareRequest(sync_id=sync_id)
        extra = {"timeout": httpx.Timeout(timeout_s, connect=min(10.0, timeout_s))} if timeout_s else {}
        response = self._request("POST", wire.SYNC_PREPARE_PATH, json=body.model_dump(mode="json"), **extra)
        return wire.SyncPrepareResponse.model_validate_json(response.content)

    def sync_commit(self, sync_id: str) -> wire.SyncCommitResponse:
        """Applies the staged sync atomically; afterwards every generation uses the new version."""
        body = wire.SyncCommitRequest(sync_id=sync_id)
        response = self._request("POST", wire.SYNC_COMMIT_PATH, json=body.model_dump(mode="json"))
        return wire.SyncCommitResponse.model_validate_json(response.content)

    def sync_abort(self, sync_id: str) -> wire.SyncAbortResponse:
        """Discards the staged sync (idempotent)."""
        body = wire.SyncAbortRequest(sync_id=sync_id)
        response = self._request("POST", wire.SYNC_ABORT_PATH, json=body.model_dump(mode="json"))
        return wire.SyncAbortResponse.model_validate_json(response.content)

    @contextmanager
    def weight_sync(
        self,
        manifest: wire.SyncManifest,
        *,
        timeout_s: float | None = None,
        collective: wire.CollectiveSpec | None = None,
    ) -> Iterator[SyncSession]:
        """Groups one sync: begin on entry, commit on a clean exit, abort when the body raises.

        Committing only on a clean exit (never in `finally`) is what keeps a half-sent update from ever
        being applied.

        Example:
            >>> with client.weight_sync(manifest) as session:  # doctest: +SKIP
            ...     for spec, blob in buckets:
            ...         session.upload(spec.index, blob)
        """
        session = SyncSession(
            self, self.sync_begin(manifest, timeout_s=timeout_s, collective=collective), manifest
        )
        try:
            yield session
        except BaseException:
            self.abort_quietly(session.sync_id)
            raise
        session.committed = self.sync_commit(session.sync_id)

    def abort_quietly(self, sync_id: str) -> None:
        """`sync_abort`, logging instead of raising when the server does not answer (it also discards idle
        syncs after its timeout, so a failed abort loses nothing)."""
        try:
            self.sync_abort(sync_id)
        except (ServerError, ServerUnreachable) as exc:
            logger.warning("abort of sync %s on %s failed: %s", sync_id, self.base_url, exc)
