"""Format rewards of the summary task (docs/ALGORITHM.md#rewards: format, header, strict, parse, no_dup_keys,
dataset).

Each function scores one parsed sample; non-summary rows and rows with an invalid reference score 0.0.
"""

from __future__ import annotations

from learner.rewards.summary_parse import HEADER_RE, IRRELEVANT, SummarySample, expected_header


def _relevant(sample: SummarySample) -> bool:
    return sample.row.is_summary and sample.row.ref_kind == "relevant"


def _irrelevant(sample: SummarySample) -> bool:
    return sample.row.is_summary and sample.row.ref_kind == "irrelevant"


def format_reward(sample: SummarySample) -> float:
    """``summary.format``: 1.0 for the exact irrelevant answer, or a two-line header + ``{…}`` answer."""
    if _irrelevant(sample):
        return 1.0 if sample.text == IRRELEVANT else 0.0
    if not _relevant(sample):
        return 0.0
    lines = sample.lines
    if len(lines) != 2 or HEADER_RE.match(lines[0]) is None:
        return 0.0
    body = lines[1].strip()
    return 1.0 if body.startswith("{") and body.endswith("}") else 0.0


def header_reward(sample: SummarySample) -> float:
    """``summary.header``: relevant → 1.0 iff line 1 is the expected header; irrelevant → −1.0 for any
    header."""
    if _relevant(sample):
        return 1.0 if sample.lines[0] == expected_header(sample.row.domain) else 0.0
    if _irrelevant(sample):
        emits_header = any(HEADER_RE.match(line) or "<TASK=" in line for line in sample.lines)
        return -1.0 if emits_header else 0.0
    return 0.0


def strict_reward(sample: SummarySample) -> float:
    """``summary.strict``: relevant → −1.0 unless exactly two lines under the expected header."""
    if not _relevant(sample):
        return 0.0
    ok = len(sample.lines) == 2 and sample.lines[0] == expected_header(sample.row.domain)
    return 0.0 if ok else -1.0


def parse_reward(sample: SummarySample) -> float:
    """``summary.parse``: relevant → −1.0 when line 2 is missing or not a JSON object."""
    if not _relevant(sample):
        return 0.0
    return 0.0 if sample.pred is not None else -1.0


def no_dup_keys_reward(sample: SummarySample) -> float:
    """``summary.no_dup_keys``: −1.0 when line 2 parses and repeats a key at any depth (relevant rows)."""
    if not _relevant(sample):
        return 0.0
    return -1.0 if sample.line2.ok and sample.line2.duplicate_keys else 0.0


def dataset_reward(sample: SummarySample) -> float:
    """``summary.dataset``: relevant → 1.0 iff line 1 starts with ``<DOMAIN={domain}>``."""
    if not _relevant(sample):
        return 0.0
    return 1.0 if sample.lines[0].startswith(f"<DOMAIN={sample.row.domain}>") else 0.0
