"""Weight-sync state machine over HTTP with a fake engine (docs/ARCHITECTURE.md#sync-weights)."""

from __future__ import annotations

import asyncio
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from rollout_server.app import create_app
from rollout_server.config import ServerConfig
from rollout_server.engines.base import AdapterUpdate, FullUpdate, ReceivedUpdate, Rendezvous, StagedUpdate
from rollout_server.errors import EngineError
from rollout_server.weights.staging import STAGED_DIR_PREFIX, SyncStaging
from shared_schemas.buckets import RawTensor, bucket_parts, encode_bucket, plan_buckets
from shared_schemas.sync import TensorSpec
from tests.unit.rollout_server.fakes import SPECS, FakeEngine

SYNC = "/sync_weights"


def tensors(seed: int = 0, names: tuple[str, ...] = tuple(SPECS)) -> list[RawTensor]:
    rng = np.random.default_rng(seed)
    out = []
    for name in names:
        dtype, shape = SPECS[name]
        size = TensorSpec(name=name, dtype=dtype, shape=shape).nbytes
        out.append(RawTensor(name, dtype, shape, rng.integers(0, 256, size, dtype=np.uint8).tobytes()))
    return out


def manifest_for(items: list[RawTensor], version: int, bucket_bytes: int = 16, **kw: Any) -> dict[str, Any]:
    specs = [TensorSpec(name=t.name, dtype=t.dtype, shape=t.shape) for t in items]
    buckets = plan_buckets(specs, bucket_bytes)
    return {"mode": "full", "version": version, "buckets": [b.model_dump() for b in buckets], **kw}


def bucket_blobs(items: list[RawTensor], manifest: dict[str, Any]) -> list[bytes]:
    by_name = {t.name: t for t in items}
    return [encode_bucket([by_name[t["name"]] for t in b["tensors"]]) for b in manifest["buckets"]]


def begin(client: TestClient, manifest: dict[str, Any], **kw: Any) -> httpx.Response:
    return client.post(f"{SYNC}/begin", json={"manifest": manifest, **kw})


def full_sync(client: TestClient, items: list[RawTensor], version: int) -> httpx.Response:
    manifest = manifest_for(items, version)
    resp = begin(client, manifest)
    assert resp.status_code == 200, resp.text
    sync_id = resp.json()["sync_id"]
    for i, blob in enumerate(bucket_blobs(items, manifest)):
        ack = client.put(f"{SYNC}/{sync_id}/buckets/{i}", content=blob)
        assert ack.status_code == 200, ack.text
    return client.post(f"{SYNC}/commit", json={"sync_id": sync_id})


def error_type(resp: httpx.Response) -> str:
    return resp.json()["error"]["type"]


def test_full_sync_over_http_applies_atomically(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    manifest = manifest_for(items, 3)
    assert len(manifest["buckets"]) == 3
    sync_id = begin(client, manifest).json()["sync_id"]
    for i, blob in enumerate(bucket_blobs(items, manifest)):
        ack = client.put(f"{SYNC}/{sync_id}/buckets/{i}", content=blob).json()
        assert (ack["index"], ack["received"], ack["expected"]) == (i, i + 1, 3)
        assert engine.applied == []  # nothing before commit
    resp = client.post(f"{SYNC}/commit", json={"sync_id": sync_id})
    assert resp.status_code == 200, resp.text
    assert resp.json()["weight_version"] == 3 and resp.json()["num_tensors"] == 3
    assert len(engine.applied) == 1 and isinstance(engine.applied[0], FullUpdate)
    assert engine.weights == {t.name: bytes(t.data) for t in items}
    assert client.get("/health").json()["weight_version"] == 3
    out = client.post(
        "/infer/", json={"infer_requests": [{"prompt_token_ids": [1]}], "request_config": {"max_tokens": 2}}
    )
    assert out.json()["results"][0]["weight_version"] == 3
    # the sync is finished: its id is gone
    assert error_type(client.post(f"{SYNC}/commit", json={"sync_id": sync_id})) == "unknown_sync"


def test_full_sync_through_shm_file_name(client: TestClient, engine: FakeEngine, shm_dir: Path) -> None:
    items = tensors(seed=1)
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    for i, blob in enumerate(bucket_blobs(items, manifest)):
        (shm_dir / f"bucket-{i}.safetensors").write_bytes(blob)
        resp = client.post(f"{SYNC}/{sync_id}/buckets/{i}/shm", json={"file_name": f"bucket-{i}.safetensors"})
        assert resp.status_code == 200, resp.text
        os.remove(shm_dir / f"bucket-{i}.safetensors")  # the server copied it: the learner may reuse the name
    assert client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
    assert engine.weights == {t.name: bytes(t.data) for t in items}


def assert_rejected(
    resp: httpx.Response, status: int, kind: str, client: TestClient, engine: FakeEngine
) -> None:
    assert resp.status_code == status, resp.text
    assert set(resp.json()) == {"error"} and error_type(resp) == kind
    assert engine.applied == [] and engine.version == 0
    assert client.get("/health").status_code == 200


def test_wrong_shape_rejected_at_begin(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    bad = [RawTensor("model.w", "F32", (3, 2), items[0].data), *items[1:]]
    assert_rejected(begin(client, manifest_for(bad, 1)), 400, "parameter_mismatch", client, engine)


def test_wrong_dtype_rejected_at_begin(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    bad = [items[0], RawTensor("model.b", "F16", (4,), items[1].data), items[2]]
    resp = begin(client, manifest_for(bad, 1))
    assert_rejected(resp, 400, "parameter_mismatch", client, engine)
    assert "BF16" in resp.json()["error"]["message"]


def test_unknown_name_rejected_at_begin(client: TestClient, engine: FakeEngine) -> None:
    bad = [*tensors(), RawTensor("model.extra", "F32", (1,), b"\x00" * 4)]
    resp = begin(client, manifest_for(bad, 1))
    assert_rejected(resp, 400, "unknown_parameter", client, engine)
    assert "model.extra" in resp.json()["error"]["message"]


@pytest.mark.parametrize("version", [1, 2], ids=["below-current", "equal-to-current"])
def test_stale_version_rejected(client: TestClient, engine: FakeEngine, version: int) -> None:
    engine.version = 2
    resp = begin(client, manifest_for(tensors(), version))
    assert resp.status_code == 409 and error_type(resp) == "stale_version"
    assert engine.applied == [] and engine.version == 2


def test_version_overtaken_before_commit_is_rejected(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    for i, blob in enumerate(bucket_blobs(items, manifest)):
        client.put(f"{SYNC}/{sync_id}/buckets/{i}", content=blob)
    engine.version = 5  # e.g. a colocated update landed meanwhile
    resp = client.post(f"{SYNC}/commit", json={"sync_id": sync_id})
    assert resp.status_code == 409 and error_type(resp) == "stale_version"
    assert engine.applied == []


def test_missing_bucket_rejected_at_commit(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    blobs = bucket_blobs(items, manifest)
    client.put(f"{SYNC}/{sync_id}/buckets/0", content=blobs[0])
    client.put(f"{SYNC}/{sync_id}/buckets/2", content=blobs[2])
    resp = client.post(f"{SYNC}/commit", json={"sync_id": sync_id})
    assert_rejected(resp, 400, "missing_bucket", client, engine)
    assert resp.json()["error"]["detail"] == {"missing": [1]}
    # a rejected sync is discarded
    assert error_type(client.put(f"{SYNC}/{sync_id}/buckets/1", content=blobs[1])) == "unknown_sync"


def test_bucket_not_matching_manifest_discards_sync(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    blobs = bucket_blobs(items, manifest)
    resp = client.put(f"{SYNC}/{sync_id}/buckets/0", content=blobs[1])  # bucket 1's tensors under index 0
    assert_rejected(resp, 400, "bucket_mismatch", client, engine)
    assert error_type(client.post(f"{SYNC}/commit", json={"sync_id": sync_id})) == "unknown_sync"


def test_garbage_bucket_and_bad_index(client: TestClient, engine: FakeEngine) -> None:
    manifest = manifest_for(tensors(), 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    assert_rejected(
        client.put(f"{SYNC}/{sync_id}/buckets/7", content=b"x"), 400, "bucket_out_of_range", client, engine
    )
    assert_rejected(
        client.put(f"{SYNC}/{sync_id}/buckets/0", content=b"junk"), 400, "bucket_mismatch", client, engine
    )


def test_adapter_on_lora_less_engine_is_409(client: TestClient, engine: FakeEngine) -> None:
    items = [RawTensor("base_model.model.q_proj.lora_A.weight", "F32", (2, 4), b"\x00" * 32)]
    manifest = manifest_for(items, 1, mode="adapter", adapter_name="a1", adapter_config={"r": 2})
    assert_rejected(begin(client, manifest), 409, "lora_disabled", client, engine)


def test_adapter_sync_on_lora_engine(cfg: ServerConfig) -> None:
    engine = FakeEngine(lora=True)
    items = [
        RawTensor("base_model.model.q_proj.lora_A.weight", "F32", (2, 4), b"\x01" * 32),
        RawTensor("base_model.model.q_proj.lora_B.weight", "F32", (4, 2), b"\x02" * 32),
    ]
    manifest = manifest_for(
        items, 1, bucket_bytes=32, mode="adapter", adapter_name="a1", adapter_config={"r": 2}
    )
    with TestClient(create_app(cfg, engine=engine)) as c:
        sync_id = begin(c, manifest).json()["sync_id"]
        for i, blob in enumerate(bucket_blobs(items, manifest)):
            assert c.put(f"{SYNC}/{sync_id}/buckets/{i}", content=blob).status_code == 200
        assert c.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
        update = engine.applied[0]
        assert isinstance(update, AdapterUpdate) and update.adapter_name == "a1"
        body = {
            "infer_requests": [{"prompt_token_ids": [1]}],
            "request_config": {"max_tokens": 2, "adapter": "a1"},
        }
        assert c.post("/infer/", json=body).status_code == 200
        body["request_config"]["adapter"] = "other"
        assert error_type(c.post("/infer/", json=body)) == "unknown_adapter"


@pytest.mark.parametrize(
    ("file_name", "status", "kind"),
    [
        ("../outside.safetensors", 422, "validation_error"),
        ("/etc/passwd", 422, "validation_error"),
        ("..", 422, "validation_error"),
        ("sub/../../outside.safetensors", 422, "validation_error"),
        ("link.safetensors", 400, "bad_shm_name"),
        ("absent.safetensors", 404, "shm_file_not_found"),
        ("dir.safetensors", 400, "bad_shm_name"),
    ],
)
def test_shm_path_traversal_refused(
    client: TestClient,
    engine: FakeEngine,
    shm_dir: Path,
    tmp_path: Path,
    file_name: str,
    status: int,
    kind: str,
) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    outside = tmp_path / "outside.safetensors"
    outside.write_bytes(bucket_blobs(items, manifest)[0])
    (shm_dir / "link.safetensors").symlink_to(outside)
    (shm_dir / "dir.safetensors").mkdir()
    sync_id = begin(client, manifest).json()["sync_id"]
    resp = client.post(f"{SYNC}/{sync_id}/buckets/0/shm", json={"file_name": file_name})
    assert_rejected(resp, status, kind, client, engine)


def test_shm_disabled_is_409(engine: FakeEngine) -> None:
    cfg = ServerConfig(model="/models/fake")
    with TestClient(create_app(cfg, engine=engine)) as c:
        sync_id = begin(c, manifest_for(tensors(), 1)).json()["sync_id"]
        resp = c.post(f"{SYNC}/{sync_id}/buckets/0/shm", json={"file_name": "b0"})
        assert resp.status_code == 409 and error_type(resp) == "shm_disabled"


def test_abort_discards_and_is_idempotent(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    assert client.post(f"{SYNC}/abort", json={"sync_id": sync_id}).json()["aborted"] is True
    assert client.post(f"{SYNC}/abort", json={"sync_id": sync_id}).json()["aborted"] is False
    assert error_type(client.post(f"{SYNC}/commit", json={"sync_id": sync_id})) == "unknown_sync"
    assert engine.applied == []


def test_new_begin_supersedes_staged_sync(client: TestClient, engine: FakeEngine) -> None:
    items = tensors()
    first = begin(client, manifest_for(items, 1)).json()["sync_id"]
    assert full_sync(client, items, 2).status_code == 200
    assert error_type(client.post(f"{SYNC}/commit", json={"sync_id": first})) == "unknown_sync"
    assert engine.version == 2 and len(engine.applied) == 1


def test_idle_sync_times_out(client: TestClient, engine: FakeEngine, shm_dir: Path) -> None:
    now = [0.0]
    state = client.app.state.server  # type: ignore[attr-defined]
    state.staging = SyncStaging(shm_dir, default_timeout_s=10.0, clock=lambda: now[0])
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    blobs = bucket_blobs(items, manifest)
    now[0] = 9.0
    assert client.put(f"{SYNC}/{sync_id}/buckets/0", content=blobs[0]).status_code == 200  # activity extends
    now[0] = 18.0
    assert client.put(f"{SYNC}/{sync_id}/buckets/1", content=blobs[1]).status_code == 200
    now[0] = 29.0
    resp = client.put(f"{SYNC}/{sync_id}/buckets/2", content=blobs[2])
    assert resp.status_code == 404 and error_type(resp) == "unknown_sync"
    assert engine.applied == []


def test_sync_phases_validate_bodies(client: TestClient) -> None:
    assert client.post(f"{SYNC}/begin", json={"manifest": {"mode": "full"}}).status_code == 422
    assert client.post(f"{SYNC}/commit", json={"sync_id": "../../x"}).status_code == 422
    assert client.put(f"{SYNC}/NOT-HEX/buckets/0", content=b"").status_code == 422
    assert client.put(f"{SYNC}/{'a' * 32}/buckets/-1", content=b"").status_code == 422


def test_engine_apply_failure_is_500_and_keeps_old_weights(client: TestClient, engine: FakeEngine) -> None:
    engine.fail_apply = True
    resp = full_sync(client, tensors(), 1)
    assert_rejected(resp, 500, "engine_error", client, engine)
    assert "previous weights are still served" in resp.json()["error"]["message"]
    engine.fail_apply = False
    assert full_sync(client, tensors(seed=3), 1).status_code == 200  # the same version can be retried
    assert engine.version == 1


def staged_dirs(root: Path) -> list[Path]:
    return [p for p in root.iterdir() if p.name.startswith(STAGED_DIR_PREFIX)]


def pool_files(client: TestClient) -> list[Path]:
    pool = client.app.state.server.staging._pool  # type: ignore[attr-defined]
    return sorted(pool.iterdir()) if pool is not None else []


@pytest.mark.parametrize("outcome", ["commit", "abort", "reject", "supersede"])
def test_staged_files_are_removed_whatever_the_outcome(
    client: TestClient, engine: FakeEngine, shm_dir: Path, outcome: str
) -> None:
    """Adopted shm files go with their sync; HTTP bodies' pool files are kept only after a commit (reused)."""
    items = tensors(seed=2)
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    blobs = bucket_blobs(items, manifest)
    assert client.put(f"{SYNC}/{sync_id}/buckets/0", content=blobs[0]).status_code == 200
    (shm_dir / "b1.safetensors").write_bytes(blobs[1])
    assert (
        client.post(f"{SYNC}/{sync_id}/buckets/1/shm", json={"file_name": "b1.safetensors"}).status_code
        == 200
    )
    (dir_,) = staged_dirs(shm_dir)
    assert len(list(dir_.iterdir())) == 1 and len(pool_files(client)) == 1
    if outcome == "commit":
        assert client.put(f"{SYNC}/{sync_id}/buckets/2", content=blobs[2]).status_code == 200
        assert client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
    elif outcome == "abort":
        assert client.post(f"{SYNC}/abort", json={"sync_id": sync_id}).json()["aborted"] is True
    elif outcome == "reject":
        assert client.put(f"{SYNC}/{sync_id}/buckets/2", content=blobs[0]).status_code == 400
    else:
        assert begin(client, manifest_for(items, 2)).status_code == 200
    assert staged_dirs(shm_dir) == []
    assert len(pool_files(client)) == (2 if outcome == "commit" else 0)


def test_pool_files_are_reused_and_hold_exactly_the_new_body(client: TestClient, engine: FakeEngine) -> None:
    assert full_sync(client, tensors(seed=5), 1).status_code == 200
    first = pool_files(client)
    items = tensors(seed=6)
    assert full_sync(client, items, 2).status_code == 200
    assert pool_files(client) == first  # the same files, overwritten (a shorter body truncates)
    assert engine.weights == {t.name: bytes(t.data) for t in items}


def test_shm_bucket_is_adopted_not_copied(client: TestClient, engine: FakeEngine, shm_dir: Path) -> None:
    """The server keeps its own link to the learner's file: the learner's name may go or be replaced."""
    items = tensors(seed=3)
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    for i, blob in enumerate(bucket_blobs(items, manifest)):
        learner_file = shm_dir / f"b{i}.safetensors"
        learner_file.write_bytes(blob)
        assert (
            client.post(
                f"{SYNC}/{sync_id}/buckets/{i}/shm", json={"file_name": learner_file.name}
            ).status_code
            == 200
        )
        (staged,) = [p for p in staged_dirs(shm_dir)[0].iterdir() if p.name.startswith(f"b{i}-")]
        assert os.stat(staged).st_ino == os.stat(learner_file).st_ino  # the same inode, no copy
        replacement = shm_dir / ".next.tmp"
        replacement.write_bytes(b"x" * len(blob))
        os.replace(replacement, learner_file)  # what the learner's next write of that name does
    assert client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
    assert engine.weights == {t.name: bytes(t.data) for t in items}


def test_bucket_streamed_from_parts(client: TestClient, engine: FakeEngine) -> None:
    """A body sent as header + tensor views (the learner's zero-copy form) stages like one blob."""
    items = tensors(seed=4)
    manifest = manifest_for(items, 1)
    by_name = {t.name: t for t in items}
    sync_id = begin(client, manifest).json()["sync_id"]
    for i, bucket in enumerate(manifest["buckets"]):
        parts = bucket_parts([by_name[t["name"]] for t in bucket["tensors"]])
        body = (bytes(p) for p in parts)
        assert client.put(f"{SYNC}/{sync_id}/buckets/{i}", content=body).status_code == 200
    assert client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
    assert engine.weights == {t.name: bytes(t.data) for t in items}


COLLECTIVE = {"backend": "gloo", "master_address": "127.0.0.1", "master_port": 29999, "group": "ab12cd34"}


@pytest.mark.parametrize(
    ("collective", "status", "kind"),
    [
        (COLLECTIVE, 400, "collective_unsupported"),  # the fake engine has no receivers
        (COLLECTIVE | {"backend": "mpi"}, 422, None),
        (COLLECTIVE | {"master_port": 0}, 422, None),
        (COLLECTIVE | {"group": "../x"}, 422, None),
        (COLLECTIVE | {"timeout_s": 0}, 422, None),
    ],
)
def test_collective_begin_is_validated_and_changes_nothing(
    client: TestClient, engine: FakeEngine, collective: dict[str, Any], status: int, kind: str | None
) -> None:
    resp = begin(client, manifest_for(tensors(), 1), collective=collective)
    assert resp.status_code == status, resp.text
    if kind is not None:
        assert resp.json()["error"]["type"] == kind and "http or shm" in resp.json()["error"]["message"]
    assert engine.weight_version == 0 and client.app.state.server.staging.active_sync_id is None  # type: ignore[attr-defined]


class CollectiveFake(FakeEngine):
    """A fake engine with `ranks` weight-sync receivers: each receive is logged and waits for `release` (then
    fails with `error` when set); a committed collective sync only moves the version."""

    def __init__(self, ranks: int = 2) -> None:
        super().__init__()
        self.ranks = ranks
        self.group: str | None = None
        self.release = threading.Event()
        self.error: str | None = None
        self.log: list[tuple[str, int, int]] = []

    @property
    def collective_ranks(self) -> int:
        return self.ranks

    def holds_group(self, group: str) -> bool:
        return self.group == group

    async def receive_collective(self, rendezvous: Rendezvous, first_rank: int, buckets: Any) -> None:
        self.log.append(("start", first_rank, rendezvous.world_size))
        await asyncio.to_thread(self.release.wait, 10)
        self.log.append(("end", first_rank, rendezvous.world_size))
        if self.error:
            self.group = None
            raise EngineError(self.error)
        self.group = rendezvous.group

    async def apply_update(self, update: StagedUpdate) -> None:
        if isinstance(update, ReceivedUpdate):
            self.applied.append(update)
            self.version = update.version
            return
        await super().apply_update(update)


@pytest.fixture
def collective_engine() -> CollectiveFake:
    return CollectiveFake(ranks=2)


@pytest.fixture
def collective_client(cfg: ServerConfig, collective_engine: CollectiveFake) -> Iterator[TestClient]:
    with TestClient(create_app(cfg, engine=collective_engine)) as test_client:
        yield test_client


def test_health_reports_the_weight_sync_receivers(collective_client: TestClient, client: TestClient) -> None:
    assert collective_client.get("/health").json()["collective_ranks"] == 2
    assert client.get("/health").json()["collective_ranks"] is None  # an engine that cannot receive


@pytest.mark.parametrize(
    ("ranks", "status", "kind"),
    [
        ({"world_size": 6, "rank_offset": 3}, 200, None),  # ranks 3..4 of 6: another server holds 1..2 and 5
        ({}, 200, None),  # one server: ranks 1..2 of 3
        ({"world_size": 6, "rank_offset": 5}, 400, "collective_ranks"),  # 2 receivers do not fit in 5..5
        ({"world_size": 4, "rank_offset": 4}, 422, None),  # outside the group
        ({"world_size": 1}, 422, None),
        ({"rank_offset": 0}, 422, None),  # rank 0 is the learner
    ],
)
def test_collective_begin_takes_the_ranks_the_learner_assigns(
    collective_client: TestClient,
    collective_engine: CollectiveFake,
    ranks: dict,
    status: int,
    kind: str | None,
) -> None:
    resp = begin(collective_client, manifest_for(tensors(), 1), collective=COLLECTIVE | ranks)
    assert resp.status_code == status, resp.text
    if status != 200:
        assert kind is None or error_type(resp) == kind
        assert (
            collective_engine.log == [] and collective_client.app.state.server.staging.active_sync_id is None
        )  # type: ignore[attr-defined]
        return
    assert resp.json()["collective_ranks"] == 2 and resp.json()["collective_joining"]
    first, world = ranks.get("rank_offset", 1), ranks.get("world_size", 3)
    time.sleep(0.2)
    assert collective_engine.log == [("start", first, world)]
    collective_engine.release.set()


def test_prepare_waits_for_the_receive_and_commit_then_only_applies(
    collective_client: TestClient, collective_engine: CollectiveFake
) -> None:
    resp = begin(
        collective_client,
        manifest_for(tensors(), 1),
        collective=COLLECTIVE | {"world_size": 5, "rank_offset": 2},
    )
    sync_id = resp.json()["sync_id"]
    threading.Timer(0.5, collective_engine.release.set).start()
    started = time.monotonic()
    prepared = collective_client.post(f"{SYNC}/prepare", json={"sync_id": sync_id})
    assert prepared.status_code == 200, prepared.text
    assert time.monotonic() - started >= 0.4 and prepared.json()["received"] == len(
        manifest_for(tensors(), 1)["buckets"]
    )
    assert collective_engine.version == 0, "prepare applies nothing"
    committed = collective_client.post(f"{SYNC}/commit", json={"sync_id": sync_id})
    assert committed.status_code == 200 and committed.json()["weight_version"] == 1
    # A second sync names the same group: no new rendezvous.
    again = begin(
        collective_client,
        manifest_for(tensors(), 2),
        collective=COLLECTIVE | {"world_size": 5, "rank_offset": 2},
    )
    assert again.status_code == 200 and not again.json()["collective_joining"]
    assert (
        collective_client.post(f"{SYNC}/commit", json={"sync_id": again.json()["sync_id"]}).status_code == 200
    )


def test_prepare_of_a_failed_receive_discards_the_sync(
    collective_client: TestClient, collective_engine: CollectiveFake
) -> None:
    collective_engine.error = "a peer of the group died"
    collective_engine.release.set()
    sync_id = begin(collective_client, manifest_for(tensors(), 1), collective=COLLECTIVE).json()["sync_id"]
    prepared = collective_client.post(f"{SYNC}/prepare", json={"sync_id": sync_id})
    assert prepared.status_code == 400 and error_type(prepared) == "collective_failed"
    assert "a peer of the group died" in prepared.json()["error"]["message"]
    assert collective_client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 404
    assert collective_engine.version == 0


def test_an_aborted_receive_runs_out_before_the_next_sync_receives(
    collective_client: TestClient, collective_engine: CollectiveFake
) -> None:
    """A receive blocked in a broadcast cannot be interrupted: after an abort it runs out on its own, and the
    next sync's receive starts only then (never two receives on the engine's group at once)."""
    first = begin(collective_client, manifest_for(tensors(), 1), collective=COLLECTIVE).json()["sync_id"]
    assert collective_client.post(f"{SYNC}/abort", json={"sync_id": first}).json()["aborted"]
    second = begin(
        collective_client, manifest_for(tensors(), 1), collective=COLLECTIVE | {"group": "ef56ab78"}
    )
    assert second.status_code == 200
    time.sleep(0.2)
    assert collective_engine.log == [("start", 1, 3)], "the second receive waits for the first"
    collective_engine.release.set()
    sync_id = second.json()["sync_id"]
    assert collective_client.post(f"{SYNC}/prepare", json={"sync_id": sync_id}).status_code == 200
    assert [event for event, _, _ in collective_engine.log] == ["start", "end", "start", "end"]
    assert collective_client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).json()["weight_version"] == 1


def test_prepare_of_an_http_sync_names_missing_buckets(client: TestClient) -> None:
    items = tensors()
    manifest = manifest_for(items, 1)
    sync_id = begin(client, manifest).json()["sync_id"]
    blobs = bucket_blobs(items, manifest)
    assert client.put(f"{SYNC}/{sync_id}/buckets/0", content=blobs[0]).status_code == 200
    missing = client.post(f"{SYNC}/prepare", json={"sync_id": sync_id})
    assert missing.status_code == 400 and error_type(missing) == "missing_bucket"
    for i, blob in enumerate(blobs[1:], 1):
        assert client.put(f"{SYNC}/{sync_id}/buckets/{i}", content=blob).status_code == 200
    assert client.post(f"{SYNC}/prepare", json={"sync_id": sync_id}).status_code == 200
    assert client.post(f"{SYNC}/commit", json={"sync_id": sync_id}).status_code == 200
