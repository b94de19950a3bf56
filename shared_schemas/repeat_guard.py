"""The degenerate-rollout guard rule (docs/ALGORITHM.md#repeat-guard), shared by every backend.

Backends call `should_terminate` before choosing token `n`; when it fires they emit the end-of-turn id,
end the sequence and report `finish_reason = "repeat_terminate"`, returning exactly `g + [end_of_turn_id]`.
"""

from __future__ import annotations

from collections.abc import Sequence

from shared_schemas.infer import RepeatTerminateConfig

__all__ = ["OBJECT_KEY_MARKER", "needs_text", "should_terminate"]

OBJECT_KEY_MARKER = '"object_'
"""Rule (c) counts occurrences of this substring in the decoded text."""


def needs_text(cfg: RepeatTerminateConfig) -> bool:
    """Whether `should_terminate` reads the decoded text (rule (c)); lets callers skip decoding."""
    return cfg.enabled and cfg.max_object_keys is not None


def should_terminate(generated: Sequence[int], decoded_text: str | None, cfg: RepeatTerminateConfig) -> bool:
    """Decides whether the guard fires before token `n = len(generated)` is chosen.

    Args:
        generated: the tokens generated so far for ONE sequence (`g_0 … g_{n-1}`).
        decoded_text: the decoded text of `generated`; only read for rule (c) (None when unused).
        cfg: the guard knobs.

    Returns:
        True iff the guard is enabled, `n >= min_new_tokens`, and (a) the last `r` tokens are one id, or
        (b) the last `s*m` tokens are `m` identical blocks of length `s`, or (c) the text holds more than
        `max_object_keys` occurrences of `"object_`.
    """
    n = len(generated)
    if not cfg.enabled or n < cfg.min_new_tokens:
        return False
    r = cfg.max_consecutive_token_repeats
    if r > 0 and n >= r and len(set(generated[n - r :])) == 1:
        return True
    s, m = cfg.ngram_size, cfg.ngram_repeats
    if s > 0 and m >= 2 and n >= s * m:
        tail = list(generated[n - s * m :])
        block = tail[:s]
        if all(tail[k * s : (k + 1) * s] == block for k in range(1, m)):
            return True
    if cfg.max_object_keys is not None:
        if decoded_text is None:
            raise ValueError("max_object_keys is set: pass the decoded text of the generated tokens")
        if decoded_text.count(OBJECT_KEY_MARKER) > cfg.max_object_keys:
            return True
    return False
