"""`make lint` holds on the whole tree: ruff's rules (E501 at 110 columns included) and its formatter, so the
style the repository keeps cannot drift between lint runs (CI runs the tests, not `make lint`)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("command", [["check", "."], ["format", "--check", "."]], ids=["check", "format"])
def test_ruff_is_clean(command: list[str]) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ruff", *command], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    output = result.stdout[-4000:] + result.stderr
    assert result.returncode == 0, f"ruff {' '.join(command)} (make lint) fails; fix these:\n{output}"
