"""`learner.demo_data.files.one_builder_at_a_time`: builders of one folder in several processes take turns, so
the second reuses the first's folder (the race that left a tiny model without its coordinate tokens)."""

from __future__ import annotations

import multiprocessing
from pathlib import Path

import pytest

from learner.demo_data import files
from learner.demo_data.files import one_builder_at_a_time


@one_builder_at_a_time
def _build(out_dir: Path, log: str) -> Path:
    """A builder as the tiny-model scripts write one: reuse a finished folder, else write a temporary one
    slowly and rename it into place."""
    import os
    import shutil
    import time

    with open(log, "a") as fh:
        fh.write(f"enter {os.getpid()}\n")
    if (out_dir / "done").exists():
        return out_dir
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    for i in range(5):
        (tmp / f"part{i}").write_text(str(i))
        time.sleep(0.05)
    (tmp / "done").write_text("")
    shutil.rmtree(out_dir, ignore_errors=True)
    tmp.rename(out_dir)
    with open(log, "a") as fh:
        fh.write(f"built {os.getpid()}\n")
    return out_dir


def test_concurrent_builders_take_turns(tmp_path: Path) -> None:
    out, log = tmp_path / "model", tmp_path / "log"
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_build, args=(out, str(log))) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    lines = log.read_text().split()
    assert lines.count("built") == 1 and lines.count("enter") == 3  # one build, two reuses
    assert sorted(q.name for q in out.iterdir()) == ["done", *(f"part{i}" for i in range(5))]


def test_a_held_lock_times_out_with_the_fix(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import fcntl

    monkeypatch.setattr(files, "BUILD_LOCK_TIMEOUT_S", 0.3)
    out = tmp_path / "model"
    with (tmp_path / "model.lock").open("w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        with pytest.raises(TimeoutError, match="model.lock held by another process"):
            _build(out, str(tmp_path / "log"))
