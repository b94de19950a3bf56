"""Token-aligned strict parser of rollouts (spec/STAGE2.md §6).

``parse_rollout(response_token_ids, tokenizer, coord_vocab)`` turns the exact ids a rollout engine sampled into
the objects it predicted, with the token positions of their coordinates, and the token prefix that ends after
the last complete object. No JSON repair, no re-serialization; the only token edit is the re-encoding of the
one token that straddles a cut (§6.6).

Steps: pieces (§6.1, ``detok.token_pieces``) → hard stop at a stop marker (§6.2) → streaming scan (§6.3) →
fallback when there is no ``{`` (§6.4) → prefix cut (§6.5) → per-object validation (§6.7) → max object index
(§6.8). Invariants (§6.9): ``decode(prefix_token_ids) == prefix_text == text[:cut_char]`` (the §6.4 fallback is
synthetic: its prefix is ``encode("{")``), every coord index of a valid object points at that coord id inside
the prefix, ``prefix_text.rstrip()`` ends with ``{`` or ``}``, valid objects are in appearance order.

The token cut lives in ``cut.py`` (with a documented refinement for multi-byte characters split across tokens),
the §6.7 checks in ``parse_validate.py``.

Speed: the scan walks structural characters with one regex (strings are skipped whole), and an object value in
the exact serializer format (§4) is recognised by one regex match (right at its ``"object_N": `` key, which
then stands for the key, ``:``, value and ``,`` events at once); any other text takes the general path. Both
paths give identical results (property-tested). For such a value the bins are the captured coord tokens' bins
when those tokens spell the value's coordinate strings one for one (see ``_finish_object``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from learner.stage2.coords import CoordVocab, coord_token
from learner.stage2.cut import CutRoundTripError, cut_with_pieces, token_cut
from learner.stage2.detok import TokenPieces, _detokenizer, encode_text, token_pieces
from learner.stage2.parse_validate import GEOM_KEYS, check_geometry, validate_value

__all__ = [
    "DEFAULT_STOP_MARKERS",
    "CutRoundTripError",
    "ObjectKey",
    "ParseResult",
    "ParsedObject",
    "TokenPieces",
    "parse_rollout",
    "token_cut",
    "token_pieces",
]

logger = logging.getLogger(__name__)

DEFAULT_STOP_MARKERS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")

# One event per structural character outside strings; a string (group 1 = raw content, group 2 = the closing
# quote, absent when the text ends inside the string) is one event.
_SCAN_RE = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)(")?|[{}\[\],:]', re.DOTALL)
_OBJECT_KEY_RE = re.compile(r"object_(\d+)", re.ASCII)
# An object value exactly as format.serialize_entry writes it (desc without escapes or control characters).
_C = r'"<\|coord_\d{1,3}\|>"'
_CANONICAL_VALUE_RE = re.compile(
    r'\{"desc": "([^"\\\x00-\x1f]*)", "(bbox_2d|poly)": '
    rf"(\[{_C}(?:, {_C})*\]|\[\[{_C}, {_C}\](?:, \[{_C}, {_C}\])*\])\}}",
    re.ASCII,
)
_COORD_NUM_RE = re.compile(r"coord_(\d+)", re.ASCII)


class ObjectKey(NamedTuple):
    """A top-level key and its char span ``[start, end)`` in ``text`` (quotes included)."""

    key: str
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class ParsedObject:
    """One predicted object (every ``object_N`` entry whose value is an object).

    Attributes:
        key: the raw key text, e.g. ``"object_3"``.
        index: ``N`` of ``object_N``.
        desc: the desc when the value parsed (``None`` otherwise).
        geom_type: ``"bbox_2d"`` or ``"poly"`` when valid, else the geometry found (or ``None``).
        bins: coordinate bins as parsed from the text (flat; empty when invalid).
        coord_token_indices: indices into ``response_token_ids`` of the captured coordinate tokens.
        key_start_char: char position of the key's opening quote.
        value_span: ``(value_start, value_end)`` chars of the value ``{...}``; ``value_end`` is ``None`` when the
            object never closed.
        valid: passed every check of §6.7.
        reason: why it is invalid (``None`` when valid).
    """

    key: str
    index: int
    desc: str | None
    geom_type: str | None
    bins: tuple[int, ...]
    coord_token_indices: tuple[int, ...]
    key_start_char: int
    value_span: tuple[int, int | None]
    valid: bool
    reason: str | None = None

    @property
    def value_start(self) -> int:
        return self.value_span[0]

    @property
    def value_end(self) -> int | None:
        return self.value_span[1]


@dataclass(frozen=True)
class ParseResult:
    """Output of ``parse_rollout`` (§6).

    Attributes:
        response_token_ids: the rollout ids after the hard stop (§6.2).
        text: ``decode(response_token_ids)``.
        pieces: pieces and char spans of ``response_token_ids``.
        prefix_token_ids: ids up to the cut (the last one possibly re-encoded); ``encode("{")`` in a fallback.
        prefix_text: ``decode(prefix_token_ids)``; equals ``text[:cut_char]`` unless ``fallback``.
        prefix_pieces: pieces and char spans of ``prefix_token_ids``.
        cut_char: char position of the cut in ``text`` (0 in a fallback).
        valid_objects: valid objects in appearance order.
        all_objects: every started object (valid or not) in appearance order.
        object_keys: every top-level key with its char span.
        max_object_index_in_prefix: max ``N`` over ``object_N`` keys ending at or before the cut (§6.8), else 0.
        dropped_invalid: number of invalid objects (an unclosed last object counts once).
        truncated: the scan ended inside the top-level object (or there was no ``{``).
        fallback: the §6.4 fallback was used (no ``{``, or a failed cut round trip).
        cut_fallback: the fallback was caused by ``CutRoundTripError`` (metric ``rollout/parse_cut_fallback``).
        hard_stopped: a stop marker was found and removed.
        top_closed: the top-level object was closed.
        first_open_brace: char position of the first ``{`` (``None`` when there is none).
    """

    response_token_ids: list[int]
    text: str
    pieces: TokenPieces = field(repr=False)
    prefix_token_ids: list[int]
    prefix_text: str
    prefix_pieces: TokenPieces = field(repr=False)
    cut_char: int
    valid_objects: list[ParsedObject]
    all_objects: list[ParsedObject]
    object_keys: list[ObjectKey]
    max_object_index_in_prefix: int
    dropped_invalid: int
    truncated: bool
    fallback: bool
    cut_fallback: bool = False
    hard_stopped: bool = False
    top_closed: bool = False
    first_open_brace: int | None = None

    @property
    def obj_total(self) -> int:
        """Number of started objects (valid + invalid)."""
        return len(self.all_objects)


# ---------------------------------------------------------------------------------------------------------------
# §6.3 streaming scan


@dataclass(slots=True)
class _Obj:
    key: str
    n: int
    key_start: int
    value_start: int
    value_end: int | None = None
    captures: list[tuple[int, int]] = field(default_factory=list)  # (pos of opening '[', pos of closing ']')
    canonical: re.Match[str] | None = None


@dataclass(slots=True)
class _Scan:
    objects: list[_Obj]
    keys: list[ObjectKey]
    key_numbers: list[int]  # per key, N of object_N, else -1
    last_complete_object_end: int | None
    top_closed: bool
    truncated: bool


def _scan(text: str, first: int) -> _Scan:
    """Run the §6.3 state machine from the first ``{`` (at ``first``) to the top-level close or the end."""
    brace = 1
    bracket = 0
    expecting = [False, True]  # expecting_key per brace depth
    objects: list[_Obj] = []
    keys: list[ObjectKey] = []
    key_numbers: list[int] = []
    last_key: str | None = None
    pending: tuple[str, int, int] | None = None
    cur: _Obj | None = None
    capture = False
    capture_depth = 0
    cap_start = 0
    last_end: int | None = None
    top_closed = False
    in_string = False
    search = _SCAN_RE.search
    pos = first + 1
    n_text = len(text)
    while True:
        m = search(text, pos)
        if m is None:
            break
        p = m.start()
        pos = m.end()
        ch = text[p]
        if ch == '"':
            if m.group(2) is None:
                in_string = True
                break
            if bracket == 0 and expecting[brace]:
                s = m.group(1)
                last_key = s
                if brace == 1:
                    keys.append(ObjectKey(s, p, pos))
                    km = _OBJECT_KEY_RE.fullmatch(s)
                    n = int(km.group(1)) if km is not None else -1
                    pending = (s, n, p) if km is not None else None
                    key_numbers.append(n)
                    cm = (
                        _CANONICAL_VALUE_RE.match(text, pos + 2)
                        if km and text.startswith(": {", pos)
                        else None
                    )
                    if cm is not None:
                        # A whole entry in serializer format: the ':', '{' (canonical value, as below) and ','
                        # events at once, leaving the state they would leave.
                        obj = _Obj(key=s, n=n, key_start=p, value_start=pos + 2, canonical=cm)
                        obj.captures.append((cm.start(3), cm.end(3) - 1))
                        obj.value_end = last_end = pos = cm.end()
                        objects.append(obj)
                        last_key, pending = cm.group(2), None
                        if len(expecting) == 2:
                            expecting.append(False)
                        expecting[2] = False
                        expecting[1] = text.startswith(",", pos)
                        pos += expecting[1]
        elif ch == "{":
            brace += 1
            if brace == len(expecting):
                expecting.append(True)
            else:
                expecting[brace] = True
            if brace == 2:
                if pending is None:
                    cur = None
                    continue
                cur = _Obj(key=pending[0], n=pending[1], key_start=pending[2], value_start=p)
                objects.append(cur)
                pending = None
                # Only at bracket depth 0: inside a list the scan would not see the inner keys as keys.
                cm = _CANONICAL_VALUE_RE.match(text, p) if bracket == 0 else None
                if cm is not None:
                    # The whole value in serializer format: the character-level scan would only set last_key to
                    # the geometry key, capture [geometry '[', its ']'), and close the object at cm.end().
                    cur.canonical = cm
                    cur.captures.append((cm.start(3), cm.end(3) - 1))
                    cur.value_end = last_end = cm.end()
                    last_key = cm.group(2)
                    expecting[2] = False
                    brace = 1
                    cur = None
                    pos = cm.end()
        elif ch == "}":
            if brace == 2 and cur is not None:
                cur.value_end = last_end = p + 1
                if capture:
                    cur.captures.append((cap_start, p))
                    capture = False
                cur = None
            brace -= 1
            if brace == 0:
                top_closed = True
                break
        elif ch == "[":
            bracket += 1
            if brace == 2 and cur is not None and not capture and last_key in GEOM_KEYS:
                capture = True
                capture_depth = bracket - 1
                cap_start = p
        elif ch == "]":
            bracket -= 1
            if capture and bracket <= capture_depth:
                capture = False
                assert cur is not None
                cur.captures.append((cap_start, p))
        elif ch == ",":
            if bracket == 0:
                expecting[brace] = True
                if brace == 1:
                    pending = None
        elif bracket == 0:  # ':'
            expecting[brace] = False
    if capture and cur is not None:
        cur.captures.append((cap_start, n_text))
    truncated = not top_closed and (brace != 0 or bracket != 0 or in_string)
    return _Scan(objects, keys, key_numbers, last_end, top_closed, truncated)


def _finish_object(
    o: _Obj,
    text: str,
    ids: Sequence[int],
    starts: list[int],
    id_to_bin: dict[int, int],
    cut_char: int,
    spelled: bool,
) -> ParsedObject:
    """The :class:`ParsedObject` of a scanned object (§6.7); ``spelled``: every coord id decodes to its own string."""
    is_coord = id_to_bin.__contains__
    coord_idx: list[int] = []
    for a, b in o.captures:
        # A coord token is captured iff it starts after the opening '[' and before the closing ']'.
        lo, hi = bisect.bisect_right(starts, a), bisect.bisect_left(starts, b)
        coord_idx += itertools.compress(range(lo, hi), map(is_coord, ids[lo:hi]))
    # Positional fields (key, index, desc, geom_type, bins, coord_token_indices, key_start_char, value_span,
    # valid, reason): a little cheaper than keywords, once per object.
    head = (o.key, o.n)
    tail = (tuple(coord_idx), o.key_start, (o.value_start, o.value_end))
    if o.value_end is None or o.value_end > cut_char:
        return ParsedObject(*head, None, None, (), *tail, False, "object not closed")
    captured = [id_to_bin[ids[j]] for j in coord_idx]
    reason: str | None
    cm = o.canonical
    if cm is not None and cm.group(1).strip():
        desc, geom, coords = cm.group(1), cm.group(2), cm.group(3)
        # When coord ids decode to their own strings (``spelled``), a captured coord token's piece is exactly one
        # coordinate string of the value (the value is ASCII: no pending multi-byte character can sit before it),
        # so as many tokens as strings means the same bins in the same order; no need to read the text.
        if spelled and coords.count("<|coord_") == len(captured):
            values = captured.copy()
        else:
            values = list(map(int, _COORD_NUM_RE.findall(coords)))  # \d{1,3}: always < 1000
        reason = check_geometry(geom, values, captured)
    else:
        desc, geom, values, reason = validate_value(text[o.value_start : o.value_end], captured)
    if reason is not None:
        return ParsedObject(*head, desc, geom, (), *tail, False, reason)
    return ParsedObject(*head, desc, geom, tuple(values), *tail, True)


# ---------------------------------------------------------------------------------------------------------------
# Entry point


def _fallback(
    ids: list[int], tp: TokenPieces, tokenizer: Any, *, cut_fallback: bool, hard_stopped: bool
) -> ParseResult:
    prefix_ids = encode_text(tokenizer, "{")
    prefix_tp = token_pieces(prefix_ids, tokenizer)
    if prefix_tp.text != "{":
        raise ValueError(f"tokenizer encodes '{{' to {prefix_ids}, which decodes to {prefix_tp.text!r}")
    return ParseResult(
        response_token_ids=ids,
        text=tp.text,
        pieces=tp,
        prefix_token_ids=prefix_ids,
        prefix_text="{",
        prefix_pieces=prefix_tp,
        cut_char=0,
        valid_objects=[],
        all_objects=[],
        object_keys=[],
        max_object_index_in_prefix=0,
        dropped_invalid=0,
        truncated=True,
        fallback=True,
        cut_fallback=cut_fallback,
        hard_stopped=hard_stopped,
    )


def _hard_stop(
    ids: list[int], tp: TokenPieces, tokenizer: Any, stop_markers: Sequence[str], quiet: bool = False
) -> tuple[bool, list[int], TokenPieces]:
    """§6.2: cut at the earliest stop marker; ``quiet`` keeps the input when that cut fails its round trip."""
    hits = [k for k in (tp.text.find(mk) for mk in stop_markers if mk) if k >= 0]
    if not hits:
        return False, ids, tp
    try:
        ids, tp = cut_with_pieces(ids, min(hits), tokenizer, tp)
    except CutRoundTripError:
        if not quiet:
            raise
        return False, ids, tp
    return True, ids, tp


def _parse(
    ids: list[int], tp: TokenPieces, tokenizer: Any, coord_vocab: CoordVocab, stop_markers: Sequence[str]
) -> ParseResult:
    hard_stopped, ids, tp = _hard_stop(ids, tp, tokenizer, stop_markers)
    text = tp.text
    first = text.find("{")
    if first < 0:
        return _fallback(ids, tp, tokenizer, cut_fallback=False, hard_stopped=hard_stopped)
    scan = _scan(text, first)
    cut_char = scan.last_complete_object_end if scan.last_complete_object_end is not None else first + 1
    prefix_ids, prefix_tp = cut_with_pieces(ids, cut_char, tokenizer, tp)
    id_to_bin = coord_vocab.id_to_bin
    spelled = _detokenizer(tokenizer).spells(coord_vocab.ids, coord_token)
    objs = [_finish_object(o, text, ids, tp.starts, id_to_bin, cut_char, spelled) for o in scan.objects]
    valid = [o for o in objs if o.valid]
    # Keys come in text order, so those ending at or before the cut are a prefix of the list.
    n_before_cut = bisect.bisect_right([k.end for k in scan.keys], cut_char)
    max_n = max(max(scan.key_numbers[:n_before_cut], default=0), 0)
    return ParseResult(
        response_token_ids=ids,
        text=text,
        pieces=tp,
        prefix_token_ids=prefix_ids,
        prefix_text=text[:cut_char],
        prefix_pieces=prefix_tp,
        cut_char=cut_char,
        valid_objects=valid,
        all_objects=objs,
        object_keys=scan.keys,
        max_object_index_in_prefix=max_n,
        dropped_invalid=len(objs) - len(valid),
        truncated=scan.truncated,
        fallback=False,
        hard_stopped=hard_stopped,
        top_closed=scan.top_closed,
        first_open_brace=first,
    )


def parse_rollout(
    response_token_ids: Sequence[int],
    tokenizer: Any,
    coord_vocab: CoordVocab,
    stop_markers: Sequence[str] = DEFAULT_STOP_MARKERS,
) -> ParseResult:
    """Parse one rollout strictly and token-aligned (§6). Never raises on bad rollout content.

    Args:
        response_token_ids: the exact ids the engine sampled (may end with the end-of-turn id); Python ints.
        tokenizer: the rollout tokenizer (``decode``/``encode``; byte-level BPE or ``token_bytes`` for speed).
        coord_vocab: the tokenizer's coordinate ids.
        stop_markers: ``stage2.parse.stop_markers``.

    Returns:
        ``ParseResult``; on ``CutRoundTripError`` the §6.4 fallback with ``cut_fallback=True``.
    """
    # Lists of Python ints (what engines and ``.tolist()`` return) are only copied; anything else is converted.
    ids = (
        response_token_ids.copy()
        if isinstance(response_token_ids, list)
        else [int(t) for t in response_token_ids]
    )
    tp = token_pieces(ids, tokenizer)
    try:
        return _parse(ids, tp, tokenizer, coord_vocab, stop_markers)
    except CutRoundTripError as exc:
        logger.debug("parse cut fallback: %s", exc)
        hard_stopped, ids, tp = _hard_stop(ids, tp, tokenizer, stop_markers, quiet=True)
        return _fallback(ids, tp, tokenizer, cut_fallback=True, hard_stopped=hard_stopped)
