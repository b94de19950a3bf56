"""`RolloutClient` / `ServerRolloutSource`: chunking, retries, splits, typed errors, weight sync (no network).

Servers are simulated behind `httpx.MockTransport`; docs/ALGORITHM.md#required-tests §20.5 cases cite the
section in their ids.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
import torch

from learner.rollout import server_source
from learner.rollout.server_source import (
    InferFailed,
    RolloutClient,
    ServerConflict,
    ServerError,
    ServerNotReady,
    ServerRolloutSource,
    ServerUnreachable,
    learner_gpu_uuids,
    refuse_shared_gpu,
)
from learner.weights.types import SyncError, SyncRejected, WeightUpdate
from learner.yaml_loader import ConfigError
from shared_schemas.buckets import decode_bucket, plan_buckets
from shared_schemas.infer import Choice, InferBatch, InferRequest, InferResult
from shared_schemas.sync import SyncBeginRequest, SyncManifest
from shared_schemas.torch_common.gpu_ids import FAKE_GPU_UUIDS_ENV, gpu_uuids

URLS = [f"http://127.0.0.1:{8100 + i}" for i in range(4)]


def envelope(status: int, type_: str, message: str) -> httpx.Response:
    return httpx.Response(status, json={"error": {"type": type_, "message": message, "detail": None}})


class FakeServer:
    """One rollout server: answers `/infer/`, `/health` and the sync routes, records every call.

    `fail(batch)` returns a response to send instead of results (or raises a transport error), per call.
    """

    def __init__(self, url: str, *, weight_version: int = 0, lora_enabled: bool = False) -> None:
        self.url = url
        self.weight_version = weight_version
        self.lora_enabled = lora_enabled
        self.gpu_uuids: list[str] = []
        self.infer_calls: list[tuple[int, int]] = []  # (first_index, n)
        self.routes: list[str] = []
        self.fail: Callable[[InferBatch, httpx.Request], httpx.Response | None] = lambda batch, request: None
        self.begin_response: httpx.Response | None = None
        self.manifest: SyncManifest | None = None
        self.buckets: dict[int, bytes] = {}
        self.shm_dir: Path | None = None
        self.auth_headers: list[str | None] = []
        self.delay_s = 0.0
        self._lock = threading.Lock()

    def handle(self, request: httpx.Request) -> httpx.Response:
        path = request.url.path
        with self._lock:
            self.routes.append(f"{request.method} {path}")
            self.auth_headers.append(request.headers.get("authorization"))
        if path == "/health":
            return httpx.Response(200, json=self.health())
        if path == "/infer/":
            return self.infer(request)
        if path == "/sync_weights/begin":
            if self.begin_response is not None:
                return self.begin_response
            self.manifest = SyncBeginRequest.model_validate_json(request.content).manifest
            return httpx.Response(
                200,
                json={
                    "sync_id": "ab" * 8,
                    "current_version": self.weight_version,
                    "num_buckets": 1,
                    "expires_in_s": 60,
                },
            )
        if path.endswith("/shm"):
            index = int(path.split("/")[-2])
            name = json.loads(request.content)["file_name"]
            assert self.shm_dir is not None
            self.buckets[index] = (self.shm_dir / name).read_bytes()
            return httpx.Response(
                200, json={"sync_id": "ab" * 8, "index": index, "received": 1, "expected": 1}
            )
        if "/buckets/" in path:
            index = int(path.split("/")[-1])
            self.buckets[index] = request.content
            return httpx.Response(
                200, json={"sync_id": "ab" * 8, "index": index, "received": 1, "expected": 1}
            )
        if path == "/sync_weights/commit":
            assert self.manifest is not None
            self.weight_version = self.manifest.version
            return httpx.Response(
                200,
                json={
                    "sync_id": "ab" * 8,
                    "mode": self.manifest.mode,
                    "weight_version": self.weight_version,
                    "num_tensors": len(self.manifest.tensors),
                    "nbytes": self.manifest.nbytes,
                    "apply_s": 0.0,
                },
            )
        if path == "/sync_weights/abort":
            return httpx.Response(200, json={"sync_id": "ab" * 8, "aborted": True})
        return envelope(404, "not_found", f"no route {path}")

    def health(self) -> dict:
        return {
            "status": "ok",
            "engine": "vllm",
            "model": "/m",
            "weight_version": self.weight_version,
            "dp": 1,
            "tp": 1,
            "lora_enabled": self.lora_enabled,
            "max_model_len": 1024,
            "uptime_s": 1.0,
            "gpu_uuids": self.gpu_uuids,
        }

    def infer(self, request: httpx.Request) -> httpx.Response:
        batch = InferBatch.model_validate_json(request.content)
        with self._lock:
            self.infer_calls.append((batch.first_index, len(batch.infer_requests)))
        time.sleep(self.delay_s)
        failure = self.fail(batch, request)
        if failure is not None:
            return failure
        results = [
            InferResult(
                index=batch.first_index + i,
                request_id=r.request_id,
                prompt_token_ids=[1, 2],
                choices=[
                    Choice(
                        token_ids=[batch.first_index + i],
                        text=str(batch.first_index + i),
                        finish_reason="stop",
                    )
                ],
                weight_version=self.weight_version,
            ).model_dump(mode="json")
            for i, r in enumerate(batch.infer_requests)
        ]
        body = {
            "results": results,
            "weight_version": self.weight_version,
            "timing": {"total_s": 0, "engine_s": 0},
        }
        return httpx.Response(200, json=body)


class Cluster:
    """Several fake servers behind one mock transport; counts transports built per server."""

    def __init__(self, n: int, **kwargs) -> None:
        self.servers = {URLS[i]: FakeServer(URLS[i], **kwargs) for i in range(n)}
        self.transports_built = 0

    def handler(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        return self.servers[base].handle(request)

    def transport(self) -> httpx.BaseTransport:
        self.transports_built += 1
        return httpx.MockTransport(self.handler)

    def source(self, **kwargs) -> ServerRolloutSource:
        return ServerRolloutSource(list(self.servers), transport_factory=self.transport, **kwargs)

    def __getitem__(self, i: int) -> FakeServer:
        return self.servers[URLS[i]]


def make_batch(n: int, first_index: int = 0) -> InferBatch:
    requests = [InferRequest(prompt_token_ids=[5, 6], request_id=f"r{i}") for i in range(n)]
    return InferBatch(infer_requests=requests, first_index=first_index)


def server_error(status: int = 500) -> Callable[[InferBatch, httpx.Request], httpx.Response]:
    return lambda batch, request: envelope(status, "engine_error", "engine failed")


# -- chunking (§20.5) ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "s", "expected"),
    [
        (0, 3, [[], [], []]),
        (5, 2, [[(0, 3)], [(3, 2)]]),
        (5, 3, [[(0, 2)], [(2, 2)], [(4, 1)]]),
    ],
    ids=["§20.5-N0-S3-no-call", "§20.5-N5-S2", "§20.5-N5-S3"],
)
def test_chunk_plan_calls(n: int, s: int, expected: list[list[tuple[int, int]]]) -> None:
    cluster = Cluster(s)
    with cluster.source() as source:
        results = source.infer(make_batch(n))
    assert [cluster[i].infer_calls for i in range(s)] == expected
    assert [r.index for r in results] == list(range(n))
    if n == 0:
        assert all(not server.routes for server in cluster.servers.values())


def test_ten_requests_over_four_servers_reassemble_in_order() -> None:
    """§20.5: 10 over 4 → ranges of 3,3,3,1; the slowest server answers last, order still holds."""
    cluster = Cluster(4)
    cluster[0].delay_s = 0.2
    with cluster.source() as source:
        batch = make_batch(10, first_index=20)
        results = source.infer(batch)
    assert [cluster[i].infer_calls for i in range(4)] == [[(20, 3)], [(23, 3)], [(26, 3)], [(29, 1)]]
    assert [r.index for r in results] == list(range(20, 30))
    assert [r.request_id for r in results] == [f"r{i}" for i in range(10)]
    assert [r.choices[0].token_ids for r in results] == [[i] for i in range(20, 30)]


def test_chunks_run_concurrently() -> None:
    cluster = Cluster(4)
    for server in cluster.servers.values():
        server.delay_s = 0.3
    with cluster.source() as source:
        started = time.perf_counter()
        source.infer(make_batch(8))
        elapsed = time.perf_counter() - started
    assert elapsed < 0.3 * 4 * 0.75, f"4 chunks of 0.3 s took {elapsed:.2f} s: not concurrent"


# -- retries and splits (§20.5) -----------------------------------------------------------------


def test_chunk_failing_once_succeeds_on_retry_with_a_fresh_connection() -> None:
    cluster = Cluster(1)
    calls = {"n": 0}

    def fail_first(batch: InferBatch, request: httpx.Request) -> httpx.Response | None:
        calls["n"] += 1
        return envelope(500, "engine_error", "boom") if calls["n"] == 1 else None

    cluster[0].fail = fail_first
    with cluster.source() as source:
        built = cluster.transports_built
        results = source.infer(make_batch(4))
        assert cluster.transports_built == built + 1, "the retry must open a fresh connection"
        assert source.last_infer.retries == 1 and source.last_infer.splits == 0
    assert cluster[0].infer_calls == [(0, 4), (0, 4)]
    assert [r.index for r in results] == [0, 1, 2, 3]


def test_persistently_failing_chunk_is_split_2_2_then_1_1() -> None:
    """§20.5: a 4-request chunk that always fails is halved to 2+2, each of which fails and is halved
    to 1+1."""
    cluster = Cluster(1)
    cluster[0].fail = lambda batch, request: (
        envelope(500, "engine_error", "too big") if len(batch.infer_requests) > 1 else None
    )
    with cluster.source() as source:
        results = source.infer(make_batch(4))
        assert source.last_infer.splits == 3
    sizes = [(first, n) for first, n in cluster[0].infer_calls]
    assert sizes == [(0, 4), (0, 4), (0, 2), (0, 2), (0, 1), (1, 1), (2, 2), (2, 2), (2, 1), (3, 1)]
    assert [r.index for r in results] == [0, 1, 2, 3]


def test_single_request_failing_twice_raises_naming_server_and_index() -> None:
    cluster = Cluster(2)
    cluster[1].fail = lambda batch, request: (
        envelope(500, "engine_error", "poison")
        if any(r.request_id == "r6" for r in batch.infer_requests)
        else None
    )
    with cluster.source() as source, pytest.raises(InferFailed) as info:
        source.infer(make_batch(8))
    err = info.value
    assert err.url == URLS[1] and err.indices == [6]
    assert URLS[1] in str(err) and "index 6" in str(err)
    # chunk 4..7 → 4..5 ok, 6..7 split → 6 fails twice → raise
    assert cluster[1].infer_calls == [(4, 4), (4, 4), (4, 2), (6, 2), (6, 2), (6, 1), (6, 1)]


def test_caller_error_is_not_retried_and_keeps_its_type() -> None:
    cluster = Cluster(1)
    cluster[0].fail = lambda batch, request: envelope(
        400, "prompt_too_long", "request 2: 900 prompt + 512 new tokens > max_model_len 1024"
    )
    with cluster.source() as source, pytest.raises(ServerError) as info:
        source.infer(make_batch(4))
    assert info.value.status == 400 and info.value.type == "prompt_too_long"
    assert "request 2" in info.value.message
    assert cluster[0].infer_calls == [(0, 4)]


def test_unreachable_server_is_retried_once_then_raises_without_splitting() -> None:
    cluster = Cluster(2)

    def refuse(batch: InferBatch, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    cluster[1].fail = refuse
    with cluster.source() as source, pytest.raises(InferFailed) as info:
        source.infer(make_batch(6))
    assert info.value.url == URLS[1] and info.value.indices == [3, 4, 5]
    assert "indices 3..5" in str(info.value) and "start_rollout_server.sh" in str(info.value)
    assert cluster[1].infer_calls == [(3, 3), (3, 3)]


def test_a_dead_server_fails_the_call_while_the_others_still_generate() -> None:
    """The first failed chunk ends the call: the error names the dead server while the surviving server is
    still busy with its chunk (it would otherwise report only after the survivors finish)."""
    cluster = Cluster(2)
    release = threading.Event()
    survivor_done = threading.Event()

    def busy(batch: InferBatch, request: httpx.Request) -> None:
        release.wait(30)  # a bound: a call that waited for this chunk still ends, and the test fails
        survivor_done.set()

    def refuse(batch: InferBatch, request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    cluster[0].fail, cluster[1].fail = busy, refuse
    with cluster.source() as source:
        with pytest.raises(InferFailed) as info:
            source.infer(make_batch(6))
        still_busy = not survivor_done.is_set()
        release.set()
    assert still_busy, "the call waited for the surviving server's chunk before reporting the dead one"
    assert info.value.url == URLS[1] and info.value.indices == [3, 4, 5]


def test_read_timeout_is_split_like_a_server_error() -> None:
    cluster = Cluster(1)

    def slow_when_big(batch: InferBatch, request: httpx.Request) -> httpx.Response | None:
        if len(batch.infer_requests) > 1:
            raise httpx.ReadTimeout("timed out", request=request)
        return None

    cluster[0].fail = slow_when_big
    with cluster.source() as source:
        assert [r.index for r in source.infer(make_batch(2))] == [0, 1]
    assert cluster[0].infer_calls == [(0, 2), (0, 2), (0, 1), (1, 1)]


def test_wrong_request_id_from_server_is_never_accepted() -> None:
    cluster = Cluster(1)

    def swap_ids(batch: InferBatch, request: httpx.Request) -> httpx.Response:
        results = [
            InferResult(
                index=batch.first_index + i,
                request_id="bogus",
                prompt_token_ids=[1],
                choices=[Choice(token_ids=[1], text="x", finish_reason="stop")],
                weight_version=0,
            ).model_dump(mode="json")
            for i in range(len(batch.infer_requests))
        ]
        return httpx.Response(
            200, json={"results": results, "weight_version": 0, "timing": {"total_s": 0, "engine_s": 0}}
        )

    cluster[0].fail = swap_ids
    with cluster.source() as source, pytest.raises(InferFailed, match="request_id 'bogus'"):
        source.infer(make_batch(1))


def test_staleness_is_recorded_per_result() -> None:
    cluster = Cluster(2)
    cluster[0].weight_version = 3
    cluster[1].weight_version = 3
    with cluster.source() as source:
        source.infer(make_batch(2))
        assert source.last_infer.staleness == [0, 0]
        source.weight_version = 5  # as after a sync the servers have not applied
        source.infer(make_batch(2))
        assert source.last_infer.staleness == [2, 2]


# -- typed errors -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("response", "cls", "type_"),
    [
        (envelope(409, "lora_disabled", "no LoRA"), ServerConflict, "lora_disabled"),
        (envelope(503, "engine_not_ready", "loading"), ServerNotReady, "engine_not_ready"),
        (envelope(422, "validation_error", "bad"), ServerError, "validation_error"),
        (httpx.Response(502, text="<html>bad gateway</html>"), ServerError, "http_error"),
    ],
    ids=["409", "503", "422", "502-no-envelope"],
)
def test_error_envelope_becomes_typed_error(response: httpx.Response, cls: type, type_: str) -> None:
    client = RolloutClient(URLS[0], transport_factory=lambda: httpx.MockTransport(lambda request: response))
    with client, pytest.raises(cls) as info:
        client.infer(make_batch(1))
    err = info.value
    assert type(err) is cls and err.status == response.status_code and err.type == type_
    assert URLS[0] in err.url
    assert isinstance(err, SyncRejected) == (response.status_code == 409)


def test_transport_failure_is_server_unreachable() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with RolloutClient(URLS[0], transport_factory=lambda: httpx.MockTransport(refuse)) as client:
        with pytest.raises(ServerUnreachable) as info:
            client.health()
    assert info.value.connect_failed and URLS[0] in str(info.value)


def test_wait_healthy_error_names_url_and_launcher() -> None:
    def refuse(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("refused", request=request)

    with RolloutClient(URLS[0], transport_factory=lambda: httpx.MockTransport(refuse)) as client:
        with pytest.raises(ServerUnreachable) as info:
            client.wait_healthy(deadline_s=0.2)
    assert URLS[0] in str(info.value) and "scripts/start_rollout_server.sh" in str(info.value)


def test_health_while_loading_returns_the_body() -> None:
    body = {**FakeServer(URLS[0]).health(), "status": "loading"}
    client = RolloutClient(
        URLS[0], transport_factory=lambda: httpx.MockTransport(lambda r: httpx.Response(503, json=body))
    )
    with client:
        assert client.health().status == "loading"
        with pytest.raises(ServerNotReady, match="loading"):
            client.wait_healthy(deadline_s=0.1)


def test_auth_token_is_sent() -> None:
    cluster = Cluster(1)
    with cluster.source(auth_token="s3cret") as source:
        source.infer(make_batch(1))
    assert cluster[0].auth_headers == ["Bearer s3cret"]


def test_combined_health() -> None:
    cluster = Cluster(2, lora_enabled=True)
    cluster[1].weight_version = 4
    cluster[1].lora_enabled = False
    with cluster.source() as source:
        health = source.health()
    assert health.status == "ok" and health.weight_version == 4 and not health.lora_enabled and health.dp == 2


# -- weight sync --------------------------------------------------------------------------------


def weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(64, 32, generator=gen),
        "a.bias": torch.randn(32, generator=gen).to(torch.bfloat16),
        "b.weight": torch.randn(128, 64, generator=gen),
    }


def decoded(server: FakeServer) -> dict[str, torch.Tensor]:
    assert server.manifest is not None
    out = {}
    for spec in server.manifest.buckets:
        for raw in decode_bucket(server.buckets[spec.index], spec):
            dtype = {"F32": torch.float32, "BF16": torch.bfloat16}[raw.dtype]
            out[raw.name] = torch.frombuffer(bytearray(raw.data), dtype=dtype).reshape(raw.shape)
    return out


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_full_sync_reaches_every_server(transport: str, tmp_path: Path) -> None:
    cluster = Cluster(2)
    for server in cluster.servers.values():
        server.shm_dir = tmp_path
    tensors = weights()
    # 0.03 MiB buckets: a.weight (8 KiB) + a.bias, then b.weight (32 KiB) alone.
    with cluster.source(
        transport=transport, shm_dir=tmp_path if transport == "shm" else None, bucket_mb=0.03
    ) as source:
        report = source.sync_weights(WeightUpdate(mode="full", version=1, tensors=tensors))
        assert source.weight_version == 1
    assert report.version == 1 and report.transport == transport and report.mode == "full"
    assert report.bytes == sum(t.numel() * t.element_size() for t in tensors.values())
    for server in cluster.servers.values():
        assert len(server.manifest.buckets) == 2 and server.weight_version == 1
        got = decoded(server)
        assert list(got) == list(tensors)
        for name, tensor in tensors.items():
            assert torch.equal(got[name], tensor), name
        assert server.routes[-1] == "POST /sync_weights/commit"
    assert list(tmp_path.iterdir()) == [], "shm bucket files must be removed"


def test_lazy_update_needs_specs_and_is_checked() -> None:
    tensors = weights()
    with pytest.raises(ValueError, match="specs"):
        WeightUpdate(mode="full", version=1, tensors=iter(tensors.items()))
    specs = WeightUpdate(mode="full", version=1, tensors=tensors).tensor_specs()
    cluster = Cluster(1)
    wrong = iter([(n, t) for n, t in tensors.items()][::-1])
    with cluster.source() as source, pytest.raises(SyncError, match="declared"):
        source.sync_weights(WeightUpdate(mode="full", version=1, tensors=wrong, specs=specs))
    assert cluster[0].routes[-1] == "POST /sync_weights/abort"
    assert cluster[0].weight_version == 0


def test_adapter_sync_refused_raises_sync_rejected_and_aborts_the_others() -> None:
    cluster = Cluster(2)
    cluster[1].begin_response = envelope(
        409, "lora_disabled", "adapter sync refused: the server runs without LoRA"
    )
    update = WeightUpdate(
        mode="adapter", version=1, tensors=weights(), adapter_config={"r": 8}, adapter_name="policy"
    )
    with cluster.source() as source, pytest.raises(SyncRejected, match="without LoRA"):
        source.sync_weights(update)
    assert cluster[0].routes == ["POST /sync_weights/begin", "POST /sync_weights/abort"]
    assert cluster[0].weight_version == 0


def test_failed_bucket_aborts_and_raises_sync_error() -> None:
    cluster = Cluster(1)
    original = cluster[0].handle

    def reject_bucket(request: httpx.Request) -> httpx.Response:
        if "/buckets/" in request.url.path:
            cluster[0].routes.append(f"{request.method} {request.url.path}")
            return envelope(400, "bucket_mismatch", "bucket 0 rejected")
        return original(request)

    cluster[0].handle = reject_bucket
    with cluster.source() as source, pytest.raises(SyncError, match=f"v1 \\(full\\) to {URLS[0]}") as info:
        source.sync_weights(WeightUpdate(mode="full", version=1, tensors=weights()))
    assert not isinstance(info.value, SyncRejected)
    assert cluster[0].routes[-1] == "POST /sync_weights/abort" and cluster[0].weight_version == 0


def test_weight_sync_context_commits_only_on_clean_exit() -> None:
    cluster = Cluster(1)
    update = WeightUpdate(mode="full", version=2, tensors=weights())
    manifest = SyncManifest(mode="full", version=2, buckets=tuple(plan_buckets(update.tensor_specs(), 2**20)))
    with RolloutClient(URLS[0], transport_factory=cluster.transport) as client:
        with pytest.raises(RuntimeError, match="learner died"), client.weight_sync(manifest):
            raise RuntimeError("learner died")
        assert cluster[0].routes == ["POST /sync_weights/begin", "POST /sync_weights/abort"]
        with client.weight_sync(manifest) as session:
            assert session.sync_id == "ab" * 8
        assert session.committed is not None and session.committed.weight_version == 2
    assert cluster[0].routes[-1] == "POST /sync_weights/commit"


def test_shm_needs_loopback_servers_and_a_dir(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="shm_dir"):
        ServerRolloutSource(URLS[:1], transport="shm")
    with pytest.raises(ValueError, match="10.1.2.3"):
        ServerRolloutSource([URLS[0], "http://10.1.2.3:8000"], transport="shm", shm_dir=tmp_path)
    ServerRolloutSource(
        ["http://localhost:8000", "http://[::1]:8001"], transport="shm", shm_dir=tmp_path
    ).close()


@pytest.mark.parametrize("transport", ["gloo", "nccl"])
def test_collective_transport_needs_an_address_for_remote_servers(transport: str) -> None:
    with pytest.raises(ValueError, match="rollout.sync.collective_address"):
        ServerRolloutSource([URLS[0], "http://10.1.2.3:8000"], transport=transport)  # type: ignore[arg-type]
    ServerRolloutSource(
        [URLS[0], "http://10.1.2.3:8000"], transport=transport, collective_address="10.1.2.9"
    ).close()  # type: ignore[arg-type]
    ServerRolloutSource(["http://localhost:8000"], transport=transport).close()  # type: ignore[arg-type]


def test_flat_bucket_is_the_tensor_bytes_back_to_back() -> None:
    from learner.weights.codec import raw_tensor
    from learner.weights.group_send import flat_bucket
    from shared_schemas.buckets import bucket_parts

    items = {"a": torch.arange(3, dtype=torch.bfloat16), "b": torch.ones(2, 2), "c": torch.zeros(0)}
    parts = bucket_parts([raw_tensor(n, t) for n, t in items.items()])
    flat = flat_bucket(parts, 3 * 2 + 4 * 4)
    assert flat.dtype == torch.uint8 and flat[:6].view(torch.bfloat16).tolist() == [0.0, 1.0, 2.0]
    # Unaligned for float32 at byte 6: receivers copy such a tensor (`receive_buckets`).
    assert flat[6:].clone().view(torch.float32).tolist() == [1.0] * 4
    with pytest.raises(SyncError, match="manifest says 99"):
        flat_bucket(parts, 99)


def test_a_retry_reconnect_does_not_close_a_pool_another_thread_is_using() -> None:
    """A background rollout's retry calls `reconnect` while the main thread's sync call is still running on
    the old pool: that call completes, and the old pool is closed once it returns."""
    entered, release = threading.Event(), threading.Event()
    pools: list[httpx.MockTransport] = []

    def handler(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/slow":
            entered.set()
            assert release.wait(10)
        return httpx.Response(200, json={"ok": True})

    def factory() -> httpx.MockTransport:
        pools.append(httpx.MockTransport(handler))
        return pools[-1]

    with RolloutClient(URLS[0], transport_factory=factory) as client:
        answers: list[int] = []
        slow = threading.Thread(target=lambda: answers.append(client._send("GET", "/slow").status_code))
        slow.start()
        assert entered.wait(10)
        first_pool = client._client
        client.reconnect()  # another thread's retry
        assert client._client is not first_pool and not first_pool.is_closed  # still in use
        release.set()
        slow.join(10)
        assert answers == [200] and first_pool.is_closed  # closed by its last caller
        assert client._send("GET", "/fast").status_code == 200 and len(pools) == 2
        client.reconnect()  # nobody on it: closed at once
        assert len(pools) == 3


# -- a nccl server on the learner's GPU ----------------------------------------------------------------------
def test_refuse_shared_gpu_names_the_server_the_reason_and_the_fixes():
    refuse_shared_gpu(["GPU-a"], {URLS[0]: ["GPU-b"], URLS[1]: []})  # another GPU, a CPU server: fine
    refuse_shared_gpu([], {URLS[0]: ["GPU-b"]})  # a CPU learner shares no GPU
    with pytest.raises(ConfigError) as info:
        refuse_shared_gpu(["GPU-a"], {URLS[0]: ["GPU-b"], URLS[1]: ["GPU-c", "GPU-a"]})
    message = str(info.value)
    assert URLS[1] in message and "GPU-a" in message
    assert "NCCL cannot put two ranks on one GPU" in message
    assert "rollout.sync.transport: shm (or http)" in message and "another GPU" in message


@pytest.mark.parametrize(("transport", "refused"), [("nccl", True), ("http", False), ("gloo", False)])
def test_wait_healthy_refuses_nccl_with_a_server_on_the_learners_gpu(monkeypatch, transport, refused):
    monkeypatch.setattr(server_source, "learner_gpu_uuids", lambda: ["GPU-learner"])
    cluster = Cluster(2)
    cluster[1].gpu_uuids = ["GPU-learner"]
    with cluster.source(transport=transport) as source:
        if refused:
            with pytest.raises(ConfigError, match=rf"{URLS[1]} on this learner's GPU GPU-learner"):
                source.wait_healthy(5)
        else:
            assert source.wait_healthy(5).status == "ok"
    cluster[1].gpu_uuids = ["GPU-other"]
    with cluster.source(transport="nccl") as source:
        assert source.wait_healthy(5).status == "ok"


def test_learner_gpu_uuids_are_fakeable_and_empty_on_cpu(monkeypatch):
    monkeypatch.setenv(FAKE_GPU_UUIDS_ENV, "GPU-x, GPU-y")
    assert gpu_uuids() == ["GPU-x", "GPU-y"] and gpu_uuids([1]) == ["GPU-y"]
    monkeypatch.delenv(FAKE_GPU_UUIDS_ENV)
    if not torch.cuda.is_available():
        assert learner_gpu_uuids() == [] and gpu_uuids() == []
