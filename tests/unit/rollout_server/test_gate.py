"""`UpdateGate`: updates wait for running generations, hold back new ones, and never starve."""

from __future__ import annotations

import asyncio

import pytest

from rollout_server.engines.gate import UpdateGate


async def _settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


def test_update_waits_for_running_generations_and_blocks_new_ones() -> None:
    async def scenario() -> list[str]:
        gate, log = UpdateGate(), []
        release_first = asyncio.Event()

        async def generation(name: str, hold: asyncio.Event | None = None) -> None:
            async with gate.generation():
                log.append(f"{name} in")
                if hold is not None:
                    await hold.wait()
                log.append(f"{name} out")

        async def update() -> None:
            async with gate.exclusive():
                log.append("update")

        first = asyncio.create_task(generation("g1", release_first))
        await _settle()
        upd = asyncio.create_task(update())
        await _settle()
        assert gate.updating and gate.generations_inside == 1
        second = asyncio.create_task(generation("g2"))
        await _settle()
        assert log == ["g1 in"]  # the update waits for g1; g2 waits for the update
        release_first.set()
        await asyncio.gather(first, upd, second)
        return log

    assert asyncio.run(scenario()) == ["g1 in", "g1 out", "update", "g2 in", "g2 out"]


def test_generations_share_the_gate() -> None:
    async def scenario() -> int:
        gate, inside, peak = UpdateGate(), 0, 0

        async def generation() -> None:
            nonlocal inside, peak
            async with gate.generation():
                inside += 1
                peak = max(peak, inside)
                await asyncio.sleep(0.01)
                inside -= 1

        await asyncio.gather(*(generation() for _ in range(5)))
        return peak

    assert asyncio.run(scenario()) == 5


def test_cancelled_update_reopens_the_gate() -> None:
    async def scenario() -> bool:
        gate = UpdateGate()
        hold = asyncio.Event()

        async def generation() -> None:
            async with gate.generation():
                await hold.wait()

        async def update() -> None:
            async with gate.exclusive():
                pass

        running = asyncio.create_task(generation())
        await _settle()
        pending = asyncio.create_task(update())
        await _settle()
        pending.cancel()
        with pytest.raises(asyncio.CancelledError):
            await pending
        entered = asyncio.Event()

        async def later() -> None:
            async with gate.generation():
                entered.set()

        late = asyncio.create_task(later())
        await asyncio.wait_for(entered.wait(), 1.0)
        hold.set()
        await asyncio.gather(running, late)
        return not gate.updating

    assert asyncio.run(scenario())
