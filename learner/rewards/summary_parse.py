"""Shared parsing rules of the "summary" task (docs/ALGORITHM.md#summary-task).

Every summary reward reads a completion through :func:`make_sample`, so the text cleanup, the header regex,
the JSON parse with duplicate-key detection and the category merge are defined exactly once.

Invariants:
    * ``SummarySample.lines`` is ``text.split("\\n")`` of the cleaned text (never empty: ``"".split`` gives
      ``[""]``).
    * ``SummarySample.pred`` is a ``dict`` or ``None`` (unparseable: fewer than two lines, invalid JSON, or a
      JSON value that is not an object).
    * ``categories()`` keys are stripped category names; its values never contain ``类别``.
"""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

logger = logging.getLogger(__name__)

IRRELEVANT = "无关图片"
"""The whole expected answer (and the reference) for an irrelevant image."""

HEADER_RE = re.compile(r"^<DOMAIN=([A-Za-z0-9_]+)>, <TASK=([A-Za-z0-9_]+)>$")
STATS_KEY = "统计"
CATEGORY_KEY = "类别"
TEXT_KEY = "文本"
NOTES_KEY = "备注"
GROUP_STATS_KEY = "分组统计"

END_OF_TURN_TOKENS: tuple[str, ...] = ("<|im_end|>", "<|endoftext|>")
"""Chat end markers removed before parsing; a completion decoded with special tokens keeps them."""

_ASCII_DIGITS = re.compile(r"[0-9]+")

RefKind = Literal["relevant", "irrelevant", "invalid"]


def is_digits(value: str) -> bool:
    """True iff ``value`` is one or more ASCII digits (``str.isdigit`` would also accept ``²`` or ``٣``)."""
    return _ASCII_DIGITS.fullmatch(value) is not None


def clean_text(completion: str) -> str:
    """Removes the end-of-turn markers, then strips surrounding whitespace (§4.3)."""
    for token in END_OF_TURN_TOKENS:
        completion = completion.replace(token, "")
    return completion.strip()


def expected_header(domain: str) -> str:
    """The header line a relevant completion must start with for ``domain``."""
    return f"<DOMAIN={domain}>, <TASK=SUMMARY>"


@dataclass(frozen=True)
class JsonParse:
    """Result of parsing one line as JSON.

    Attributes:
        ok: the line is valid JSON (of any type).
        value: the decoded value (``None`` when not ok; a JSON ``null`` is ``ok=True, value=None``).
        duplicate_keys: some object, at any depth, repeats a key (the last value wins in ``value``).
    """

    ok: bool
    value: Any = None
    duplicate_keys: bool = False


def parse_json_line(line: str) -> JsonParse:
    """Parses ``line`` with a pairs hook that records a duplicate key at every depth."""
    seen_duplicate = False

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        nonlocal seen_duplicate
        obj: dict[str, Any] = {}
        for key, value in pairs:
            if key in obj:
                seen_duplicate = True
            obj[key] = value
        return obj

    try:
        value = json.loads(line, object_pairs_hook=hook)
    except (json.JSONDecodeError, RecursionError):
        return JsonParse(ok=False)
    return JsonParse(ok=True, value=value, duplicate_keys=seen_duplicate)


@dataclass(frozen=True)
class SummaryRow:
    """The reference metadata of one dataset row (§4.1).

    Attributes:
        task_mode: ``summary`` or ``dense``; every summary reward scores 0.0 unless ``summary``.
        domain: ``BBU`` or ``RRU`` (other strings are kept; they simply never match a BBU-only rule).
        ref: the reference object for a relevant image, else ``None``.
        ref_kind: ``relevant`` (object), ``irrelevant`` (``无关图片``) or ``invalid`` (anything else;
            scores 0.0).
    """

    task_mode: str
    domain: str
    ref: dict[str, Any] | None
    ref_kind: RefKind

    @property
    def is_summary(self) -> bool:
        return self.task_mode == "summary"


def make_row(row: Mapping[str, Any]) -> SummaryRow:
    """Reads ``task_mode``, ``domain`` and ``summary_ref`` from a dataset row.

    ``summary_ref`` may be the object itself, ``无关图片``, or a JSON string encoding the object (datasets
    often store it serialized). A summary row whose reference is neither is logged and scored 0.0 rather
    than raised, so one bad sample cannot stop a rank (docs/ALGORITHM.md#error-policy).

    Raises:
        KeyError: ``task_mode`` is missing (a data-contract error, not a bad sample).
    """
    if "task_mode" not in row:
        raise KeyError(f"reward row has no 'task_mode' (keys: {sorted(row)}); the dataset must provide it")
    task_mode = str(row["task_mode"])
    domain = str(row.get("domain", ""))
    raw_ref = row.get("summary_ref")
    if isinstance(raw_ref, str) and raw_ref.strip() == IRRELEVANT:
        return SummaryRow(task_mode, domain, None, "irrelevant")
    if isinstance(raw_ref, str):
        parsed = parse_json_line(raw_ref)
        raw_ref = parsed.value if parsed.ok else None
    if isinstance(raw_ref, dict):
        return SummaryRow(task_mode, domain, raw_ref, "relevant")
    if task_mode == "summary":
        logger.warning(
            "summary row with an unusable summary_ref of type %s; its rewards are 0.0", type(raw_ref)
        )
    return SummaryRow(task_mode, domain, None, "invalid")


@dataclass(frozen=True)
class SummarySample:
    """One completion parsed once, with its row (input of every summary reward).

    Attributes:
        row: the reference metadata.
        text: cleaned completion text.
        lines: ``text.split("\\n")``.
        line2: the JSON parse of ``lines[1]`` (``ok=False`` when there is no second line).
        pred: ``line2.value`` when it is an object, else ``None`` (unparseable).
    """

    row: SummaryRow
    text: str
    lines: list[str] = field(repr=False)
    line2: JsonParse
    pred: dict[str, Any] | None


def make_sample(completion: str, row: SummaryRow) -> SummarySample:
    """Applies the §4.3 parsing rules to one completion."""
    text = clean_text(completion)
    lines = text.split("\n")
    line2 = parse_json_line(lines[1]) if len(lines) >= 2 else JsonParse(ok=False)
    pred = line2.value if line2.ok and isinstance(line2.value, dict) else None
    return SummarySample(row=row, text=text, lines=lines, line2=line2, pred=pred)


def category_entries(obj: Mapping[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """The valid ``统计`` entries in order, unmerged: ``(stripped 类别, attributes without 类别)``.

    Multiset rules (facts, OCR strings) read these so that a category split over two entries counts
    every value of both.
    """
    stats = obj.get(STATS_KEY)
    if not isinstance(stats, list):
        return []
    entries = []
    for entry in stats:
        if isinstance(entry, dict) and isinstance(entry.get(CATEGORY_KEY), str):
            attrs = {k: v for k, v in entry.items() if k != CATEGORY_KEY}
            entries.append((entry[CATEGORY_KEY].strip(), attrs))
    return entries


def _unite(left: Any, right: Any) -> Any:
    """Unites two attribute values: objects key-wise (recursively), ints add, lists concatenate.

    Adding ints and concatenating lists keeps the merged entry consistent with the per-entry fact counts
    of §5.2; any other clash keeps the first value.
    """
    if isinstance(left, dict) and isinstance(right, dict):
        merged = dict(left)
        for key, value in right.items():
            merged[key] = _unite(merged[key], value) if key in merged else value
        return merged
    if _is_int(left) and _is_int(right):
        return left + right
    if isinstance(left, list) and isinstance(right, list):
        return left + right
    return left


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def categories(obj: Mapping[str, Any]) -> dict[str, dict[str, Any]]:
    """``categories(obj)`` of §4.3: valid ``统计`` entries merged by category name, in first-seen order."""
    merged: dict[str, dict[str, Any]] = {}
    for name, attrs in category_entries(obj):
        merged[name] = _unite(merged[name], attrs) if name in merged else dict(attrs)
    return merged


def pred_and_ref(sample: SummarySample) -> tuple[dict[str, Any], dict[str, Any]] | None:
    """``(pred, ref)`` for a summary row with a relevant reference and a parseable prediction, else ``None``.

    ``None`` is the "scores 0.0" case of §5 (irrelevant rows, unparseable predictions, non-summary rows).
    """
    if not sample.row.is_summary or sample.row.ref is None or sample.pred is None:
        return None
    return sample.pred, sample.row.ref
