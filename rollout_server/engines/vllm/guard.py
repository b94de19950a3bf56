"""The repeat-terminate guard (docs/ALGORITHM.md#repeat-guard) as a per-step stop check over a streamed
completion.

vLLM streams each completion's new tokens; after every chunk the engine asks `first_guard_cut` whether the
guard fires before some token `n` that was already produced. The rule itself is the shared pure function
`shared_schemas.repeat_guard.should_terminate`; firing before token `n` means the completion is exactly
`g[:n] + [end_of_turn_id]` with finish reason `repeat_terminate` — the same ids the HF backend's logits
processor yields, since the decision depends on `g[:n]` only. Checks lag one token behind the stream (token
`n` must exist so its step's end-of-turn logprob is known), costing at most one wasted decode step.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

from shared_schemas.infer import RepeatTerminateConfig
from shared_schemas.repeat_guard import needs_text, should_terminate

__all__ = ["PrefixView", "first_guard_cut"]


class PrefixView(Sequence[int]):
    """The first `n` tokens of a list without copying them (the guard only reads the tail)."""

    def __init__(self, tokens: Sequence[int], n: int) -> None:
        if not 0 <= n <= len(tokens):
            raise ValueError(f"prefix length {n} outside [0, {len(tokens)}]")
        self._tokens = tokens
        self._n = n

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, key: int) -> int: ...
    @overload
    def __getitem__(self, key: slice) -> Sequence[int]: ...
    def __getitem__(self, key: int | slice) -> int | Sequence[int]:
        if isinstance(key, slice):
            return self._tokens[slice(*key.indices(self._n))]
        index = key + self._n if key < 0 else key
        if not 0 <= index < self._n:
            raise IndexError(f"index {key} outside a prefix of length {self._n}")
        return self._tokens[index]


def first_guard_cut(
    tokens: Sequence[int],
    start: int,
    stop: int,
    cfg: RepeatTerminateConfig,
    text_of: Callable[[int], str] | None,
) -> int | None:
    """Smallest `n` in `[start, stop)` at which the guard fires before token `n`, else None.

    Args:
        tokens: the tokens generated so far (`len(tokens) >= stop`).
        start: first prefix length not checked yet.
        stop: prefix lengths below this are checked (`len(tokens)` lets the last token be replaced).
        cfg: guard knobs.
        text_of: prefix length → decoded text of `tokens[:n]`; only called when rule (c) is on.

    Returns:
        The prefix length `n` to cut at, or None.
    """
    if not cfg.enabled:
        return None
    read_text = needs_text(cfg)
    if read_text and text_of is None:
        raise ValueError("max_object_keys is set: pass text_of to decode prefixes")
    for n in range(max(start, cfg.min_new_tokens), stop):
        prefix = tokens if n == len(tokens) else PrefixView(tokens, n)
        text = text_of(n) if read_text and text_of is not None else None
        if should_terminate(prefix, text, cfg):
            return n
    return None
