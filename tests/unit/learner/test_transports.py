"""The weight-sync transports behind one interface (`learner.weights.transports`): the registry, the nccl
transport's device packing (double buffer, in-place single tensors, the one host wait at the end) exercised on
CPU tensors with a fake group, the policy's seed-plan line, and the ONE gloo group over every server (real
gloo, each fake server's receivers on threads of this process): ranks, one broadcast per bucket, the prepare
round before any commit, a dead server named and no server committing."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace
from typing import Any

import httpx
import pytest
import torch

from learner.weights.transports import (
    TRANSPORTS,
    Transport,
    TransportOptions,
    build_transport,
    gloo_nccl,
    register,
)
from learner.weights.transports.gloo_nccl import DeviceBucketPacker, NcclTransport
from learner.weights.types import SyncError, WeightUpdate
from rollout_server.weights.group_receive import open_receiver_group, receive_buckets
from shared_schemas.buckets import plan_buckets
from shared_schemas.sync import CollectiveSpec, SyncBeginRequest, SyncBeginResponse, SyncManifest, TensorSpec
from tests.unit.learner.test_client import URLS, Cluster, FakeServer, envelope, weights

CPU = torch.device("cpu")


def options(**kw: Any) -> TransportOptions:
    return TransportOptions(urls=("http://127.0.0.1:8000",), pool=ThreadPoolExecutor(1), **kw)


def test_every_configured_transport_is_registered_once() -> None:
    assert set(TRANSPORTS) == {"http", "shm", "gloo", "nccl"}
    assert all(cls.name == name for name, cls in TRANSPORTS.items())
    assert TRANSPORTS["gloo"].full_only and TRANSPORTS["nccl"].full_only
    assert not TRANSPORTS["http"].full_only and not TRANSPORTS["shm"].full_only
    with pytest.raises(ValueError, match="rollout.sync.transport must be one of"):
        build_transport("rdma", options())
    with pytest.raises(ValueError, match="registered already"):

        @register("http")
        class Other(Transport):
            pass


def test_transport_options_are_checked_by_the_transport(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match="shm_dir"):
        build_transport("shm", options())
    assert build_transport("shm", options(shm_dir=tmp_path)).name == "shm"
    remote = TransportOptions(urls=("http://10.0.0.2:8000",), pool=ThreadPoolExecutor(1))
    with pytest.raises(ValueError, match="collective_address"):
        build_transport("nccl", remote)


class FakeWork:
    def __init__(self, log: list[str], name: str) -> None:
        self.log, self.name = log, name

    def wait(self, *args: Any) -> bool:
        self.log.append(f"wait {self.name}")
        return True

    def is_completed(self) -> bool:
        return True


def test_packer_alternates_two_buffers_and_waits_for_their_readers() -> None:
    log: list[str] = []
    packer = DeviceBucketPacker(CPU, widest=64)
    a, b = torch.arange(4, dtype=torch.float32), torch.arange(6, dtype=torch.int16)
    flat0, slot0 = packer.pack([a, b], 28)
    assert (
        slot0 == 0
        and torch.equal(flat0[:16].view(torch.float32), a)
        and torch.equal(flat0[16:].view(torch.int16), b)
    )
    packer.reading(slot0, [FakeWork(log, "b0")])
    flat1, slot1 = packer.pack([b, a], 28)
    assert slot1 == 1 and log == []  # the other buffer: nothing to wait for
    packer.reading(slot1, [FakeWork(log, "b1")])
    _, slot2 = packer.pack([a, b], 28)
    assert slot2 == 0 and log == ["wait b0"]  # buffer 0 again: its broadcast must be done first
    assert packer.allocated_bytes == 128  # two buckets, never more


def test_packer_sends_a_lone_contiguous_tensor_in_place() -> None:
    packer = DeviceBucketPacker(CPU, widest=0)
    big = torch.randn(3, 5)
    flat, slot = packer.pack([big], big.numel() * 4)
    assert slot is None and flat.data_ptr() == big.data_ptr() and packer.allocated_bytes == 0
    with pytest.raises(SyncError, match="manifest says"):
        packer.pack([big], 7)
    with pytest.raises(SyncError, match="manifest says"):
        packer.pack([big, big], 7)


class FakeSender:
    """One group over every server: one broadcast (one work) per bucket."""

    fleet = None

    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []
        self.log: list[str] = []
        self.finished: list[int] = []

    def start_broadcast(self, flat: torch.Tensor, index: int) -> list[FakeWork]:
        self.sent.append((index, bytes(flat.numpy().tobytes())))
        return [FakeWork(self.log, f"b{index}")]

    def finish(self, works: Any, index: int) -> None:
        assert len(works) == 1
        self.finished.append(index)

    def drop(self) -> None:
        pass


def nccl_on_cpu(monkeypatch: pytest.MonkeyPatch) -> tuple[NcclTransport, FakeSender]:
    monkeypatch.setattr(gloo_nccl, "learner_device", lambda tensor: CPU)
    transport = NcclTransport(options())
    sender = FakeSender()
    transport.sender = sender  # type: ignore[assignment]
    return transport, sender


def test_nccl_send_broadcasts_every_bucket_and_waits_once(monkeypatch: pytest.MonkeyPatch) -> None:
    transport, sender = nccl_on_cpu(monkeypatch)
    tensors = {f"w{i}": torch.randn(8, 4) for i in range(5)} | {"big": torch.randn(64, 8)}
    specs = [TensorSpec(name=n, dtype="F32", shape=tuple(t.shape)) for n, t in tensors.items()]
    manifest = SyncManifest(mode="full", version=1, buckets=tuple(plan_buckets(specs, 300)))
    assert len(manifest.buckets) >= 3
    stages = {"produce_s": 0.0, "upload_s": 0.0}
    transport.send([], manifest, iter(tensors.items()), stages)
    assert [i for i, _ in sender.sent] == list(range(len(manifest.buckets)))
    for bucket, (_, raw) in zip(manifest.buckets, sender.sent, strict=True):
        want = b"".join(tensors[t.name].numpy().tobytes() for t in bucket.tensors)
        assert raw == want
    assert sender.finished == [len(manifest.buckets) - 1]  # the only host wait
    assert {"pack_enqueue_s", "wire_wait_s", "learner_buffer_bytes"} <= set(stages)


def test_nccl_send_refuses_tensors_out_of_manifest_order(monkeypatch: pytest.MonkeyPatch) -> None:
    transport, _ = nccl_on_cpu(monkeypatch)
    tensors = {"a": torch.zeros(2), "b": torch.zeros(2)}
    specs = [TensorSpec(name=n, dtype="F32", shape=(2,)) for n in tensors]
    manifest = SyncManifest(mode="full", version=1, buckets=tuple(plan_buckets(specs, 1 << 20)))
    with pytest.raises(SyncError, match="expected tensor 'a'"):
        transport.send(
            [], manifest, iter([("b", tensors["b"]), ("a", tensors["a"])]), {"produce_s": 0, "upload_s": 0}
        )
    with pytest.raises(SyncError, match="not in the sync manifest"):
        transport.send(
            [], manifest, iter([*tensors.items(), ("c", torch.zeros(2))]), {"produce_s": 0, "upload_s": 0}
        )


def test_seed_plan_names_the_stage2_formula_only_when_given(caplog: pytest.LogCaptureFixture) -> None:
    from learner.rollout.seeds import stage2_seed_plan
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    assert "x 1000003" not in WeightSyncPolicy(SyncConfig(), seed=7)._seed_plan(3)  # GRPO: no stage-2 formula
    assert "training.seed 7" in WeightSyncPolicy(SyncConfig(), seed=7)._seed_plan(3)
    line = WeightSyncPolicy(SyncConfig(), seed=7, seed_plan=stage2_seed_plan(7))._seed_plan(3)
    assert "training.seed 7 + step 3 x 1000003" in line
    with caplog.at_level(logging.INFO):
        assert "per-request seeds from the batch" in WeightSyncPolicy(SyncConfig())._seed_plan(0)


def test_sync_report_names_collective_transports() -> None:
    from typing import get_args, get_type_hints

    from learner.weights.types import SyncReport

    assert set(get_args(get_type_hints(SyncReport)["transport"])) >= {
        "http",
        "shm",
        "gloo",
        "nccl",
        "in_process",
    }


# -- one weight-sync group over every server (gloo, receivers on threads of this process) --------------------


class CollectiveServer(FakeServer):
    """A fake server whose `ranks` receivers are threads of this process in the learner's real gloo group:
    they join at the begin's ranks, receive every broadcast (the server's `receive_buckets`), and the prepare
    waits for them; `dead` refuses every connection from then on (a crashed server)."""

    def __init__(self, url: str, ranks: int) -> None:
        super().__init__(url)
        self.ranks = ranks
        self.specs: list[CollectiveSpec] = []
        self.token: str | None = None
        self.groups: list[Any] = []
        self.threads: list[threading.Thread] = []
        self.received: list[dict[str, torch.Tensor] | Exception] = []
        self.dead = False
        self.stop_after: int | None = None  # receivers go silent after this many buckets (the server hangs)

    def health(self) -> dict:
        return super().health() | {"collective_ranks": self.ranks}

    def handle(self, request: httpx.Request) -> httpx.Response:
        if self.dead:
            raise httpx.ConnectError("connection refused", request=request)
        path = request.url.path
        if path == "/sync_weights/begin":
            body = SyncBeginRequest.model_validate_json(request.content)
            if body.collective is not None:
                self.routes.append(f"{request.method} {path}")
                return self.begin_collective(body)
        if path == "/sync_weights/prepare":
            self.routes.append(f"{request.method} {path}")
            for thread in self.threads:
                thread.join(10)
            failed = [r for r in self.received if isinstance(r, Exception)]
            if failed or len(self.received) < self.ranks:
                return envelope(400, "collective_failed", f"receiving failed ({failed[:1]})")
            return httpx.Response(200, json={"sync_id": "ab" * 8, "received": 1, "receive_s": 0.0})
        if path == "/sync_weights/commit":
            self.buckets = {}  # the weights came over the group: `received`
        return super().handle(request)

    def begin_collective(self, body: SyncBeginRequest) -> httpx.Response:
        spec = body.collective
        assert spec is not None
        self.manifest = body.manifest
        self.specs.append(spec)
        joining = self.token != spec.group
        world = spec.world_size if spec.world_size is not None else 1 + self.ranks
        rendezvous = SimpleNamespace(**(spec.model_dump() | {"world_size": world}))
        layout = [[(t.name, t.dtype, t.shape) for t in b.tensors] for b in body.manifest.buckets]
        if joining:
            self.token, self.groups = spec.group, [None] * self.ranks
        self.received = []
        stop = self.stop_after

        def receive(k: int) -> None:
            try:
                if self.groups[k] is None:
                    self.groups[k] = open_receiver_group(rendezvous, spec.rank_offset + k)
                result = receive_buckets(
                    self.groups[k], layout[:stop], device="cpu", timeout_s=spec.timeout_s
                )
                if stop is not None:
                    raise RuntimeError("went silent")
                self.received.append({n: t.clone() for n, t in result.tensors})
            except Exception as exc:
                self.received.append(exc)

        self.threads = [threading.Thread(target=receive, args=(k,), daemon=True) for k in range(self.ranks)]
        for thread in self.threads:
            thread.start()
        return httpx.Response(
            200,
            json={"sync_id": "ab" * 8, "current_version": self.weight_version, "num_buckets": len(layout),
                  "expires_in_s": 60, "collective_ranks": self.ranks, "collective_joining": joining},
        )  # fmt: skip


def collective_cluster(ranks: list[int]) -> Cluster:
    cluster = Cluster(0)
    cluster.servers = {URLS[i]: CollectiveServer(URLS[i], n) for i, n in enumerate(ranks)}
    return cluster


def counting(group: Any, calls: list[int]) -> Any:
    """`group` with its broadcasts counted."""

    class Counted:
        counted = True

        def broadcast(self, *args: Any) -> Any:
            calls.append(args[0].numel())
            return group.broadcast(*args)

    return Counted()


def test_one_gloo_group_spans_every_server_and_each_bucket_is_one_broadcast() -> None:
    cluster = collective_cluster([1, 2, 1])
    tensors = weights()
    calls: list[int] = []
    with cluster.source(transport="gloo", bucket_mb=0.005, collective_timeout_s=20) as source:
        transport = source.weight_sync.transport
        assert isinstance(transport, gloo_nccl._Collective)
        connect = transport.sender.connect

        def connect_and_count(urls: Any, begins: Any) -> None:
            connect(urls, begins)
            fleet = transport.sender.fleet
            if not getattr(fleet.group, "counted", False):
                fleet.group = counting(fleet.group, calls)

        transport.sender.connect = connect_and_count  # type: ignore[method-assign]
        source.sync_weights(WeightUpdate(mode="full", version=1, tensors=tensors))
        buckets = len(cluster[0].manifest.buckets)
        assert buckets >= 3 and len(calls) == buckets  # ONE broadcast per bucket, not one per server
        assert source.last_sync_stages["collective_world_size"] == 5.0
        # Ranks in server order: learner 0, server 0 -> 1, server 1 -> 2..3, server 2 -> 4.
        assert [(s.specs[0].world_size, s.specs[0].rank_offset) for s in cluster.servers.values()] == [
            (5, 1), (5, 2), (5, 4)
        ]  # fmt: skip
        assert len({s.specs[0].group for s in cluster.servers.values()}) == 1
        for server in cluster.servers.values():
            assert len(server.received) == server.ranks
            for got in server.received:
                assert isinstance(got, dict) and all(torch.equal(got[n], t) for n, t in tensors.items())
            # Every server confirmed every bucket before the first commit.
            assert server.routes == ["GET /health", "POST /sync_weights/begin", "POST /sync_weights/prepare",
                                     "POST /sync_weights/commit"]  # fmt: skip
            assert server.weight_version == 1
        # The next sync reuses the group: no /health round, the same token, the same ranks.
        source.sync_weights(WeightUpdate(mode="full", version=2, tensors=tensors))
        assert len(calls) == 2 * buckets
        for server in cluster.servers.values():
            assert server.specs[1] == server.specs[0] and server.routes.count("GET /health") == 1
            assert server.weight_version == 2


@pytest.mark.parametrize("when", ["before", "mid"])
def test_a_dead_server_fails_the_sync_naming_it_and_no_server_commits(when: str) -> None:
    """`before`: the server died between two syncs (its begin is refused). `mid`: it answered the begin, its
    receivers went silent after the first bucket and the server stopped answering; the learner's prepare round
    fails at once on it, and the other servers, whose receive may have finished, commit nothing."""
    cluster = collective_cluster([1, 1, 1])
    tensors = weights()
    with cluster.source(transport="gloo", bucket_mb=0.005, collective_timeout_s=3) as source:
        source.sync_weights(WeightUpdate(mode="full", version=1, tensors=tensors))
        doomed = cluster[1]
        if when == "before":
            doomed.dead = True
        else:
            doomed.stop_after = 1
            original = doomed.begin_collective

            def begin_then_die(body: SyncBeginRequest) -> httpx.Response:
                response = original(body)
                threading.Timer(0.2, lambda: setattr(doomed, "dead", True)).start()
                return response

            doomed.begin_collective = begin_then_die  # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(SyncError) as info:
            source.sync_weights(WeightUpdate(mode="full", version=2, tensors=tensors))
        elapsed = time.monotonic() - started
        assert transport_fleet(source) is None  # dropped: the next sync plans a new group
    message = str(info.value)
    if when == "before":  # the client's own message: its begin got no answer
        assert f"to {doomed.url} failed" in message and "is it running?" in message
    else:
        assert f"rollout server {doomed.url} no longer answers" in message and "No server applied" in message
    assert elapsed < 3 + 10, "bounded by rollout.sync.collective_timeout_s (+ the prepare margin)"
    for server in (cluster[0], cluster[2]):
        assert server.weight_version == 1, "no server commits a sync another server did not receive"
        assert "POST /sync_weights/commit" not in server.routes[4:]  # routes 0-3: the first sync
    assert (
        cluster[0].routes[-1] == "POST /sync_weights/abort"
    )  # (server 2 got no begin when server 1's failed)
    if when == "mid":
        assert cluster[2].routes[-1] == "POST /sync_weights/abort"


def transport_fleet(source: Any) -> Any:
    return source.weight_sync.transport.sender.fleet


def test_sender_plans_ranks_and_refuses_servers_out_of_step() -> None:
    from learner.weights.group_send import CollectiveSender

    sender = CollectiveSender("gloo", "127.0.0.1", timeout_s=5)
    urls = URLS[:3]
    specs = sender.specs(urls, [2, 1, 3])
    assert [(s.world_size, s.rank_offset) for s in specs] == [(7, 1), (7, 3), (7, 4)]
    assert sender.holds(urls) and not sender.holds(urls[:2])
    assert sender.specs(urls) == specs  # planned: no counts needed, the same group
    begin = {"sync_id": "ab" * 8, "current_version": 0, "num_buckets": 1, "expires_in_s": 9}
    begins = [SyncBeginResponse(**begin, collective_ranks=n, collective_joining=True) for n in (2, 2, 3)]
    with pytest.raises(SyncError, match=f"{URLS[1]} brings 2 weight-sync receivers, its /health said 1"):
        sender.connect(urls, begins)
    assert sender.fleet is None
    sender.specs(urls, [2, 1, 3])
    sender.fleet.group = object()  # type: ignore[union-attr]  # formed at an earlier sync
    begins = [SyncBeginResponse(**begin, collective_ranks=n, collective_joining=False) for n in (2, 1, 3)]
    begins[1] = SyncBeginResponse(**begin, collective_ranks=1, collective_joining=True)  # restarted
    with pytest.raises(SyncError, match=f"{URLS[1]} no longer holds weight-sync group"):
        sender.connect(urls, begins)
    assert sender.fleet is None
    with pytest.raises(ValueError, match="every server"):
        sender.specs(urls, [2, None, 3])
    # A lone server that does not report its receivers: its group is itself (the begin answer says how many).
    (lone,) = sender.specs(urls[:1], [None])
    assert lone.world_size is None and lone.rank_offset == 1
