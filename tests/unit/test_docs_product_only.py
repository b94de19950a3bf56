"""What a user reads speaks of the product alone (docs/STYLE §10: "Nothing a user reads speaks of how this
repository is developed"): README.md, every file under `docs/` and every file under `configs/` name no
development-environment tooling (device-call carry folders, `$OUT`, sandbox names, "device machine",
"this 2-core machine"), no backlog numbers ("issue 48") and no commit hashes.

Dated run logs, commit hashes and machine-load remarks belong in `bench/RESULTS.md`, device-call plans in
`bench/DEVICE_NOTES.md`; this test does not read `bench/`.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

SCANNED_FILES = ("README.md",)
SCANNED_DIRS = ("docs", "configs")
TEXT_SUFFIXES = {".md", ".yaml", ".yml", ".json", ".txt", ".toml", ".cfg", ".ini"}

HEX_ALLOWED: frozenset[str] = frozenset()
"""Hex-looking words that are not commit hashes (none needed today)."""

_RULE_TABLE = r"""
carry folder `.vllmw` ¦ \.vllmw
  describe the install a user does (pip install 'rollmatch[gpu]'); device-call notes: bench/DEVICE_NOTES.md
the device tool's `carry` ¦ \bcarry\s*[:=]|`carry`|\bcarry\s*\|
  a user has no carry list: say what to install or copy, or move the plan to bench/DEVICE_NOTES.md
`$OUT` ¦ \$OUT\b|\$\{OUT\}
  name the user's output folder (e.g. runs/<name>/) instead of the device tool's $OUT
a backlog number ¦ (?i)\bissues?\s+#?\d+
  say what the change does; backlog numbers belong in commit messages and bench/RESULTS.md
a sandbox name ¦ (?i)\bgVisor\b|\bFirecracker\b
  a user runs on their own machine: drop the sandbox, or move the note to bench/DEVICE_NOTES.md
the development environment's 'device machine' ¦ (?i)\bdevice[- ]machines?\b
  say 'a GPU host' (or name the GPUs); device-call notes go to bench/DEVICE_NOTES.md
'this 2-core machine' ¦ (?i)\bthis\s+2[- ]core\b
  quote the figure with its spread and link its bench/RESULTS.md section; machine-load notes go there
"""
"""Two lines a rule: ``what is found ¦ its pattern`` (Python `re`; `(?i)` ignores case), then the fix."""

_LINES = _RULE_TABLE.strip().splitlines()
RULES: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
    (head.split(" ¦ ")[0], re.compile(head.split(" ¦ ")[1]), fix.strip())
    for head, fix in zip(_LINES[0::2], _LINES[1::2], strict=True)
)

_HEX = re.compile(r"(?<![\w/#.-])([0-9a-f]{7,40})(?![\w/.-]|\.\d)")
"""A word of 7–40 lowercase hex characters, not part of a path, colour, URL, number or longer token."""

_HEX_FIX = "drop the commit hash (a user reads the product, not its history); keep it in bench/RESULTS.md"


def _is_hash(word: str) -> bool:
    return bool(re.search(r"\d", word)) and bool(re.search(r"[a-f]", word)) and word not in HEX_ALLOWED


def _sha_context(line: str, start: int) -> bool:
    """A hex word after `sha256:`/`sha:`/`digest`/`checksum` on its line is a checksum, not a commit."""
    return bool(re.search(r"(sha\d*|digest|checksum)\s*[:=]?\s*['\"]?$", line[:start], re.IGNORECASE))


def violations(text: str) -> list[tuple[int, str, str, str]]:
    """`(line, what, excerpt, fix)` for every forbidden mention in `text`."""
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        for what, pattern, fix in RULES:
            for match in pattern.finditer(line):
                out.append((number, what, match.group(0), fix))
        for match in _HEX.finditer(line):
            word = match.group(1)
            if _is_hash(word) and not _sha_context(line, match.start(1)):
                out.append((number, "a commit hash", word, _HEX_FIX))
    return out


def scanned() -> list[Path]:
    paths = [REPO / name for name in SCANNED_FILES]
    for folder in SCANNED_DIRS:
        paths += sorted(p for p in (REPO / folder).rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES)
    return paths


def test_the_check_can_fail() -> None:
    text = (
        "carry: .venv, .vllmw/q03\n"
        "write it under $OUT; see issue 48: items 3-7\n"
        "on the device machine (Firecracker), gVisor too\n"
        "Measured on this 2-core machine at `f48ea61`.\n"
        "colour #a1b2c3, sha256: 3f2a9c0d1e4b5a6f7e8d9c0b1a2f3e4d, deadbeef, 1234567, path runs/ab12cd34/x\n"
        "We carry the weights across; they carry on.\n"
    )
    found = [(line, what) for line, what, _, _ in violations(text)]
    assert found == [
        (1, "carry folder `.vllmw`"),
        (1, "the device tool's `carry`"),
        (2, "`$OUT`"),
        (2, "a backlog number"),
        (3, "a sandbox name"),
        (3, "a sandbox name"),
        (3, "the development environment's 'device machine'"),
        (4, "'this 2-core machine'"),
        (4, "a commit hash"),
    ]


def test_the_scan_reads_the_user_documents() -> None:
    names = {p.relative_to(REPO).as_posix() for p in scanned()}
    assert {"README.md", "docs/RUNBOOK.md", "docs/ARCHITECTURE.md"} <= names
    assert any(name.startswith("configs/") and name.endswith(".yaml") for name in names)


@pytest.mark.parametrize("path", scanned(), ids=lambda p: p.relative_to(REPO).as_posix())
def test_user_documents_speak_of_the_product_alone(path: Path) -> None:
    name = path.relative_to(REPO).as_posix()
    found = violations(path.read_text(encoding="utf-8"))
    assert not found, f"{name} speaks of how rollmatch is developed, not of the product:\n" + "\n".join(
        f"  {name}:{line}: {what} ({excerpt!r}) — fix: {fix}" for line, what, excerpt, fix in found
    )
