"""A toy tokenizer whose pieces are given explicitly (docs/ALGORITHM.md#required-tests "toy tokenizer").

Vocabulary: special tokens, the 1000 single-id coordinate tokens (added tokens, like the real tokenizer), the
printable ASCII characters and, optionally, the 256 single bytes, then the pieces the test asks for (``str``
or ``bytes``; bytes pieces let a test split a multi-byte character across tokens). ``decode`` concatenates
bytes and decodes UTF-8 with replacement, like byte-level BPE. ``encode`` splits out added tokens, then
matches the longest vocabulary entry greedily on the UTF-8 bytes; bytes it cannot match become the unknown
token (which decodes to U+FFFD) when ``byte_fallback=False`` — handy to provoke a ``CutRoundTripError``.

It exposes ``token_bytes(id)``, which the learner's detokenizer uses as its byte table.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence

SPECIALS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class ToyTokenizer:
    """Explicit-vocabulary tokenizer with the ``encode``/``decode``/``convert_*`` API the learner calls."""

    def __init__(
        self,
        pieces: Iterable[str | bytes] = (),
        *,
        missing_coords: Iterable[int] = (),
        byte_fallback: bool = True,
        extra_added: dict[str, int] | None = None,
    ) -> None:
        self._vocab: list[bytes] = []
        self._special_ids: set[int] = set()
        self._added: dict[str, int] = {}
        self._regular: dict[bytes, int] = {}
        self.unk_token_id = self._add("\ufffd".encode(), special=True)  # unknown text decodes to U+FFFD
        for s in SPECIALS:
            self._added[s] = self._add(s.encode(), special=True)
        missing = set(missing_coords)
        for k in range(1000):
            if k not in missing:
                s = f"<|coord_{k}|>"
                self._added[s] = self._add(s.encode())
        for s, tid in (extra_added or {}).items():  # aliases: an added string resolving to an existing id
            self._added[s] = tid
        for c in range(0x20, 0x7F):
            self._add_regular(bytes([c]))
        self._add_regular(b"\n")
        if byte_fallback:
            for b in range(256):
                self._add_regular(bytes([b]))
        for p in pieces:
            self._add_regular(p.encode() if isinstance(p, str) else bytes(p))
        self._max_len = max(len(b) for b in self._regular)
        alts = sorted(self._added, key=len, reverse=True)
        self._added_re = re.compile("|".join(re.escape(a) for a in alts)) if alts else None
        self.eos_token_id = self._added["<|im_end|>"]
        self.pad_token_id = self._added["<|endoftext|>"]

    def _add(self, b: bytes, special: bool = False) -> int:
        self._vocab.append(b)
        tid = len(self._vocab) - 1
        if special:
            self._special_ids.add(tid)
        return tid

    def _add_regular(self, b: bytes) -> int:
        if b not in self._regular:
            self._regular[b] = self._add(b)
        return self._regular[b]

    def __len__(self) -> int:
        return len(self._vocab)

    # --- helpers for tests ----------------------------------------------------------------------------------

    def id_of(self, piece: str | bytes) -> int:
        """Id of one exact vocabulary entry (added token string, or regular piece)."""
        if isinstance(piece, str) and piece in self._added:
            return self._added[piece]
        b = piece.encode() if isinstance(piece, str) else piece
        return self._regular[b]

    def ids_of(self, pieces: Sequence[str | bytes | int]) -> list[int]:
        """Ids of a sequence of exact pieces; ints are taken as coordinate bins."""
        return [self._added[f"<|coord_{p}|>"] if isinstance(p, int) else self.id_of(p) for p in pieces]

    # --- tokenizer API --------------------------------------------------------------------------------------

    def _bytes_of(self, token_id: int) -> bytes:
        return self._vocab[token_id] if 0 <= token_id < len(self._vocab) else b""

    def token_bytes(self, token_id: int) -> bytes:
        """Raw bytes of one token (the detokenizer's byte table)."""
        return self._bytes_of(token_id)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False, **_: object) -> str:
        out = []
        for t in ids:
            if skip_special_tokens and t in self._special_ids:
                continue
            out.append(self._bytes_of(t))
        return b"".join(out).decode("utf-8", "replace")

    def _encode_plain(self, text: str) -> list[int]:
        data = text.encode()
        ids: list[int] = []
        i = 0
        while i < len(data):
            for n in range(min(self._max_len, len(data) - i), 0, -1):
                tid = self._regular.get(data[i : i + n])
                if tid is not None:
                    ids.append(tid)
                    i += n
                    break
            else:
                ids.append(self.unk_token_id)
                i += 1
        return ids

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        ids: list[int] = []
        pos = 0
        if self._added_re is not None:
            for m in self._added_re.finditer(text):
                ids += self._encode_plain(text[pos : m.start()])
                ids.append(self._added[m.group()])
                pos = m.end()
        return ids + self._encode_plain(text[pos:])

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self._added.get(tokens, self._regular.get(tokens.encode()))
        return [self.convert_tokens_to_ids(t) for t in tokens]  # type: ignore[misc]

    def convert_ids_to_tokens(self, ids: int | Sequence[int]) -> str | list[str]:
        if isinstance(ids, int):
            return self._bytes_of(ids).decode("utf-8", "backslashreplace")
        return [self.convert_ids_to_tokens(t) for t in ids]  # type: ignore[misc]


class PrefixDecodingToyTokenizer(ToyTokenizer):
    """The same toy without ``token_bytes``: forces the detokenizer's prefix-decoding fallback."""

    token_bytes = None  # type: ignore[assignment]
