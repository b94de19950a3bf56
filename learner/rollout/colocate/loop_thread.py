"""`LoopThread`: one long-lived asyncio event loop on its own thread, for engines bound to their first loop.

vLLM's `AsyncLLM` binds its output handler to the event loop it first runs on, so a synchronous caller (the
learner) must not `asyncio.run` each call: every coroutine goes to the same loop through `run`.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["LoopThread"]

T = TypeVar("T")


class LoopThread:
    """One daemon thread running one asyncio event loop for the engine's whole life.

    Args:
        name: thread name (shows in stack dumps).
    """

    def __init__(self, name: str = "colocate-vllm-loop") -> None:
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_forever()

    def run(self, coro: Coroutine[Any, Any, T], timeout_s: float | None = None) -> T:
        """Runs `coro` on the loop and waits for its result.

        Raises:
            TimeoutError: not done within `timeout_s` (the coroutine is cancelled).
            Whatever the coroutine raises.
        """
        if threading.current_thread() is self._thread:
            raise RuntimeError("LoopThread.run called from its own loop thread (would deadlock)")
        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        try:
            return future.result(timeout_s)
        except TimeoutError:
            future.cancel()
            raise

    def close(self) -> None:
        """Stops the loop and joins the thread; idempotent."""
        if self.loop.is_closed():
            return
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=30)
        if not self._thread.is_alive():
            self.loop.close()
