"""`WeightSyncPolicy` (docs/ALGORITHM.md#sync-cadence, docs/ARCHITECTURE.md#weight-sync): cadence, mode
choice, adapter → full fallback."""

from __future__ import annotations

import logging
import threading

import pytest
import torch
from peft import LoraConfig, get_peft_model
from pydantic import ValidationError
from torch import nn

from learner.weights.sync import SyncConfig, WeightSyncPolicy
from learner.weights.types import SyncError, SyncRejected, SyncReport, WeightUpdate
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferResult


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(8, 8)
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.proj(x))


def peft_tiny() -> nn.Module:
    model = get_peft_model(Tiny(), LoraConfig(r=2, target_modules=["proj"]))
    with torch.no_grad():
        model.base_model.model.proj.lora_B["default"].weight.fill_(0.5)
    return model


class FakeSource:
    """A `RolloutSource` that records syncs; refuses adapters (409-style) when `refuse_adapter`."""

    def __init__(
        self, *, lora_enabled: bool = False, refuse_adapter: bool = False, weight_version: int = 0
    ) -> None:
        self.lora_enabled = lora_enabled
        self.refuse_adapter = refuse_adapter
        self.weight_version = weight_version
        self.updates: list[tuple[str, int, dict[str, torch.Tensor]]] = []
        self.attempts: list[tuple[str, int]] = []

    @property
    def endpoints(self) -> tuple[str, ...]:
        return ("fake://0",)

    def infer(self, batch: InferBatch) -> list[InferResult]:
        return []

    def sync_weights(self, update: WeightUpdate) -> SyncReport:
        self.attempts.append((update.mode, update.version))
        if update.mode == "adapter" and self.refuse_adapter:
            raise SyncRejected("adapter sync refused: the server runs without LoRA")
        assert update.version > self.weight_version, "versions must strictly increase"
        tensors = {name: t.clone() for name, t in update.iter_tensors()}
        self.updates.append((update.mode, update.version, tensors))
        self.weight_version = update.version
        return SyncReport(update.mode, update.version, 0, 0.0, "in_process", self.endpoints)

    def health(self) -> Health:
        return Health(
            status="ok",
            engine="vllm",
            model="fake",
            weight_version=self.weight_version,
            dp=1,
            tp=1,
            lora_enabled=self.lora_enabled,
            max_model_len=64,
            uptime_s=0.0,
        )

    def close(self) -> None:
        pass


def test_syncs_once_per_step() -> None:
    """§5.6: steps 0, 0, 1 → two syncs (last_synced_step starts at −1, so step 0 syncs)."""
    policy = WeightSyncPolicy(SyncConfig())
    source = FakeSource()
    model = Tiny()
    assert policy.last_synced_step == -1
    seconds = [policy.maybe_sync(model, step, source) for step in (0, 0, 1)]
    assert [(mode, version) for mode, version, _ in source.updates] == [("full", 1), ("full", 2)]
    assert seconds[0] > 0 and seconds[1] == 0.0 and seconds[2] > 0
    assert policy.last_synced_step == 1


def test_the_wait_for_other_ranks_is_kept_out_of_the_sync_seconds() -> None:
    """`time/weight_sync_s` is the sync itself; the closing all-rank agreement (here a slow peer: 0.3 s per
    round) is `last_agree_s`, so a rank that waits for the slowest does not read as a slow sync."""
    import time

    def slow_peer(ok: bool) -> bool:
        time.sleep(0.3)
        return ok

    policy = WeightSyncPolicy(SyncConfig(), all_ok=slow_peer)
    seconds = policy.maybe_sync(Tiny(), 0, FakeSource())
    assert 0 < seconds < 0.3 <= policy.last_agree_s
    assert policy.maybe_sync(Tiny(), 0, FakeSource()) == 0.0 and policy.last_agree_s == 0.0


def test_full_sync_sends_merged_base_weights_and_unmerges() -> None:
    model = peft_tiny()
    before = model.base_model.model.proj.base_layer.weight.detach().clone()
    source = FakeSource()
    WeightSyncPolicy(SyncConfig(mode="full")).maybe_sync(model, 0, source)
    _, _, sent = source.updates[0]
    assert list(sent) == ["proj.weight", "proj.bias", "head.weight", "head.bias"]
    lora = model.base_model.model.proj
    delta = lora.lora_B["default"].weight @ lora.lora_A["default"].weight * lora.scaling["default"]
    torch.testing.assert_close(sent["proj.weight"], before + delta)
    assert torch.equal(lora.base_layer.weight, before) and not lora.merged


def test_adapter_rejected_falls_back_to_full_once_and_stays_full(caplog: pytest.LogCaptureFixture) -> None:
    policy = WeightSyncPolicy(SyncConfig(mode="adapter", fallback_to_full=True))
    source = FakeSource(refuse_adapter=True)
    model = peft_tiny()
    with caplog.at_level(logging.WARNING, logger="learner.weights.sync"):
        policy.maybe_sync(model, 0, source)
        policy.maybe_sync(model, 1, source)
        policy.maybe_sync(model, 2, source)
    assert source.attempts == [("adapter", 1), ("full", 2), ("full", 3), ("full", 4)]
    assert [mode for mode, _, _ in source.updates] == ["full", "full", "full"]
    assert policy.mode == "full" and policy.request_adapter is None
    warnings = [r for r in caplog.records if "falling back to full" in r.getMessage()]
    assert len(warnings) == 1


def test_adapter_rejected_without_fallback_raises() -> None:
    policy = WeightSyncPolicy(SyncConfig(mode="adapter", fallback_to_full=False))
    with pytest.raises(SyncRejected):
        policy.maybe_sync(peft_tiny(), 0, FakeSource(refuse_adapter=True))
    assert policy.last_synced_step == -1


def test_adapter_sync_sends_the_adapter() -> None:
    policy = WeightSyncPolicy(SyncConfig(mode="adapter"), adapter_name="pol")
    source = FakeSource(lora_enabled=True)
    policy.maybe_sync(peft_tiny(), 0, source)
    mode, version, sent = source.updates[0]
    assert (mode, version) == ("adapter", 1)
    assert sorted(sent) == ["base_model.model.proj.lora_A.weight", "base_model.model.proj.lora_B.weight"]
    assert policy.request_adapter == "pol"


@pytest.mark.parametrize(
    ("lora_enabled", "peft", "expected"),
    [(True, True, "adapter"), (False, True, "full"), (True, False, "full")],
    ids=["lora-server-peft-model", "no-lora-server", "plain-model"],
)
def test_auto_mode(lora_enabled: bool, peft: bool, expected: str) -> None:
    policy = WeightSyncPolicy(SyncConfig(mode="auto"))
    source = FakeSource(lora_enabled=lora_enabled)
    policy.maybe_sync(peft_tiny() if peft else Tiny(), 0, source)
    assert policy.mode == expected and source.updates[0][0] == expected


def test_adapter_mode_needs_a_peft_model() -> None:
    with pytest.raises(ValueError, match="PEFT"):
        WeightSyncPolicy(SyncConfig(mode="adapter")).maybe_sync(Tiny(), 0, FakeSource())


def test_versions_continue_above_the_servers() -> None:
    """A resumed learner meets a server already at version 7: the next sync is 8, not 1."""
    source = FakeSource(weight_version=7)
    policy = WeightSyncPolicy(SyncConfig())
    policy.maybe_sync(Tiny(), 0, source)
    assert source.updates[0][1] == 8 and policy.version == 8


def test_only_rank0_sends_and_every_rank_meets_the_barrier() -> None:
    flags: list[tuple[str, bool]] = []
    source = FakeSource()
    for rank in (0, 1):

        def all_ok(ok: bool, rank: int = rank) -> bool:
            flags.append((f"r{rank}", ok))
            return ok

        policy = WeightSyncPolicy(SyncConfig(), is_rank0=lambda rank=rank: rank == 0, all_ok=all_ok)
        policy.maybe_sync(Tiny(), 0, source)
        assert policy.last_synced_step == 0
    # The sync round, then the mode round (rank 0: "is it adapter?" False; the others pass True).
    assert len(source.updates) == 1
    assert flags == [("r0", True), ("r0", False), ("r1", True), ("r1", True)]


def sync_on_two_ranks(
    source: FakeSource, step: int
) -> tuple[dict[int, BaseException], list[WeightSyncPolicy]]:
    """Runs `maybe_sync` on two thread "ranks" joined by a real AND-collective; returns each rank's error."""
    barrier = threading.Barrier(2, timeout=30)
    flags: dict[int, bool] = {}
    errors: dict[int, BaseException] = {}

    def all_ok(ok: bool, rank: int) -> bool:
        flags[rank] = ok
        barrier.wait()
        result = all(flags.values())
        barrier.wait()  # everyone has read this round's flags before the next round writes
        return result

    policies = [
        WeightSyncPolicy(
            SyncConfig(), is_rank0=lambda r=rank: r == 0, all_ok=lambda ok, r=rank: all_ok(ok, r)
        )
        for rank in (0, 1)
    ]

    def run(rank: int) -> None:
        try:
            policies[rank].maybe_sync(Tiny(), step, source)
        except Exception as exc:
            errors[rank] = exc

    threads = [threading.Thread(target=run, args=(rank,)) for rank in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads)
    return errors, policies


def test_a_failed_sync_on_rank0_stops_every_rank_instead_of_hanging() -> None:
    """Two ranks as threads with a real AND-collective: rank 0's server is gone, so rank 0 raises its
    own error and rank 1 (which sent nothing) raises a SyncError naming rank 0, and neither waits forever."""

    class Broken(FakeSource):
        def sync_weights(self, update: WeightUpdate) -> SyncReport:
            raise SyncError("server http://127.0.0.1:9 gone")

    errors, policies = sync_on_two_ranks(Broken(), 3)
    assert set(errors) == {0, 1}, "a rank went on after a failed sync"
    assert all(policy.last_synced_step == -1 for policy in policies)
    assert "gone" in str(errors[0])
    assert (
        isinstance(errors[1], SyncError)
        and "failed on rank 0" in str(errors[1])
        and "step 3" in str(errors[1])
    )


def test_sync_error_propagates() -> None:
    class Broken(FakeSource):
        def sync_weights(self, update: WeightUpdate) -> SyncReport:
            raise SyncError("server gone")

    with pytest.raises(SyncError, match="server gone"):
        WeightSyncPolicy(SyncConfig()).maybe_sync(Tiny(), 0, Broken())


def test_sync_config_is_strict() -> None:
    assert SyncConfig().model_dump() == {
        "mode": "full",
        "fallback_to_full": True,
        "transport": "http",
        "bucket_mb": 512,
        "shm_dir": None,
        "shm_share_parameters": True,
        "collective_address": None,
        "collective_timeout_s": 120.0,
    }
    with pytest.raises(ValidationError):
        SyncConfig(transport="mpi")
    with pytest.raises(ValidationError):
        SyncConfig(collective_timeout_s=0)
    with pytest.raises(ValidationError, match="extra"):
        SyncConfig(bukcet_mb=1)
    with pytest.raises(ValidationError):
        SyncConfig(mode="lora")


def test_zero3_ranks_skip_the_gathers_when_rank0_fails_before_them(monkeypatch: pytest.MonkeyPatch) -> None:
    """ZeRO-3: the export's gathers are collectives. When rank 0 cannot even start (the server is down at its
    health read), rank 1 must not enter the gathers alone (it would wait there forever) but stop with a
    SyncError; rank 0 raises its own error."""
    import learner.weights.sync as sync_module

    monkeypatch.setattr(sync_module, "is_zero3", lambda model: True)
    entered_gathers: list[int] = []
    monkeypatch.setattr(
        WeightSyncPolicy, "_full_items", lambda self, model: iter(entered_gathers.append(1) or ())
    )

    class Down(FakeSource):
        def health(self) -> Health:
            raise SyncError("server http://127.0.0.1:9 not healthy")

    errors, _ = sync_on_two_ranks(Down(), 0)
    assert "not healthy" in str(errors[0])
    assert isinstance(errors[1], SyncError) and "failed on rank 0" in str(errors[1])
    assert entered_gathers == []


def test_every_rank_learns_that_rank0_syncs_adapters() -> None:
    """Only rank 0 resolves `auto` (here: adapter, the server has LoRA); rank 1's requests must name the
    adapter too, or they would be served by the base weights."""
    barrier = threading.Barrier(2, timeout=30)
    flags: dict[int, bool] = {}
    source = FakeSource(lora_enabled=True)

    def all_ok(ok: bool, rank: int) -> bool:
        flags[rank] = ok
        barrier.wait()
        result = all(flags.values())
        barrier.wait()
        return result

    policies = [
        WeightSyncPolicy(
            SyncConfig(mode="auto"), is_rank0=lambda r=rank: r == 0, all_ok=lambda ok, r=rank: all_ok(ok, r)
        )
        for rank in (0, 1)
    ]
    threads = [
        threading.Thread(target=policies[rank].maybe_sync, args=(peft_tiny(), 0, source)) for rank in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert [p.request_adapter for p in policies] == ["rollmatch", "rollmatch"]
    assert len(source.updates) == 1


@pytest.mark.parametrize(
    ("transport", "share", "offered"), [("shm", True, True), ("shm", False, False), ("http", True, False)]
)
def test_only_shm_with_sharing_offers_the_learners_parameters(
    transport: str, share: bool, offered: bool
) -> None:
    offers: list[tuple[torch.Tensor, ...]] = []

    class Recording(FakeSource):
        def sync_weights(self, update: WeightUpdate) -> SyncReport:
            offers.append(update.parameters)
            return super().sync_weights(update)

    model = Tiny()
    config = SyncConfig(transport=transport, shm_dir="/tmp", shm_share_parameters=share)  # type: ignore[arg-type]
    WeightSyncPolicy(config).maybe_sync(model, 0, Recording())
    assert offers == [tuple(model.parameters()) if offered else ()]
