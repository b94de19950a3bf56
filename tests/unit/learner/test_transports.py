"""The weight-sync transports behind one interface (`learner.rollout.transports`): the registry, the nccl
transport's device packing (double buffer, in-place single tensors, the one host wait at the end) exercised on
CPU tensors with a fake group, and the policy's seed-plan line."""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from learner.rollout.base import SyncError
from learner.rollout.transports import TRANSPORTS, Transport, TransportOptions, build_transport, register
from learner.rollout.transports import collective as collective_transport
from learner.rollout.transports.collective import DeviceBucketPacker, NcclTransport
from shared_schemas.buckets import plan_buckets
from shared_schemas.sync import SyncManifest, TensorSpec

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
    def __init__(self) -> None:
        self.sent: list[tuple[int, bytes]] = []
        self.log: list[str] = []
        self.finished: list[int] = []

    def start_broadcast(self, urls: Any, flat: torch.Tensor, index: int) -> list[FakeWork]:
        self.sent.append((index, bytes(flat.numpy().tobytes())))
        return [FakeWork(self.log, f"b{index}")]

    def finish(self, urls: Any, works: Any, index: int) -> None:
        self.finished.append(index)


def nccl_on_cpu(monkeypatch: pytest.MonkeyPatch) -> tuple[NcclTransport, FakeSender]:
    monkeypatch.setattr(collective_transport, "learner_device", lambda tensor: CPU)
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
    from learner.weights.sync import SyncConfig, WeightSyncPolicy, stage2_seed_plan

    assert "x 1000003" not in WeightSyncPolicy(SyncConfig(), seed=7)._seed_plan(3)  # GRPO: no stage-2 formula
    assert "training.seed 7" in WeightSyncPolicy(SyncConfig(), seed=7)._seed_plan(3)
    line = WeightSyncPolicy(SyncConfig(), seed=7, seed_plan=stage2_seed_plan(7))._seed_plan(3)
    assert "training.seed 7 + step 3 x 1000003" in line
    with caplog.at_level(logging.INFO):
        assert "per-request seeds from the batch" in WeightSyncPolicy(SyncConfig())._seed_plan(0)


def test_sync_report_names_collective_transports() -> None:
    from typing import get_args, get_type_hints

    from learner.rollout.base import SyncReport

    assert set(get_args(get_type_hints(SyncReport)["transport"])) >= {
        "http",
        "shm",
        "gloo",
        "nccl",
        "in_process",
    }
