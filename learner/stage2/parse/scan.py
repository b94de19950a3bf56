"""Streaming scan of the strict parser (docs/ALGORITHM.md#streaming-scan).

``scan(text, first, value_re=CANONICAL_VALUE_RE)`` runs the §6.3 state machine from the first ``{`` of a
rollout's text: it records every top-level key (``ObjectKey``), every ``object_N`` whose value is an object
(``ScannedObject``: key, ``N``, value span, the char spans of its captured geometry lists) and where the last
complete object ends, which sets the prefix cut (§6.5). Turning a scanned object into a validated
``ParsedObject`` (§6.7) is the parser's job (``parser.py``).

Speed: the scan walks structural characters with one regex (strings are skipped whole), and an object value in
the exact serializer format (§4) is recognised by one ``value_re`` match (right at its ``"object_N": `` key,
which then stands for the key, ``:``, value and ``,`` events at once); any other text takes the general path.
Both paths give identical results (property-tested: the tests pass a never-matching ``value_re`` through the
parser to force the general path).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import NamedTuple

from learner.stage2.parse.validate import GEOM_KEYS

__all__ = ["CANONICAL_VALUE_RE", "ObjectKey", "Scan", "ScannedObject", "scan"]

# One event per structural character outside strings; a string (group 1 = raw content, group 2 = the closing
# quote, absent when the text ends inside the string) is one event.
_SCAN_RE = re.compile(r'"([^"\\]*(?:\\.[^"\\]*)*)(")?|[{}\[\],:]', re.DOTALL)
_OBJECT_KEY_RE = re.compile(r"object_(\d+)", re.ASCII)
# An object value exactly as format.serialize_entry writes it (desc without escapes or control characters):
# group 1 = desc, group 2 = geometry key, group 3 = the geometry list.
_C = r'"<\|coord_\d{1,3}\|>"'
CANONICAL_VALUE_RE = re.compile(
    r'\{"desc": "([^"\\\x00-\x1f]*)", "(bbox_2d|poly)": '
    rf"(\[{_C}(?:, {_C})*\]|\[\[{_C}, {_C}\](?:, \[{_C}, {_C}\])*\])\}}",
    re.ASCII,
)


class ObjectKey(NamedTuple):
    """A top-level key and its char span ``[start, end)`` in ``text`` (quotes included)."""

    key: str
    start: int
    end: int


@dataclass(slots=True)
class ScannedObject:
    """One ``object_N`` entry whose value is an object, as the scan found it (not yet validated).

    Attributes:
        key: the raw key text, e.g. ``"object_3"``.
        n: ``N`` of ``object_N``.
        key_start: char position of the key's opening quote.
        value_start: char position of the value's ``{``.
        value_end: char position just after the value's ``}`` (``None`` when the object never closed).
        captures: ``(pos of opening '[', pos of closing ']')`` of each captured geometry list (the end of the
            text when the list never closed).
        canonical: the ``value_re`` match when the value is in the exact serializer format, else ``None``.
    """

    key: str
    n: int
    key_start: int
    value_start: int
    value_end: int | None = None
    captures: list[tuple[int, int]] = field(default_factory=list)
    canonical: re.Match[str] | None = None


@dataclass(slots=True)
class Scan:
    """What ``scan`` found.

    Attributes:
        objects: scanned objects in appearance order.
        keys: every top-level key in text order.
        key_numbers: per key, ``N`` of ``object_N``, else -1.
        last_complete_object_end: char position just after the last closed object (``None`` when none closed).
        top_closed: the top-level object was closed.
        truncated: the scan ended inside the top-level object.
    """

    objects: list[ScannedObject]
    keys: list[ObjectKey]
    key_numbers: list[int]
    last_complete_object_end: int | None
    top_closed: bool
    truncated: bool


def scan(text: str, first: int, *, value_re: re.Pattern[str]) -> Scan:
    """Run the §6.3 state machine from the first ``{`` (at ``first``) to the top-level close or the end.

    Args:
        text: the decoded rollout (after the hard stop).
        first: char position of the first ``{`` in ``text``.
        value_re: the fast-path matcher of a value in serializer format, with ``CANONICAL_VALUE_RE``'s groups
            (the parser passes ``CANONICAL_VALUE_RE``; a never-matching pattern forces the general path).

    Returns:
        The ``Scan``.
    """
    brace = 1
    bracket = 0
    expecting = [False, True]  # expecting_key per brace depth
    objects: list[ScannedObject] = []
    keys: list[ObjectKey] = []
    key_numbers: list[int] = []
    last_key: str | None = None
    pending: tuple[str, int, int] | None = None
    cur: ScannedObject | None = None
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
                    cm = value_re.match(text, pos + 2) if km and text.startswith(": {", pos) else None
                    if cm is not None:
                        # A whole entry in serializer format: the ':', '{' (canonical value, as below) and ','
                        # events at once, leaving the state they would leave.
                        obj = ScannedObject(key=s, n=n, key_start=p, value_start=pos + 2, canonical=cm)
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
                cur = ScannedObject(key=pending[0], n=pending[1], key_start=pending[2], value_start=p)
                objects.append(cur)
                pending = None
                # Only at bracket depth 0: inside a list the scan would not see the inner keys as keys.
                cm = value_re.match(text, p) if bracket == 0 else None
                if cm is not None:
                    # The whole value in serializer format: the character-level scan would only set last_key
                    # to the geometry key, capture [geometry '[', its ']'), and close the object at cm.end().
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
    return Scan(objects, keys, key_numbers, last_end, top_closed, truncated)
