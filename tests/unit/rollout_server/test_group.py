"""`EngineGroup` orchestration with scripted members: the shared chunk plan, ordered reassembly checked by
request id, all-or-nothing updates that never split a batch across versions, device placement."""

from __future__ import annotations

import asyncio
from collections.abc import Mapping

import pytest

from rollout_server.engines.base import EngineHealth, FullUpdate, ParamSpec, StagedUpdate
from rollout_server.engines.group import EngineGroup, member_device_envs
from rollout_server.errors import EngineError
from shared_schemas.infer import Choice, InferBatch, InferResult


class Member:
    """A scripted staged engine: answers request i with token [first_index + i]."""

    def __init__(self, name: str, *, fail_prepare: bool = False, shuffle: bool = False) -> None:
        self.name = name
        self.version = 0
        self.calls: list[tuple[str, object]] = []
        self.fail_prepare = fail_prepare
        self.shuffle = shuffle
        self.staged: StagedUpdate | None = None
        self.hold: asyncio.Event | None = None

    lora_enabled = False

    @property
    def weight_version(self) -> int:
        return self.version

    def parameter_specs(self) -> Mapping[str, ParamSpec]:
        return {"w": ("F32", (2,))}

    async def generate(self, batch: InferBatch) -> list[InferResult]:
        self.calls.append(("generate", (batch.first_index, len(batch.infer_requests))))
        if self.hold is not None:
            await self.hold.wait()
        results = [
            InferResult(
                index=batch.first_index + i,
                request_id=r.request_id,
                prompt_token_ids=[1],
                choices=[Choice(token_ids=[batch.first_index + i], text="", finish_reason="length")],
                weight_version=self.version,
            )
            for i, r in enumerate(batch.infer_requests)
        ]
        return results[::-1] if self.shuffle else results

    async def prepare_update(self, update: StagedUpdate) -> None:
        self.calls.append(("prepare", update.version))
        if self.fail_prepare:
            raise EngineError(f"{self.name} cannot stage")
        self.staged = update

    async def commit_update(self) -> None:
        assert self.staged is not None
        self.calls.append(("commit", self.staged.version))
        self.version, self.staged = self.staged.version, None

    async def abort_update(self) -> None:
        self.calls.append(("abort", None))
        self.staged = None

    async def apply_update(self, update: StagedUpdate) -> None:
        await self.prepare_update(update)
        await self.commit_update()

    async def health(self) -> EngineHealth:
        return EngineHealth("ok", "vllm", "m", self.version, 1, 1, False, 64)

    async def aclose(self) -> None:
        self.calls.append(("close", None))


def _batch(n: int, first: int = 10) -> InferBatch:
    return InferBatch.model_validate(
        {
            "infer_requests": [{"prompt_token_ids": [1], "request_id": f"r{i}"} for i in range(n)],
            "first_index": first,
        }
    )


def test_chunks_follow_the_shared_plan_and_results_come_back_in_order() -> None:
    members = [Member("a"), Member("b"), Member("c")]
    group = EngineGroup(members)
    results = asyncio.run(group.generate(_batch(5)))
    assert [r.index for r in results] == [10, 11, 12, 13, 14]
    assert [r.request_id for r in results] == [f"r{i}" for i in range(5)]
    assert [m.calls for m in members] == [
        [("generate", (10, 2))],
        [("generate", (12, 2))],
        [("generate", (14, 1))],
    ]


def test_fewer_requests_than_members_skip_the_empty_parts() -> None:
    members = [Member("a"), Member("b"), Member("c")]
    asyncio.run(EngineGroup(members).generate(_batch(1)))
    assert [len(m.calls) for m in members] == [1, 0, 0]


def test_a_member_breaking_order_is_an_engine_error() -> None:
    group = EngineGroup([Member("a", shuffle=True), Member("b")])
    with pytest.raises(EngineError, match="expected"):
        asyncio.run(group.generate(_batch(4)))


def test_update_is_all_or_nothing_when_a_member_cannot_stage() -> None:
    a, b = Member("a"), Member("b", fail_prepare=True)
    group = EngineGroup([a, b])
    with pytest.raises(EngineError, match="cannot stage"):
        asyncio.run(group.apply_update(FullUpdate(version=1, buckets=(b"",))))
    assert (
        a.calls == [("prepare", 1), ("abort", None)] and a.version == b.version == group.weight_version == 0
    )


def test_update_waits_for_a_running_batch_so_no_batch_spans_two_versions() -> None:
    async def scenario() -> list[int]:
        a, b = Member("a"), Member("b")
        group = EngineGroup([a, b])
        b.hold = asyncio.Event()
        running = asyncio.create_task(group.generate(_batch(4)))
        await asyncio.sleep(0.01)
        update = asyncio.create_task(group.apply_update(FullUpdate(version=7, buckets=(b"",))))
        await asyncio.sleep(0.01)
        assert a.version == 0 and ("commit", 7) not in a.calls  # staged, not committed
        b.hold.set()
        results = await running
        await update
        assert group.weight_version == 7 == a.version == b.version
        b.hold = None
        after = await group.generate(_batch(4))
        return [r.weight_version for r in results] + [r.weight_version for r in after]

    assert asyncio.run(scenario()) == [0, 0, 0, 0, 7, 7, 7, 7]


def test_health_reports_dp_and_close_closes_every_member() -> None:
    members = [Member("a"), Member("b")]
    group = EngineGroup(members)
    health = asyncio.run(group.health())
    assert (health.status, health.dp) == ("ok", 2)
    asyncio.run(group.aclose())
    asyncio.run(group.aclose())
    assert all(m.calls.count(("close", None)) == 1 for m in members)
    with pytest.raises(EngineError):
        asyncio.run(group.generate(_batch(1)))


def test_member_device_envs() -> None:
    assert member_device_envs(2, 1, None) == [{}, {}]
    assert member_device_envs(2, 2, ["3", "4", "5", "6"]) == [
        {"CUDA_VISIBLE_DEVICES": "3,4"},
        {"CUDA_VISIBLE_DEVICES": "5,6"},
    ]
    with pytest.raises(ValueError, match="data_parallel_size 3"):
        member_device_envs(3, 1, ["0", "1"])
