"""The one chunk plan used at both levels: servers on the client, DP engines inside a server
(docs/ARCHITECTURE.md#determinism).

`N` requests over `S` parts: `chunk = ceil(N / S)`, part `i` gets `[i*chunk, min((i+1)*chunk, N))`; parts
beyond `N` get empty ranges (callers skip them), and `N == 0` gives all-empty ranges, so no call is made
(docs/ALGORITHM.md#chunking-and-retries).
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

__all__ = ["Chunk", "plan_chunks"]


class Chunk(BaseModel):
    """A contiguous request range `[start, stop)` assigned to part `part`."""

    model_config = ConfigDict(frozen=True)

    part: int = Field(ge=0)
    start: int = Field(ge=0)
    stop: int = Field(ge=0)

    @property
    def size(self) -> int:
        """Number of requests in the range."""
        return self.stop - self.start

    @property
    def empty(self) -> bool:
        """True when the part receives nothing (and must not be called)."""
        return self.stop == self.start

    def as_range(self) -> range:
        """The indices of the chunk."""
        return range(self.start, self.stop)


def plan_chunks(n: int, parts: int) -> list[Chunk]:
    """Splits `n` requests over `parts` parts in contiguous ranges of `ceil(n / parts)`.

    Args:
        n: number of requests (>= 0).
        parts: number of servers or engines (>= 1).

    Returns:
        Exactly `parts` chunks in part order; concatenated they cover `range(n)` once, in order.

    Raises:
        ValueError: `n < 0` or `parts < 1`.

    Examples:
        `plan_chunks(5, 3)` → ranges (0,2), (2,4), (4,5); `plan_chunks(0, 3)` → three empty ranges.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if parts < 1:
        raise ValueError(f"parts must be >= 1, got {parts}")
    size = -(-n // parts)
    return [Chunk(part=i, start=min(i * size, n), stop=min((i + 1) * size, n)) for i in range(parts)]
