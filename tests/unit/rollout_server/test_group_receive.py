"""The receiving side of the collective transport on CPU (`weights.group_receive`, `server.sync_staging`): the
one receive function with a fake group, where it stages, the staging knob and gauge, and the HF engine's
commit that rebinds its parameters to the received buffers instead of copying."""

from __future__ import annotations

import datetime
from pathlib import Path
from typing import Any

import pytest
import torch
from pydantic import ValidationError

from rollout_server.config import ServerConfig
from rollout_server.metrics import ServerMetrics
from rollout_server.weights.group_receive import receive_buckets, resolve_staging

LAYOUT = [
    [("a", "F32", (2, 3)), ("b", "BF16", (3,))],  # b starts at byte 24: aligned
    [("c", "I8", (3,)), ("d", "F32", (2,))],  # d starts at byte 3: unaligned, copied
]


class FakeWork:
    def wait(self, *args: Any) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class FakeGroup:
    """Fills each broadcast buffer with the next payload, as rank 0 would."""

    def __init__(self, payloads: list[bytes]) -> None:
        self.payloads = list(payloads)
        self.timeouts: list[datetime.timedelta] = []

    def broadcast(self, flat: torch.Tensor, root: int, timeout: datetime.timedelta) -> FakeWork:
        assert root == 0
        self.timeouts.append(timeout)
        flat.copy_(torch.frombuffer(bytearray(self.payloads.pop(0)), dtype=torch.uint8))
        return FakeWork()


def payloads() -> tuple[dict[str, torch.Tensor], list[bytes]]:
    tensors = {
        "a": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "b": torch.tensor([1.5, -2.0, 3.0], dtype=torch.bfloat16),
        "c": torch.tensor([1, -2, 3], dtype=torch.int8),
        "d": torch.tensor([0.25, 8.0], dtype=torch.float32),
    }
    raw = [
        b"".join(tensors[n].view(torch.uint8).numpy().tobytes() for n, _, _ in bucket) for bucket in LAYOUT
    ]
    return tensors, raw


def test_receive_stages_every_tensor_in_manifest_order() -> None:
    tensors, raw = payloads()
    group = FakeGroup(raw)
    result = receive_buckets(group, LAYOUT, device="cpu", timeout_s=7, staging="device")
    assert [n for n, _ in result.tensors] == ["a", "b", "c", "d"]
    for name, got in result.tensors:
        assert got.dtype == tensors[name].dtype and torch.equal(got, tensors[name])
    assert group.timeouts == [datetime.timedelta(seconds=7)] * 2
    # On a CPU host the received buffers ARE host memory, whatever the knob says.
    assert result.staging == "host" and result.staged_bytes == sum(len(r) for r in raw)
    assert result.stages == {"staging_device_bytes": 0.0, "staging_host_bytes": float(result.staged_bytes)}
    assert [b.numel() for b in result.buffers] == [len(r) for r in raw]


def test_receive_lands_in_reusable_buffers() -> None:
    _, raw = payloads()
    first = receive_buckets(FakeGroup(raw), LAYOUT, device="cpu", timeout_s=5)
    again = receive_buckets(FakeGroup(raw), LAYOUT, device="cpu", timeout_s=5, reuse=first.buffers)
    assert [b.data_ptr() for b in again.buffers] == [b.data_ptr() for b in first.buffers]
    wrong = receive_buckets(FakeGroup(raw), LAYOUT, device="cpu", timeout_s=5, reuse=first.buffers[1:])
    assert wrong.buffers[0].data_ptr() != first.buffers[1].data_ptr()  # a size mismatch is never reused


def test_a_failed_broadcast_names_the_bucket() -> None:
    class Broken(FakeGroup):
        def broadcast(self, flat: torch.Tensor, root: int, timeout: datetime.timedelta) -> FakeWork:
            if not self.payloads[1:]:
                raise RuntimeError("peer closed")
            return super().broadcast(flat, root, timeout)

    _, raw = payloads()
    with pytest.raises(RuntimeError, match="receiving bucket 1 of 2 .*peer closed"):
        receive_buckets(Broken(raw), LAYOUT, device="cpu", timeout_s=5)


def test_staging_knob_is_validated_and_resolved() -> None:
    assert ServerConfig(model="m").sync_staging == "auto"
    assert ServerConfig(model="m", sync_staging="host").sync_staging == "host"
    with pytest.raises(ValidationError, match="sync_staging"):
        ServerConfig(model="m", sync_staging="gpu")  # type: ignore[arg-type]
    assert resolve_staging("device", "cpu", 10) == "host"


def test_staging_gauge_follows_the_last_committed_full_sync() -> None:
    metrics = ServerMetrics()
    for version, (device, host) in enumerate([(10.0, 0.0), (0.0, 10.0)], start=1):
        stages = {"staging_device_bytes": device, "staging_host_bytes": host}
        metrics.sync_finished(
            mode="full", transport="x", outcome="committed", nbytes=10, seconds=0.1, stages=stages
        )
        text = metrics.render(status="ok", weight_version=version).decode()
        assert f'rollmatch_weight_sync_staging_bytes{{where="device"}} {device}' in text
        assert f'rollmatch_weight_sync_staging_bytes{{where="host"}} {host}' in text


TINY = Path(__file__).resolve().parents[3] / ".cache" / "models" / "tiny-qwen2"


@pytest.mark.skipif(not (TINY / "config.json").exists(), reason="needs the tiny model (make setup)")
def test_hf_commit_rebinds_parameters_to_the_received_buffers() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rollout_server.engines.base import ReceivedUpdate
    from rollout_server.engines.hf import HfEngine

    model = AutoModelForCausalLM.from_pretrained(TINY).eval()
    engine = HfEngine(model, AutoTokenizer.from_pretrained(TINY), model_name="tiny", max_model_len=64)
    names = list(engine.parameter_specs())
    params = dict(model.named_parameters())

    def stage(offset: float) -> list[torch.Tensor]:
        received, buffers = {}, []
        for name in names:
            if name not in params:  # a tied duplicate travels once
                continue
            value = params[name].detach() + offset
            flat = value.reshape(-1).view(torch.uint8).clone()
            buffers.append(flat)
            received[name] = flat.view(value.dtype).reshape(value.shape)
        engine._received, engine._received_buffers = received, buffers
        return buffers

    old = {n: p.detach().clone() for n, p in params.items()}
    first = stage(1.0)
    engine._apply_full(ReceivedUpdate(version=1, names=tuple(engine._received)))
    assert "commit_swap_s" in engine.last_update_stages and engine.weight_version == 1
    for name, param in model.named_parameters():
        assert torch.equal(param.detach(), old[name] + 1.0)
    assert [b.data_ptr() for b in engine._live_buffers] == [b.data_ptr() for b in first]
    assert engine._spare_buffers == []
    if model.config.tie_word_embeddings:
        assert model.lm_head.weight is model.get_input_embeddings().weight
    stage(2.0)
    engine._apply_full(ReceivedUpdate(version=2, names=tuple(engine._received)))
    assert [b.data_ptr() for b in engine._spare_buffers] == [
        b.data_ptr() for b in first
    ]  # the first sync's buffers back no parameter any more
    assert all(torch.allclose(p.detach(), old[n] + 3.0) for n, p in model.named_parameters())


def test_the_server_receives_every_transport_the_learner_sends() -> None:
    from learner.weights.transports import TRANSPORTS
    from rollout_server.weights.receivers import RECEIVERS, CollectiveReceiver, FileReceiver

    assert set(RECEIVERS) == set(TRANSPORTS)
    assert all(cls.name == name for name, cls in RECEIVERS.items())
    assert issubclass(RECEIVERS["http"], FileReceiver) and issubclass(RECEIVERS["shm"], FileReceiver)
    assert issubclass(RECEIVERS["gloo"], CollectiveReceiver) and issubclass(
        RECEIVERS["nccl"], CollectiveReceiver
    )
