"""Token-aligned strict parser of rollouts (docs/ALGORITHM.md#parsing).

``parse_rollout(response_token_ids, tokenizer, coord_vocab)`` turns the exact ids a rollout engine sampled
into the objects it predicted, with the token positions of their coordinates, and the token prefix that ends
after the last complete object. No JSON repair, no re-serialization; the only token edit is the re-encoding of
the one token that straddles a cut (§6.6).

Steps: pieces (§6.1, ``detok.token_pieces``) → hard stop at a stop marker (§6.2) → streaming scan (§6.3) →
fallback when there is no ``{`` (§6.4) → prefix cut (§6.5) → per-object validation (§6.7) → max object index
(§6.8). Invariants (§6.9): ``decode(prefix_token_ids) == prefix_text == text[:cut_char]`` (the §6.4 fallback
is synthetic: its prefix is ``encode("{")``), every coord index of a valid object points at that coord id
inside the prefix, ``prefix_text.rstrip()`` ends with ``{`` or ``}``, valid objects are in appearance order.

The §6.3 streaming scan lives in ``scan.py`` (with its fast path for values in the exact serializer format,
§4), the token cut in ``cut.py`` (with a documented refinement for multi-byte characters split across tokens),
the §6.7 checks in ``validate.py``; this module holds the result types, the per-object step that turns a
scanned object into a ``ParsedObject`` and the entry point. For a value the scan matched in serializer format,
the bins are the captured coord tokens' bins when those tokens spell the value's coordinate strings one for
one (see ``_finish_object``).
"""

from __future__ import annotations

import bisect
import itertools
import logging
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from learner.stage2.coords import CoordVocab, coord_token
from learner.stage2.parse.cut import CutRoundTripError, cut_with_pieces, token_cut
from learner.stage2.parse.detok import TokenPieces, _detokenizer, encode_text, token_pieces
from learner.stage2.parse.scan import CANONICAL_VALUE_RE, ObjectKey, ScannedObject, scan
from learner.stage2.parse.validate import check_geometry, validate_value

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

# The scan's fast-path matcher, read at each call: tests replace it with a never-matching pattern to force the
# general path.
_CANONICAL_VALUE_RE = CANONICAL_VALUE_RE
_COORD_NUM_RE = re.compile(r"coord_(\d+)", re.ASCII)


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
        value_span: ``(value_start, value_end)`` chars of the value ``{...}``; ``value_end`` is ``None`` when
            the object never closed.
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
        max_object_index_in_prefix: max ``N`` over ``object_N`` keys ending at or before the cut (§6.8),
            else 0.
        dropped_invalid: number of invalid objects (an unclosed last object counts once).
        truncated: the scan ended inside the top-level object (or there was no ``{``).
        fallback: the §6.4 fallback was used (no ``{``, or a failed cut round trip).
        cut_fallback: the fallback was caused by ``CutRoundTripError`` (metric
            ``rollout/parse_cut_fallback``).
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


# ------------------------------------------------------------------------------------------------------------
# §6.7 per object


def _finish_object(
    o: ScannedObject,
    text: str,
    ids: Sequence[int],
    starts: list[int],
    id_to_bin: dict[int, int],
    cut_char: int,
    spelled: bool,
) -> ParsedObject:
    """The :class:`ParsedObject` of a scanned object (§6.7).

    ``spelled``: every coord id decodes to its own string."""
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
        # When coord ids decode to their own strings (``spelled``), a captured coord token's piece is exactly
        # one coordinate string of the value (the value is ASCII: no pending multi-byte character can sit
        # before it), so as many tokens as strings means the same bins in the same order; the text need not
        # be read.
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


# ------------------------------------------------------------------------------------------------------------
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
    scanned = scan(text, first, value_re=_CANONICAL_VALUE_RE)
    cut_char = scanned.last_complete_object_end if scanned.last_complete_object_end is not None else first + 1
    prefix_ids, prefix_tp = cut_with_pieces(ids, cut_char, tokenizer, tp)
    id_to_bin = coord_vocab.id_to_bin
    spelled = _detokenizer(tokenizer).spells(coord_vocab.ids, coord_token)
    objs = [_finish_object(o, text, ids, tp.starts, id_to_bin, cut_char, spelled) for o in scanned.objects]
    valid = [o for o in objs if o.valid]
    # Keys come in text order, so those ending at or before the cut are a prefix of the list.
    n_before_cut = bisect.bisect_right([k.end for k in scanned.keys], cut_char)
    max_n = max(max(scanned.key_numbers[:n_before_cut], default=0), 0)
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
        object_keys=scanned.keys,
        max_object_index_in_prefix=max_n,
        dropped_invalid=len(objs) - len(valid),
        truncated=scanned.truncated,
        fallback=False,
        hard_stopped=hard_stopped,
        top_closed=scanned.top_closed,
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
    # Lists of Python ints (what engines and ``.tolist()`` return) are only copied; anything else
    # is converted.
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
