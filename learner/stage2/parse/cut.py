"""Char cut → token cut, the only allowed token edit (docs/ALGORITHM.md#token-cut).

``token_cut(ids, c, tokenizer)`` returns ids that decode to ``text[:c]``: ids before the token straddling the
cut are untouched; that token is replaced by the encoding of its text before the cut, which must decode back
to that text (``CutRoundTripError`` otherwise; the learner then uses the §6.4 fallback).

Refinement of the spec's rule, a no-op unless a multi-byte character is split across tokens: the cut steps
back over tokens that start while a character is still incomplete (``TokenPieces.unclean``), and re-encodes
``text[start_i:c]`` of that widened run; otherwise the kept ids could end with a dangling partial character
and ``decode(prefix) == text[:c]`` (§6.9) would fail.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from learner.stage2.parse.detok import TokenPieces, _detokenizer, token_pieces
from learner.stage2.parse.encode_cache import encode_roundtrip

__all__ = ["CutRoundTripError", "cut_with_pieces", "slice_pieces", "token_cut"]


class CutRoundTripError(ValueError):
    """Re-encoding the text of the token straddling a cut does not decode back to that text (§6.6)."""


def slice_pieces(tp: TokenPieces, i: int) -> TokenPieces:
    """Pieces of the first ``i`` tokens (valid when token ``i`` starts on a character boundary)."""
    end = tp.ends[i - 1] if i else 0
    unclean = frozenset(j for j in tp.unclean if j < i) if tp.unclean else frozenset()
    return TokenPieces(tp.pieces[:i], tp.starts[:i], tp.ends[:i], tp.text[:end], unclean)


def cut_with_pieces(
    ids: Sequence[int], c: int, tokenizer: Any, tp: TokenPieces
) -> tuple[list[int], TokenPieces]:
    """``token_cut`` that also returns the result's pieces (reused by the parser, no re-detokenization)."""
    if c >= len(tp.text):
        return list(ids), tp
    if c < 0:
        raise ValueError(f"cut position {c} must be >= 0")
    i = tp.first_token_not_before(c)
    while i > 0 and i in tp.unclean:  # token i starts inside a character begun by token i-1
        i -= 1
    start = tp.starts[i]
    if start >= c:
        return list(ids[:i]), slice_pieces(tp, i)
    sub = tp.text[start:c]
    new, got = encode_roundtrip(tokenizer, sub)  # a few chars, the same few strings sample after sample
    if got != sub:
        raise CutRoundTripError(
            f"cut at char {c}: re-encoding {sub!r} (tokens {i}.. of the rollout) decodes to {got!r}; "
            "the sample falls back to the empty prefix '{'"
        )
    out = list(ids[:i]) + new
    if _detokenizer(tokenizer).byte_fn is None:
        # Without a byte table, decode(a + b) == decode(a) + decode(b) is not guaranteed: check the
        # whole prefix.
        tp_out = token_pieces(out, tokenizer)
        if tp_out.text != tp.text[:c]:
            raise CutRoundTripError(f"cut at char {c}: the kept ids do not decode to the text before the cut")
        return out, tp_out
    # Byte-table tokenizers: ids[:i] ends on a character boundary (at ``start``), so the new ids decode
    # independently; the result is built in one copy of the kept head.
    tail = token_pieces(new, tokenizer)
    return out, TokenPieces(
        tp.pieces[:i] + tail.pieces,
        tp.starts[:i] + [s + start for s in tail.starts],
        tp.ends[:i] + [e + start for e in tail.ends],
        tp.text[:start] + tail.text,
        frozenset(j for j in tp.unclean if j < i) | frozenset(j + i for j in tail.unclean),
    )


def token_cut(ids: Sequence[int], c: int, tokenizer: Any, pieces: TokenPieces | None = None) -> list[int]:
    """Cut ``ids`` so that they decode to ``text[:c]`` (§6.6), changing only the token straddling the cut.

    Args:
        ids: token ids; ``text = decode(ids)``.
        c: char position of the cut in ``text``.
        tokenizer: the rollout tokenizer.
        pieces: ``token_pieces(ids, tokenizer)`` when already computed.

    Returns:
        ``ids`` unchanged when ``c >= len(text)``; ``ids[:i]`` when the cut falls on a token boundary; else
        ``ids[:i] + encode(text[start_i:c])``.

    Raises:
        CutRoundTripError: the re-encoded text does not decode back to itself.
    """
    tp = pieces if pieces is not None else token_pieces(ids, tokenizer)
    return cut_with_pieces(ids, c, tokenizer, tp)[0]
