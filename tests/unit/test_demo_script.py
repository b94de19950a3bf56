"""`scripts/demo.sh` config resolution: `--config` takes an absolute path or a repository-relative one, and
the run YAML it writes extends that file (checked with `--dry-run`, which writes the run YAML and starts
nothing)."""

from __future__ import annotations

import subprocess
from pathlib import Path

from learner.config import load_run_config
from rollout_server.config import load_server_config

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "scripts" / "demo.sh"


def dry_run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(SCRIPT), "--dry-run", *args], cwd=cwd, capture_output=True, text=True, timeout=120
    )


def test_absolute_config_path(tmp_path: Path) -> None:
    variant = tmp_path / "configs" / "variant.yaml"
    variant.parent.mkdir()
    variant.write_text(
        f"extends: {REPO / 'configs' / 'demo_tiny_cpu.yaml'}\noutput_dir: {tmp_path / 'run'}\n"
        "training: {max_steps: 7}\n"
    )
    result = dry_run("--config", str(variant), "--port", "18123", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    run_yaml = Path(result.stdout.strip().splitlines()[-1])
    assert run_yaml == tmp_path / "run" / "run.yaml"
    assert f'extends: "{variant}"' in run_yaml.read_text()
    run = load_run_config(run_yaml, overrides={"model": {"path": str(REPO)}})
    assert run.training["max_steps"] == 7
    assert [s.base_url for s in run.rollout.servers] == ["http://127.0.0.1:18123"]
    assert load_server_config(run_yaml).port == 18123


def test_missing_config_is_named(tmp_path: Path) -> None:
    result = dry_run("--config", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and f"config file {tmp_path / 'nope.yaml'} does not exist" in result.stderr
    relative = dry_run("--config", "configs/nope.yaml", cwd=tmp_path)
    assert relative.returncode == 2 and f"config file {REPO / 'configs' / 'nope.yaml'}" in relative.stderr
