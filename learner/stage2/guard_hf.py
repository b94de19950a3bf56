"""HF ``generate`` implementation of the degenerate-rollout guard (spec/STAGE2.md §5.4).

A per-sequence logits processor: when ``should_terminate`` fires for a row, every logit of that row becomes −inf
except the end-of-turn id, so the row ends with exactly ``g + [end_of_turn_id]``. Rule (c) counts ``"object_``
incrementally over streamed pieces (no quadratic re-decoding).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import LogitsProcessor

from learner.stage2.detok import StreamingDetokenizer, decode_text
from learner.stage2.guard import (
    OBJECT_KEY_MARK,
    RepeatTerminateConfig,
    count_object_keys,
    should_terminate_counted,
)

__all__ = ["RepeatTerminateLogitsProcessor"]

_TAIL = len(OBJECT_KEY_MARK) - 1


class _Row:
    __slots__ = ("count", "detok", "g", "tail")

    def __init__(self, tokenizer: Any | None) -> None:
        self.g: list[int] = []
        self.detok = StreamingDetokenizer(tokenizer) if tokenizer is not None else None
        self.count = 0
        self.tail = ""

    def push(self, token_id: int) -> None:
        self.g.append(token_id)
        if self.detok is not None:
            piece = self.detok.push(token_id)
            if piece:
                # Occurrences that end inside the new piece; the 7-char tail cannot hold a whole one by itself.
                window = self.tail + piece
                self.count += window.count(OBJECT_KEY_MARK)
                self.tail = window[-_TAIL:]


class RepeatTerminateLogitsProcessor(LogitsProcessor):
    """Force the end-of-turn token in rows where ``should_terminate`` fires.

    Args:
        cfg: ``rollout.decoding.repeat_terminate``.
        end_of_turn_id: id of the end-of-turn token (``<|im_end|>``).
        prompt_len: length of the (padded) prompt in ``input_ids``; later columns are generated tokens.
        tokenizer: needed when ``cfg.max_object_keys`` is set.
        num_beams: > 1 when beams may be reordered between steps; then rows are rebuilt from ``input_ids`` at
            every step instead of being tracked incrementally.
    """

    def __init__(
        self,
        cfg: RepeatTerminateConfig,
        end_of_turn_id: int,
        prompt_len: int,
        tokenizer: Any | None = None,
        num_beams: int = 1,
    ) -> None:
        if cfg.max_object_keys is not None and tokenizer is None:
            raise ValueError(
                "repeat_terminate.max_object_keys is set: RepeatTerminateLogitsProcessor needs the tokenizer"
            )
        self.cfg = cfg
        self.end_of_turn_id = end_of_turn_id
        self.prompt_len = prompt_len
        self.tokenizer = tokenizer if cfg.max_object_keys is not None else None
        self.num_beams = num_beams
        self._rows: list[_Row] = []
        self._seen = prompt_len
        self.fired_rows: set[int] = set()

    def _advance(self, input_ids: torch.LongTensor) -> None:
        batch, length = input_ids.shape
        if self.num_beams > 1:
            self._rows = []
            self._seen = self.prompt_len
        if not self._rows:
            self._rows = [_Row(self.tokenizer) for _ in range(batch)]
        if length > self._seen:
            new = input_ids[:, self._seen :].tolist()
            for row, toks in zip(self._rows, new, strict=True):
                for t in toks:
                    row.push(t)
            self._seen = length

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if not self.cfg.enabled:
            return scores
        self._advance(input_ids)
        fire = [b for b, row in enumerate(self._rows) if should_terminate_counted(row.g, row.count, self.cfg)]
        if not fire:
            return scores
        self.fired_rows.update(fire)
        scores = scores.clone()
        idx = torch.tensor(fire, device=scores.device)
        scores[idx] = float("-inf")
        scores[idx, self.end_of_turn_id] = 0.0
        return scores

    def object_key_count(self, row: int) -> int:
        """Rule (c) count of a row (for tests and diagnostics)."""
        r = self._rows[row]
        return r.count if r.detok is not None else count_object_keys(decode_text(self.tokenizer, r.g))
