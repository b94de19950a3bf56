"""Every repository path that README.md and docs/ARCHITECTURE.md name in backticks exists, so the map cannot
point at a file a move left behind (docs/ARCHITECTURE.md#tests).

A path is a backticked token that starts at one of the repository's folders (`learner/…`, `bench/…`, …);
`{a,b}` names several files, `*` any, and a module named without `.py` (`shared_schemas/__init__`) counts.
Paths relative to another folder (`colocate/vllm.py`) are not checked.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

DOCS = ("README.md", "docs/ARCHITECTURE.md")
"""The documents whose paths are checked."""

ROOTS = ("learner", "rollout_server", "shared_schemas", "bench", "scripts", "configs", "tests", "docs")
"""Top-level folders a checked path starts at."""

_PATH = re.compile(rf"(?<![\w./-])((?:{'|'.join(ROOTS)})/[\w./{{}},*-]*)")
_BRACES = re.compile(r"\{([^{}]*)\}")


def doc_paths(text: str) -> list[str]:
    """The repository paths inside the inline code spans of `text` (fenced blocks aside; a span may wrap onto
    the next line), in order."""
    text = re.sub(r"```.*?```", "", text, flags=re.DOTALL)
    return [path for span in re.findall(r"`([^`]+)`", text) for path in _PATH.findall(span)]


def expand(path: str) -> list[str]:
    """`a/{b,c}.py` → `a/b.py`, `a/c.py` (one brace group after another)."""
    match = _BRACES.search(path)
    if match is None:
        return [path]
    head, tail = path[: match.start()], path[match.end() :]
    return [out for part in match.group(1).split(",") for out in expand(head + part + tail)]


def exists(path: str) -> bool:
    """Whether `path` (globs allowed; a module may omit `.py`) names something in the repository."""
    path = path.rstrip(".,")
    return any(REPO.glob(path)) or any(REPO.glob(path + ".py"))


def test_the_check_can_fail() -> None:
    text = (
        "see `learner/{policy,no_such_module}.py` and `bench/launcher_utils.py\n--x`; `colocate/x.py`\n"
        "```\n`docs/fenced_off.md`\n```\n"
    )
    paths = [p for raw in doc_paths(text) for p in expand(raw)]
    assert paths == ["learner/policy.py", "learner/no_such_module.py", "bench/launcher_utils.py"]
    assert [exists(p) for p in paths] == [True, False, True]
    assert exists("rollout_server/engines/hf*.py") and exists("shared_schemas/__init__")


@pytest.mark.parametrize("doc", DOCS)
def test_every_named_path_exists(doc: str) -> None:
    raws = doc_paths((REPO / doc).read_text(encoding="utf-8"))
    assert raws, f"{doc} names no repository path: the pattern is broken"
    missing = sorted({p for raw in raws for p in expand(raw) if not exists(p)})
    assert not missing, f"{doc} names paths that do not exist (moved or renamed?): {', '.join(missing)}"
