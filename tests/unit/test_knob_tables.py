"""docs/RUNBOOK.md's knob tables are the generator's output (scripts/gen_knob_tables.py), so they cannot
drift."""

from __future__ import annotations

from pathlib import Path

import pytest
from gen_knob_tables import BEGIN_MARKER, END_MARKER, main, render_all, replace_block

from learner.config import RunConfig
from rollout_server.config import ServerConfig

REPO = Path(__file__).resolve().parents[2]
RUNBOOK = REPO / "docs" / "RUNBOOK.md"


@pytest.fixture(scope="module")
def tables() -> str:
    return render_all()


def _leaf_keys(model: type, prefix: str) -> set[str]:
    from gen_knob_tables import iter_sections

    return {row.key for section in iter_sections(model, prefix) for row in section.rows}


def test_runbook_block_is_current(tables: str) -> None:
    text = RUNBOOK.read_text(encoding="utf-8")
    assert replace_block(text, tables) == text, (
        "docs/RUNBOOK.md knob tables are stale: python scripts/gen_knob_tables.py --write docs/RUNBOOK.md"
    )
    assert main(["--check", str(RUNBOOK)]) == 0


def test_every_knob_has_a_row_with_its_default(tables: str) -> None:
    keys = _leaf_keys(RunConfig, "") | _leaf_keys(ServerConfig, "server")
    for key in keys:
        assert f"| `{key}` |" in tables, key
    # Spot-check defaults against the spec tables (docs/ALGORITHM.md#packing §14.1, §16;
    # docs/ALGORITHM.md#grpo-config GRPO §2.2 / server config).
    assert "| `rollout.vllm.gpu_memory_utilization` | float (> 0.0, ≤ 1.0) | `0.45` |" in tables
    assert "| `stage2.packing.packing_buffer` | int (≥ 1) | `512` |" in tables
    assert "| `server.host` | str | `127.0.0.1` |" in tables
    assert "| `model.path` | str | **required** |" in tables


def test_check_detects_drift(tmp_path: Path, tables: str) -> None:
    stale = tmp_path / "RUNBOOK.md"
    stale.write_text(f"# x\n{BEGIN_MARKER}\n| old | table |\n{END_MARKER}\n", encoding="utf-8")
    assert main(["--check", str(stale)]) == 1
    assert main(["--write", str(stale)]) == 0
    assert main(["--check", str(stale)]) == 0
    assert tables in stale.read_text(encoding="utf-8")
    no_markers = tmp_path / "plain.md"
    no_markers.write_text("# nothing generated here\n", encoding="utf-8")
    assert main(["--check", str(no_markers)]) == 2
