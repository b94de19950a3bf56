"""Degenerate-rollout guard (spec/STAGE2.md §5.4), shared by every rollout backend.

``should_terminate(g, decoded_text, cfg)`` decides, before generated token ``n = len(g)`` is chosen, whether the
sequence must end here with the end-of-turn token (``finish_reason = repeat_terminate``). Backends either force
the end-of-turn id through a logits processor (HF: ``guard_hf.RepeatTerminateLogitsProcessor``) or run a
per-step stop check and append the end-of-turn id (``stop_check_stream`` is that semantics on a given stream);
both return exactly ``g + [end_of_turn_id]``.

Pure: no torch, no transformers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

from pydantic import ConfigDict

from shared_schemas.infer import RepeatTerminateConfig as WireRepeatTerminateConfig
from shared_schemas.repeat_guard import should_terminate as shared_should_terminate

__all__ = [
    "OBJECT_KEY_MARK",
    "RepeatTerminateConfig",
    "count_object_keys",
    "should_terminate",
    "should_terminate_counted",
    "stop_check_stream",
]

OBJECT_KEY_MARK = '"object_'


class RepeatTerminateConfig(WireRepeatTerminateConfig):
    """``rollout.decoding.repeat_terminate``: the wire contract's fields and bounds (ONE definition, so a value
    the server would refuse fails when the config loads, not at the first rollout), strict about unknown keys
    as every config section is."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


def count_object_keys(text: str) -> int:
    """Occurrences of ``"object_`` in ``text`` (rule (c))."""
    return text.count(OBJECT_KEY_MARK)


@functools.lru_cache(maxsize=64)
def _token_rule_cfg(cfg: RepeatTerminateConfig) -> WireRepeatTerminateConfig:
    # Rules (a) and (b) only; (c) is counted by the caller.
    return WireRepeatTerminateConfig(
        **{**cfg.model_dump(), "enabled": True, "min_new_tokens": 0, "max_object_keys": None}
    )


def _token_rules(g: Sequence[int], cfg: RepeatTerminateConfig) -> bool:
    """Rules (a) and (b), evaluated by the one implementation every backend shares (shared_schemas)."""
    return shared_should_terminate(g, None, _token_rule_cfg(cfg))


def should_terminate_counted(g: Sequence[int], n_object_keys: int, cfg: RepeatTerminateConfig) -> bool:
    """``should_terminate`` with rule (c) given as a count (for backends that count incrementally)."""
    if not cfg.enabled or len(g) < cfg.min_new_tokens:
        return False
    if cfg.max_object_keys is not None and n_object_keys > cfg.max_object_keys:
        return True
    return _token_rules(g, cfg)


def should_terminate(g: Sequence[int], decoded_text: str, cfg: RepeatTerminateConfig) -> bool:
    """True when, before choosing generated token ``n = len(g)``, the sequence must end (§5.4).

    Fires iff ``cfg.enabled``, ``n >= min_new_tokens`` and any of: (a) the last ``r`` tokens are one id;
    (b) the last ``s*m`` tokens are ``m`` identical blocks of length ``s``; (c) ``decoded_text`` (the decode of
    ``g``) holds more than ``max_object_keys`` occurrences of ``"object_``.
    """
    if not cfg.enabled or len(g) < cfg.min_new_tokens:
        return False
    return should_terminate_counted(
        g, count_object_keys(decoded_text) if cfg.max_object_keys is not None else 0, cfg
    )


def stop_check_stream(
    stream: Iterable[int],
    cfg: RepeatTerminateConfig,
    end_of_turn_id: int,
    decode: Callable[[Sequence[int]], str],
    max_new_tokens: int | None = None,
) -> tuple[list[int], str]:
    """Per-step stop-check semantics on a fixed token stream (what a vLLM backend implements).

    Feeds ``stream`` token by token; before each token checks ``should_terminate`` and, when it fires, returns
    ``g + [end_of_turn_id]``. The stream also ends at its own end-of-turn id or at ``max_new_tokens``.

    Returns:
        ``(token_ids, finish_reason)`` with ``finish_reason`` in ``stop`` / ``length`` / ``repeat_terminate``.
    """
    g: list[int] = []
    for t in stream:
        if max_new_tokens is not None and len(g) >= max_new_tokens:
            return g, "length"
        if should_terminate(g, decode(g) if cfg.max_object_keys is not None else "", cfg):
            return g + [end_of_turn_id], "repeat_terminate"
        g.append(t)
        if t == end_of_turn_id:
            return g, "stop"
    return g, "length"
