"""The colocated vLLM backend's own logic, without a vLLM engine (the real engine runs in
`tests/integration/test_learner_loop.py`): TP layout and device placement, the in-process weight encoding,
the engine config, the loop thread, and — against a recording fake engine — the sleep/wake order (which CPU
vLLM cannot run), chunking by `infer_batch_size`, adapter refusal → `SyncRejected`, and the TP-group path.
"""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from safetensors.torch import load as load_safetensors

from learner.config import RunConfig
from learner.rollout.colocate import ColocateRolloutSource
from learner.rollout.colocate.tp import engine_device_env, tp_layout
from learner.rollout.colocate.vllm import (
    LoopThread,
    VllmColocateBackend,
    encode_full_update,
    server_config_for,
)
from learner.rollout.colocate.weights import resolve_weight_handoff
from learner.weights.types import SyncError, SyncRejected, WeightUpdate
from learner.yaml_loader import ConfigError
from rollout_server.engines.base import AdapterUpdate, EngineHealth, FullUpdate
from rollout_server.errors import LoraDisabledError
from shared_schemas.infer import InferBatch, InferRequest, InferResult, RequestConfig
from tests.unit.learner.infer_stubs import stub_results


# -- TP layout and devices -----------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("world", "tp", "rank", "members", "group_rank"),
    [(1, 1, 0, (0,), 0), (4, 2, 3, (2, 3), 1), (4, 4, 2, (0, 1, 2, 3), 2), (8, 2, 4, (4, 5), 0)],
)
def test_tp_layout_groups_consecutive_ranks(world, tp, rank, members, group_rank):
    layout = tp_layout(world, tp, rank)
    assert layout.members == members
    assert layout.group_rank == group_rank
    assert layout.is_leader == (group_rank == 0)
    assert layout.groups == [tuple(range(g * tp, (g + 1) * tp)) for g in range(world // tp)]


@pytest.mark.parametrize(("world", "tp"), [(1, 2), (3, 2), (6, 4)])
def test_tp_must_divide_world_size(world, tp):
    with pytest.raises(
        ConfigError, match=rf"rollout\.vllm\.tensor_parallel_size {tp} must divide .* {world}"
    ):
        tp_layout(world, tp, 0)


def test_engine_devices_map_through_visible_devices():
    assert engine_device_env([2, 3], visible="4,5,6,7") == {"CUDA_VISIBLE_DEVICES": "6,7"}
    assert engine_device_env([1], visible="") == {"CUDA_VISIBLE_DEVICES": "1"}
    assert engine_device_env([None]) == {}


# -- weight encoding -----------------------------------------------------------------------------------------
def test_encode_full_update_casts_checks_and_buckets():
    embed = torch.randn(4, 3)
    items = [
        ("embed.weight", embed),
        ("lm_head.weight", embed),
        ("norm.weight", torch.ones(3)),
        ("step", torch.tensor(7)),
    ]
    specs = {
        "embed.weight": ("BF16", (4, 3)),
        "lm_head.weight": ("BF16", (4, 3)),
        "norm.weight": ("F32", (3,)),
        "step": ("I64", ()),
    }
    buckets, nbytes = encode_full_update(items, specs, bucket_bytes=20)
    assert nbytes == 12 * 2 + 12 * 2 + 3 * 4 + 8
    decoded = {k: v for b in buckets for k, v in load_safetensors(b).items()}
    assert len(buckets) == 3  # closed once a bucket reaches 20 bytes
    assert decoded["embed.weight"].dtype == torch.bfloat16
    assert torch.equal(decoded["lm_head.weight"], embed.to(torch.bfloat16))  # tied tensors travel separately
    assert decoded["step"].dtype == torch.int64 and int(decoded["step"]) == 7


def test_encode_full_update_names_unknown_tensor_and_bad_shape():
    with pytest.raises(SyncError, match="'extra' is not a parameter"):
        encode_full_update([("extra", torch.zeros(1))], {})
    with pytest.raises(SyncError, match=r"'w' has shape \[2\], the engine serves \[3\]"):
        encode_full_update([("w", torch.zeros(2))], {"w": ("F32", (3,))})


# -- weight handoff ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("setting", "cuda", "tp", "handoff"),
    [("auto", 0, 1, "ipc"), ("auto", None, 1, "bytes"), ("auto", 0, 2, "bytes"), ("bytes", 0, 1, "bytes"),
     ("ipc", 3, 1, "ipc")],
)  # fmt: skip
def test_weight_handoff_auto_is_ipc_only_where_it_runs(setting, cuda, tp, handoff):
    assert resolve_weight_handoff(setting, cuda_device=cuda, tensor_parallel_size=tp) == handoff


@pytest.mark.parametrize(
    ("cuda", "tp", "reason"), [(None, 1, "no CUDA device"), (0, 2, "tensor_parallel_size 2")]
)
def test_weight_handoff_ipc_where_it_cannot_run_names_the_key_and_the_fix(cuda, tp, reason):
    with pytest.raises(
        ConfigError, match=rf"rollout\.vllm\.weight_handoff: ipc cannot run: .*{reason}.*bytes"
    ):
        resolve_weight_handoff("ipc", cuda_device=cuda, tensor_parallel_size=tp)


def test_weight_handoff_ipc_on_cpu_is_refused_before_any_engine_starts(monkeypatch):
    cfg = RunConfig.model_validate(
        {
            "model": {"path": ".cache/models/tiny-qwen2"},
            "data": {"train": ["x.jsonl"]},
            "rollout": {"mode": "colocate", "vllm": {"max_model_len": 64, "weight_handoff": "ipc"}},
        }
    )
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    started = []
    monkeypatch.setattr(LoopThread, "__init__", lambda self: started.append(1))
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.weight_handoff: ipc cannot run"):
        VllmColocateBackend.from_config(cfg)
    assert not started


def test_weight_handoff_rejects_unknown_values():
    with pytest.raises(ValueError, match="weight_handoff"):
        RunConfig.model_validate(
            {
                "model": {"path": "m"},
                "data": {"train": ["x.jsonl"]},
                "rollout": {"vllm": {"weight_handoff": "nccl"}},
            }
        )


# -- engine config -------------------------------------------------------------------------------------------
def test_server_config_for_maps_colocate_knobs():
    cfg = RunConfig.model_validate(
        {
            "model": {"path": ".cache/models/tiny-qwen2"},
            "data": {"train": ["x.jsonl"]},
            "training": {"seed": 5},
            "rollout": {"vllm": {"max_model_len": 777, "sleep_level": 1, "dtype": "bfloat16"}},
        }
    )
    server = server_config_for(cfg)
    assert server.model_path.name == "tiny-qwen2" and server.model_path.is_absolute()
    assert (server.dtype, server.seed, server.backend) == ("bfloat16", 5, "vllm")
    v = server.vllm
    assert (v.max_model_len, v.gpu_memory_utilization, v.enable_lora, v.enable_prefix_caching) == (
        777,
        0.45,
        False,
        True,
    )
    assert v.engine_kwargs == {"load_format": "dummy", "enable_sleep_mode": True}


def test_sleep_level_on_cpu_is_a_config_error_naming_the_key():
    from learner.rollout.colocate.vllm import _check_sleep_mode

    if torch.cuda.is_available():
        pytest.skip("vLLM has sleep mode on CUDA")
    with pytest.raises(ConfigError, match=r"rollout\.vllm\.sleep_level 1 needs vLLM sleep mode"):
        _check_sleep_mode(1)


def test_loop_thread_runs_every_call_on_one_loop():
    loop = LoopThread()
    try:

        async def which() -> tuple[int, int]:
            return id(asyncio.get_running_loop()), threading.get_ident()

        assert loop.run(which()) == loop.run(which())
        with pytest.raises(TimeoutError):
            loop.run(asyncio.sleep(5), timeout_s=0.05)
    finally:
        loop.close()


# -- the backend against a recording fake engine -------------------------------------------------------------
@dataclass
class FakeLlm:
    log: list[str]

    async def sleep(self, level: int) -> None:
        self.log.append(f"sleep{level}")

    async def wake_up(self, tags: list[str]) -> bool:
        self.log.append("wake:" + ",".join(tags))
        return True


@dataclass
class FakeEngine:
    lora: bool = False
    log: list[str] = field(default_factory=list)
    version: int = 0

    def __post_init__(self) -> None:
        self._llm = FakeLlm(self.log)

    def parameter_specs(self) -> dict[str, Any]:
        return {"w": ("F32", (2,))}

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        self.log.append(f"generate{len(batch.infer_requests)}")
        return stub_results(batch, self.version)

    async def apply_update(self, update: Any) -> None:
        if isinstance(update, AdapterUpdate) and not self.lora:
            raise LoraDisabledError("adapter sync refused: no LoRA")
        assert isinstance(update, FullUpdate | AdapterUpdate)
        self.log.append(f"apply{update.version}")
        self.version = update.version

    async def health(self) -> EngineHealth:
        return EngineHealth("ok", "vllm", "fake", self.version, 1, 1, self.lora, 64)

    async def aclose(self) -> None:
        self.log.append("close")


def make(engine: FakeEngine, **kwargs: Any) -> ColocateRolloutSource:
    return ColocateRolloutSource(
        VllmColocateBackend(engine, LoopThread(), layout=tp_layout(1, 1, 0), **kwargs)
    )


def batch_of(n: int, first_index: int = 0) -> InferBatch:
    return InferBatch(
        infer_requests=[InferRequest(prompt_token_ids=[1, 2], request_id=f"r{i}") for i in range(n)],
        request_config=RequestConfig(max_tokens=4),
        first_index=first_index,
    )


def full(version: int) -> WeightUpdate:
    return WeightUpdate(mode="full", version=version, tensors={"w": torch.ones(2, dtype=torch.float64)})


def test_sleep_order_is_weights_sync_kv_cache_generate_sleep():
    engine = FakeEngine()
    backend = VllmColocateBackend(engine, LoopThread(), layout=tp_layout(1, 1, 0), sleep_level=1)
    source = ColocateRolloutSource(backend)
    backend._sleep()  # as from_config leaves a sleeping engine
    source.sync_weights(full(1))
    source.infer(batch_of(2))
    source.infer(batch_of(1))  # a second rollout in the same step: no sync in between
    source.close()
    assert engine.log == [
        "sleep1",
        "wake:weights",
        "apply1",
        "wake:kv_cache",
        "generate2",
        "sleep1",
        "wake:weights",
        "wake:kv_cache",
        "generate1",
        "sleep1",
        "close",
    ]


def test_level2_sleep_without_sync_reloads_weights_from_the_model():
    engine = FakeEngine()
    model = torch.nn.Module()
    model.w = torch.nn.Parameter(torch.ones(2))
    backend = VllmColocateBackend(engine, LoopThread(), layout=tp_layout(1, 1, 0), sleep_level=2, model=model)
    source = ColocateRolloutSource(backend)
    backend._sleep()
    source.sync_weights(full(1))
    source.infer(batch_of(1))
    source.infer(batch_of(1))
    source.close()
    assert engine.log[-6:] == ["wake:weights", "apply1", "wake:kv_cache", "generate1", "sleep2", "close"]


def test_infer_batch_size_chunks_in_order_and_empty_batches_skip_the_engine():
    engine = FakeEngine()
    source = make(engine, infer_batch_size=2)
    results = source.infer(batch_of(5, first_index=10))
    assert [r.index for r in results] == list(range(10, 15))
    assert source.infer(InferBatch(infer_requests=[])) == []
    source.close()
    assert [e for e in engine.log if e.startswith("generate")] == ["generate2", "generate2", "generate1"]


def test_full_sync_casts_to_engine_dtype_and_reports_bytes():
    engine = FakeEngine()
    source = make(engine)
    report = source.sync_weights(full(4))
    health = source.health()
    source.close()
    assert (report.version, report.bytes, report.transport, report.endpoints) == (
        4,
        8,
        "in_process",
        ("colocate:vllm",),
    )
    assert health.weight_version == 4


def test_adapter_sync_without_lora_is_refused_as_sync_rejected():
    engine = FakeEngine(lora=False)
    source = make(engine)
    update = WeightUpdate(
        mode="adapter",
        version=1,
        tensors={"a": torch.zeros(2)},
        adapter_config={"r": 4},
        adapter_name="rollmatch",
    )
    with pytest.raises(SyncRejected, match="refused adapter sync v1"):
        source.sync_weights(update)
    source.close()
    assert source.weight_version is None


class ThreadGroup:
    """Two 'ranks' as threads: gather/broadcast through shared slots and a barrier
    (the TP collective shape)."""

    def __init__(self, size: int) -> None:
        self.slots: list[Any] = [None] * size
        self.box: list[Any] = [None]
        self.barrier = threading.Barrier(size)

    def member(self, rank: int) -> Any:
        group = self

        class Member:
            def gather(self, obj: Any) -> list[Any]:
                group.slots[rank] = obj
                group.barrier.wait()
                out = list(group.slots)
                group.barrier.wait()
                return out

            def broadcast(self, obj: Any) -> Any:
                if rank == 0:
                    group.box[0] = obj
                group.barrier.wait()
                out = group.box[0]
                group.barrier.wait()
                return out

        return Member()


def test_tp_group_leader_generates_everything_and_each_rank_keeps_its_slice():
    engine = FakeEngine()
    group = ThreadGroup(2)
    leader = VllmColocateBackend(engine, LoopThread(), layout=tp_layout(2, 2, 0), group=group.member(0))
    member = VllmColocateBackend(None, None, layout=tp_layout(2, 2, 1), group=group.member(1))
    assert leader.sends_weights and not member.sends_weights
    out: dict[int, list[InferResult]] = {}
    thread = threading.Thread(target=lambda: out.__setitem__(1, member.generate(batch_of(3, first_index=3))))
    thread.start()
    out[0] = leader.generate(batch_of(3, first_index=0))
    thread.join(10)
    leader.close()
    member.close()
    assert [r.index for r in out[0]] == [0, 1, 2] and [r.index for r in out[1]] == [3, 4, 5]
    assert [e for e in engine.log if e.startswith("generate")] == ["generate3", "generate3"]
    assert member.apply(full(2)) == 0 and member.status().weight_version == 2
