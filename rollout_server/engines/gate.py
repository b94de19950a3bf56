"""`UpdateGate`: makes weight updates atomic with respect to generation batches
(docs/ARCHITECTURE.md#sync-weights).

Generations hold the gate shared; an update holds it exclusively. An update that starts waiting closes the
gate to NEW generations at once (writer preference, so a steady stream of batches cannot starve a sync),
waits for the generations already inside to finish on the old weights, applies, then reopens. So every
request of one batch runs on one weight version and no request ever sees a mix.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

__all__ = ["UpdateGate"]


class UpdateGate:
    """An asyncio readers-writer lock with writer preference (one event loop)."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self._readers = 0
        self._writer_active = False
        self._writers_waiting = 0

    @property
    def generations_inside(self) -> int:
        """Generations currently holding the gate."""
        return self._readers

    @property
    def updating(self) -> bool:
        """True while an update waits for the gate or holds it."""
        return self._writer_active or self._writers_waiting > 0

    @asynccontextmanager
    async def generation(self) -> AsyncIterator[None]:
        """Shared hold for one generation batch; waits while an update is pending or running."""
        async with self._cond:
            await self._cond.wait_for(lambda: not self._writer_active and self._writers_waiting == 0)
            self._readers += 1
        try:
            yield
        finally:
            async with self._cond:
                self._readers -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def exclusive(self) -> AsyncIterator[None]:
        """Exclusive hold for one update: new generations wait, running ones drain first."""
        async with self._cond:
            self._writers_waiting += 1
            try:
                await self._cond.wait_for(lambda: not self._writer_active and self._readers == 0)
            except BaseException:
                # A cancelled update must reopen the gate for the generations it was holding back.
                self._writers_waiting -= 1
                self._cond.notify_all()
                raise
            self._writers_waiting -= 1
            self._writer_active = True
        try:
            yield
        finally:
            async with self._cond:
                self._writer_active = False
                self._cond.notify_all()
