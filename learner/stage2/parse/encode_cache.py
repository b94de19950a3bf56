"""Memoized encoding of the short, repetitive texts the learner encodes per sample
(docs/ALGORITHM.md#token-cut, §10).

All of them return exactly ``detok.encode_text(tokenizer, text)`` (and ``decode_text`` of it):

- :func:`encode_cached` / :func:`encode_roundtrip`: the text of the token straddling a cut (§6.6) is a few
  characters, and the same few strings (``"]}``, ``}``, ...) come back sample after sample: short texts are
  memoized per tokenizer (with their decoded round trip).
- :func:`encode_segmented`: the appended fragment of §10 is JSON around coordinate tokens. A fast (HF
  ``tokenizers``) tokenizer first splits the text at its added tokens; every piece between them is then
  normalized, pre-tokenized and BPE-encoded on its own, and an added token is its one id. So when every
  coordinate token is such an added token (no strip / single-word / normalized flags) and no other added token
  can match across one's edge, ``encode(text)`` is the concatenation of the encodings of the pieces between
  coordinate tokens and the coordinate ids, and those pieces (``", "``, ``"], ["``, ``"]}}`` ...) repeat.
  The conditions are checked once per tokenizer (plus a probe text encoded both ways); any other tokenizer,
  and any text holding a coordinate-like string that is not an added token, is encoded whole.

A transformers fast tokenizer is called through its ``tokenizers`` backend directly where that is exactly what
its ``encode`` does (see :func:`_backend_encode`): the wrapper costs more than encoding these short texts.

The caches are bounded. Like the detokenizer tables (``detok.py``), they assume the tokenizer object is not
changed after its first use (no tokens added later); a new tokenizer object gets new caches.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from learner.stage2.parse.detok import PerTokenizer, decode_text, encode_text

__all__ = ["encode_cached", "encode_roundtrip", "encode_segmented"]

_COORD_STRING = re.compile(r"<\|coord_\d+\|>", re.ASCII)
_SPLIT = re.compile(r"(<\|coord_\d+\|>)", re.ASCII)
_MAX_ENTRIES = 1 << 15
_MAX_CACHED_CHARS = 256
_PROBE = (
    '{"object_1": {"desc": "cat <x>", "bbox_2d": ["<|coord_0|>", "<|coord_12|>", "<|coord_999|>", '
    '"<|coord_5|>"]}, "object_2": {"desc": "猫", "poly": [["<|coord_1|>", "<|coord_2|>"], ["<|coord_3|>"'
    ', "<|coord_4|>"]]}}<|coord_7|><|coord_8|>x <|coord_9|> "<|coord_10|>'
)


def _crosses_coord_edge(content: str) -> bool:
    """True when an added token with this text could match across the start of a coordinate token.

    That needs a proper suffix of ``content`` to be a prefix of some ``<|coord_k|>`` (or ``content`` to hold
    one). A match starting inside a coordinate token is harmless: the coordinate token starts earlier
    and wins.
    """
    if "<|coord_" in content:
        return True
    for i in range(1, len(content)):
        tail = content[i:]
        if "<|coord_".startswith(tail) or re.fullmatch(r"<\|coord_\d+\|?", tail, re.ASCII):
            return True
    return False


def _coord_added_ids(tokenizer: Any) -> dict[str, int] | None:
    """``{"<|coord_k|>": id}`` when encoding may be split at coord tokens (module docstring), else None."""
    if getattr(tokenizer, "backend_tokenizer", None) is None or getattr(
        tokenizer, "split_special_tokens", False
    ):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if not isinstance(added, dict):
        return None
    coords: dict[str, int] = {}
    for token_id, tok in added.items():
        content = getattr(tok, "content", None)
        if not isinstance(content, str):
            return None
        if _COORD_STRING.fullmatch(content):
            if tok.lstrip or tok.rstrip or tok.single_word or tok.normalized:
                return None
            coords[content] = int(token_id)
        elif _crosses_coord_edge(content):
            return None
    return coords or None


def _backend_encode(tokenizer: Any) -> Callable[[str], list[int]] | None:
    """The ``tokenizers`` backend's encode where it equals ``encode_text`` (HF fast tokenizers), else None.

    ``tokenizer.encode(text, add_special_tokens=False)`` of a transformers fast tokenizer is the backend's
    ``encode_batch([text])`` after switching off truncation and padding and setting ``encode_special_tokens``
    to ``split_special_tokens``; calling the backend directly skips ~10 µs of wrapper per call. Only for the
    stock wrapper methods, and only while the backend has no truncation, padding or special-token splitting
    set (else the call goes through the wrapper, which resets them).
    """
    cls = type(tokenizer)
    stock = (
        getattr(cls.encode, "__qualname__", "") == "PreTrainedTokenizerBase.encode"
        and getattr(getattr(cls, "_encode_plus", None), "__qualname__", "")
        == "TokenizersBackend._encode_plus"
    )
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not stock or backend is None or getattr(tokenizer, "split_special_tokens", True):
        return None

    def encode(text: str) -> list[int]:
        if backend.truncation is None and backend.padding is None and not backend.encode_special_tokens:
            return backend.encode(text, add_special_tokens=False).ids
        return encode_text(tokenizer, text)

    return encode


class _Encoder:
    """Per-tokenizer caches (thread-safe enough: dict reads/writes are atomic, a lost write is recomputed)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.cache: dict[str, tuple[int, ...]] = {}
        self.decoded: dict[str, tuple[tuple[int, ...], str]] = {}
        backend = _backend_encode(tokenizer)
        if backend is not None and backend(_PROBE) != encode_text(tokenizer, _PROBE):
            backend = None
        self.encode: Callable[[str], list[int]] = backend or (lambda text: encode_text(tokenizer, text))
        self.coord_ids = _coord_added_ids(tokenizer)
        if self.coord_ids is not None and self.segmented(_PROBE) != encode_text(tokenizer, _PROBE):
            self.coord_ids = None

    def roundtrip(self, text: str) -> tuple[list[int], str]:
        hit = self.decoded.get(text)
        if hit is None:
            ids = self.cached(text)
            hit = (tuple(ids), decode_text(self.tokenizer, ids))
            if len(text) <= _MAX_CACHED_CHARS:
                if len(self.decoded) >= _MAX_ENTRIES:
                    self.decoded.clear()
                self.decoded[text] = hit
        return list(hit[0]), hit[1]

    def cached(self, text: str) -> list[int]:
        ids = self.cache.get(text)
        if ids is None:
            ids = tuple(self.encode(text))
            if len(text) <= _MAX_CACHED_CHARS:
                if len(self.cache) >= _MAX_ENTRIES:
                    self.cache.clear()
                self.cache[text] = ids
        return list(ids)

    def segmented(self, text: str) -> list[int]:
        assert self.coord_ids is not None
        parts = _SPLIT.split(text)
        coord_ids = self.coord_ids
        out: list[int] = []
        for k, part in enumerate(parts):
            if k % 2 == 0:
                if part:
                    # One call per new piece: a batched call would be no faster (the backend parallelizes a
                    # batch over threads, whose wake-up costs more than these few short texts).
                    out += self.cached(part)
                continue
            token_id = coord_ids.get(part)
            if token_id is None:  # a coordinate-like string that is not an added token: no safe split
                return encode_text(self.tokenizer, text)
            out.append(token_id)
        return out


_ENCODERS: PerTokenizer[_Encoder] = PerTokenizer(_Encoder)


def _encoder(tokenizer: Any) -> _Encoder:
    return _ENCODERS.get(tokenizer)


def encode_cached(tokenizer: Any, text: str) -> list[int]:
    """``encode_text(tokenizer, text)``, memoized per tokenizer for texts up to 256 characters."""
    return _encoder(tokenizer).cached(text)


def encode_roundtrip(tokenizer: Any, text: str) -> tuple[list[int], str]:
    """``(ids, decode_text(tokenizer, ids))`` with ``ids = encode_text(tokenizer, text)``, memoized like
    :func:`encode_cached` (the §6.6 cut re-encodes a few characters and checks that they decode back)."""
    return _encoder(tokenizer).roundtrip(text)


def encode_segmented(tokenizer: Any, text: str) -> list[int]:
    """``encode_text(tokenizer, text)``, built from memoized pieces between coordinate tokens when exact."""
    enc = _encoder(tokenizer)
    if enc.coord_ids is None:
        return encode_text(tokenizer, text)
    return enc.segmented(text)
