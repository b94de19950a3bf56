"""Streaming detokenization: each token's text contribution ("piece", docs/ALGORITHM.md#pieces).

``piece_i`` is what token ``i`` adds to the decoded text, special tokens kept, no cleanup, such that
``''.join(pieces) == decode(ids)``. A token that ends inside a multi-byte UTF-8 character contributes ``""``;
the text it holds back comes out with the token that completes the character (as vLLM's incremental
detokenizer does). Only at the very end of a sequence is an incomplete character flushed (as U+FFFD, like
``decode``).

Speed: the pieces come from a per-token byte table (built lazily, cached per tokenizer) and an incremental
UTF-8 decoder, never from one ``decode`` call per token. Byte tables exist for byte-level BPE tokenizers
(every Qwen tokenizer) and for any tokenizer that exposes ``token_bytes(id) -> bytes``; other tokenizers fall
back to decoding growing prefixes (correct, quadratic, warned once).
"""

from __future__ import annotations

import bisect
import codecs
import itertools
import logging
import operator
import threading
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["TokenPieces", "StreamingDetokenizer", "decode_text", "encode_text", "token_pieces"]

logger = logging.getLogger(__name__)

_REPLACEMENT = "\ufffd"
_PROBE_IDS = 4096


def decode_text(tokenizer: Any, ids: Sequence[int]) -> str:
    """``decode`` as the parser defines it: special tokens kept, no clean-up of spaces."""
    return tokenizer.decode(list(ids), skip_special_tokens=False, clean_up_tokenization_spaces=False)


def encode_text(tokenizer: Any, text: str) -> list[int]:
    """``encode`` as the parser defines it: no special tokens added."""
    return list(tokenizer.encode(text, add_special_tokens=False))


@dataclass(frozen=True)
class TokenPieces:
    """Pieces of one token sequence and their character spans in ``text``.

    Attributes:
        pieces: ``pieces[i]`` is token ``i``'s contribution; ``''.join(pieces) == text``.
        starts: ``starts[i] = len(pieces[0] + … + pieces[i-1])``.
        ends: ``ends[i] = starts[i] + len(pieces[i])``.
        text: the decoded text.
        unclean: indices of tokens that start while an earlier token's bytes are still pending (the previous
            token ended inside a multi-byte character). Cutting the ids right before such a token would leave
            a dangling partial character, so ``token_cut`` steps back over them. Empty for most sequences.
    """

    pieces: list[str]
    starts: list[int]
    ends: list[int]
    text: str
    unclean: frozenset[int] = frozenset()

    def __len__(self) -> int:
        return len(self.pieces)

    def span(self, i: int) -> tuple[int, int]:
        """Char span of token ``i`` for overlap tests (§6.1): an empty piece spans ``[start, start + 1)``."""
        s, e = self.starts[i], self.ends[i]
        return (s, e) if e > s else (s, s + 1)

    def first_token_not_before(self, c: int) -> int:
        """``min{ j : end_j > c or start_j >= c }`` (§6.6); ``len(self)`` when there is none."""
        return min(bisect.bisect_right(self.ends, c), bisect.bisect_left(self.starts, c))


def _make_pieces(pieces: list[str], unclean: frozenset[int] = frozenset()) -> TokenPieces:
    ends = list(itertools.accumulate(map(len, pieces)))
    starts = [0, *ends[:-1]] if ends else []
    return TokenPieces(pieces=pieces, starts=starts, ends=ends, text="".join(pieces), unclean=unclean)


# ------------------------------------------------------------------------------------------------------------
# Byte sources


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2 byte-level alphabet: byte → printable unicode char (the table every byte-level BPE uses)."""
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _hf_byte_level_source(tokenizer: Any) -> Callable[[int], bytes] | None:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    if decoder is None or type(decoder).__name__ != "ByteLevel":
        return None
    convert = tokenizer.convert_ids_to_tokens

    def token_bytes(token_id: int) -> bytes:
        s = convert(token_id)
        if s is None:  # id beyond the tokenizer (padded embedding rows): decode skips it
            return b""
        # Same rule as the tokenizers ByteLevel decoder: map every char through the byte alphabet, or take the
        # token's UTF-8 when some char is outside it (added tokens with arbitrary text).
        try:
            return bytes([_UNICODE_TO_BYTE[ch] for ch in s])
        except KeyError:
            return s.encode("utf-8")

    return token_bytes


def _byte_source(tokenizer: Any) -> Callable[[int], bytes] | None:
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        return own
    return _hf_byte_level_source(tokenizer)


class _Detokenizer:
    """Per-tokenizer piece machinery with lazily filled caches (thread-safe: dict writes are atomic)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_fn = _byte_source(tokenizer)
        self._bytes: dict[int, bytes] = {}
        self._text: dict[int, str] = {}  # tokens whose bytes are valid UTF-8 on their own
        self._spells: dict[int, tuple[tuple[int, ...], bool]] = {}
        if self.byte_fn is not None and not self._self_check():
            logger.warning(
                "tokenizer %s: byte table disagrees with decode(); using the slow prefix-decoding "
                "detokenizer",
                type(tokenizer).__name__,
            )
            self.byte_fn = None
        if self.byte_fn is None:
            logger.warning(
                "tokenizer %s has no byte-level table; token pieces use prefix decoding (quadratic in "
                "length)",
                type(tokenizer).__name__,
            )

    def _self_check(self) -> bool:
        try:
            n = len(self.tokenizer)
        except TypeError:
            n = _PROBE_IDS
        probe = list(range(min(n, _PROBE_IDS)))
        added = getattr(self.tokenizer, "added_tokens_decoder", None)
        if isinstance(added, dict):
            probe += [int(t) for t in list(added)[:64]]
        if not probe:
            return True
        return "".join(self._byte_pieces(probe)[0]) == decode_text(self.tokenizer, probe)

    def token_bytes(self, token_id: int) -> bytes:
        b = self._bytes.get(token_id)
        if b is None:
            assert self.byte_fn is not None
            b = bytes(self.byte_fn(token_id))
            self._bytes[token_id] = b
            try:
                self._text[token_id] = b.decode("utf-8")
            except UnicodeDecodeError:
                pass
        return b

    def spells(self, ids: tuple[int, ...], strings: Callable[[int], str]) -> bool:
        """True when there is a byte table and every ``ids[k]`` decodes, on its own, to ``strings(k)``.

        With a byte table such a token's piece is that string wherever no multi-byte character is pending
        before it. Memoized per ``ids`` tuple (the cache holds the tuple, so its ``id`` is not
        reused meanwhile).
        """
        hit = self._spells.get(id(ids))
        if hit is not None and hit[0] is ids:
            return hit[1]
        ok = self.byte_fn is not None and all(
            self.token_bytes(t) == strings(k).encode("utf-8") for k, t in enumerate(ids)
        )
        self._spells[id(ids)] = (ids, ok)
        return ok

    def pieces(self, ids: Sequence[int]) -> tuple[list[str], frozenset[int]]:
        if self.byte_fn is None:
            return self._prefix_pieces(ids)
        text = self._text
        try:
            if len(ids) > 1:  # one C-level lookup pass (itemgetter of one key returns the bare value)
                return list(operator.itemgetter(*ids)(text)), frozenset()
            return [text[t] for t in ids], frozenset()
        except KeyError:
            return self._byte_pieces(ids)

    def _byte_pieces(self, ids: Sequence[int]) -> tuple[list[str], frozenset[int]]:
        dec = codecs.getincrementaldecoder("utf-8")("replace")
        pieces: list[str] = []
        unclean: set[int] = set()
        carry = ""
        pending = False
        for i, t in enumerate(ids):
            if pending:
                unclean.add(i)
            out = dec.decode(self.token_bytes(t))
            pending = bool(dec.getstate()[0])
            if pending:
                carry += out
                pieces.append("")
            else:
                pieces.append(carry + out)
                carry = ""
        if pieces:
            pieces[-1] += carry + dec.decode(b"", final=True)
        return pieces, frozenset(unclean)

    def _prefix_pieces(self, ids: Sequence[int]) -> tuple[list[str], frozenset[int]]:
        pieces: list[str] = []
        unclean: set[int] = set()
        committed = ""
        held = False
        ids = list(ids)
        for i in range(len(ids)):
            if held:
                unclean.add(i)
            t = decode_text(self.tokenizer, ids[: i + 1])
            held = t.endswith(_REPLACEMENT) and i < len(ids) - 1
            if held:
                pieces.append("")
                continue
            if not t.startswith(committed):
                raise ValueError(
                    f"tokenizer {type(self.tokenizer).__name__}: decoding is not prefix-stable at token {i} "
                    f"(id {ids[i]}); token pieces cannot be defined for it"
                )
            pieces.append(t[len(committed) :])
            committed = t
        return pieces, frozenset(unclean)


T = TypeVar("T")


class PerTokenizer(Generic[T]):
    """One `factory(tokenizer)` object per live tokenizer, built once (thread-safe).

    Keyed by `id(tokenizer)` and checked against a weak reference, so a new tokenizer that reuses a freed
    id gets a fresh object; tokenizers that refuse weak references are held strongly.
    """

    def __init__(self, factory: Callable[[Any], T]) -> None:
        self._factory = factory
        self._items: dict[int, tuple[Callable[[], Any], T]] = {}
        self._lock = threading.Lock()

    def get(self, tokenizer: Any) -> T:
        """The object built for `tokenizer` (built now on first use)."""
        hit = self._items.get(id(tokenizer))
        if hit is not None and hit[0]() is tokenizer:
            return hit[1]
        with self._lock:
            hit = self._items.get(id(tokenizer))
            if hit is not None and hit[0]() is tokenizer:
                return hit[1]
            item = self._factory(tokenizer)
            try:
                ref: Callable[[], Any] = weakref.ref(tokenizer)
            except TypeError:

                def ref(_tok: Any = tokenizer) -> Any:
                    return _tok

            self._items[id(tokenizer)] = (ref, item)
            return item


_DETOKENIZERS: PerTokenizer[_Detokenizer] = PerTokenizer(_Detokenizer)


def _detokenizer(tokenizer: Any) -> _Detokenizer:
    return _DETOKENIZERS.get(tokenizer)


def token_pieces(ids: Sequence[int], tokenizer: Any) -> TokenPieces:
    """Pieces and char spans of ``ids`` under ``tokenizer`` (§6.1); ``result.text == decode(ids)``.

    Args:
        ids: token ids.
        tokenizer: a transformers tokenizer (or anything with ``decode``/``encode`` and optionally
            ``token_bytes``).
    """
    pieces, unclean = _detokenizer(tokenizer).pieces(ids)
    return _make_pieces(pieces, unclean)


class StreamingDetokenizer:
    """Incremental version of ``token_pieces`` for one sequence: ``push(id)`` returns that token's piece.

    The pieces returned so far never include a trailing incomplete character (it is held back), so counting an
    ASCII pattern over them gives the same result as counting it in ``decode(ids)``.
    """

    def __init__(self, tokenizer: Any) -> None:
        self._d = _detokenizer(tokenizer)
        self._dec = codecs.getincrementaldecoder("utf-8")("replace")
        self._carry = ""
        self._ids: list[int] = []
        self._parts: list[str] = []
        self._prefix_text = ""  # only used by the prefix-decoding fallback

    @property
    def text(self) -> str:
        """Concatenation of the pieces returned so far."""
        return "".join(self._parts)

    def push(self, token_id: int) -> str:
        """Append one token; return its piece (``""`` while a multi-byte character is incomplete)."""
        self._ids.append(token_id)
        if self._d.byte_fn is None:
            t = decode_text(self._d.tokenizer, self._ids)
            if t.endswith(_REPLACEMENT) or not t.startswith(self._prefix_text):
                return ""
            piece, self._prefix_text = t[len(self._prefix_text) :], t
        else:
            out = self._dec.decode(self._d.token_bytes(token_id))
            if self._dec.getstate()[0]:
                self._carry += out
                return ""
            piece, self._carry = self._carry + out, ""
        self._parts.append(piece)
        return piece
