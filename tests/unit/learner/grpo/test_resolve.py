"""Config resolver CLI and the launchers' KEY=VALUE reader (docs/ALGORITHM.md#grpo-rules, §6, §8)."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from learner.grpo.resolve import format_env, main, read_resolved
from tests.unit.learner.grpo.grpo_examples import REPO_ROOT, SERVER_PRESET

READER_SH = REPO_ROOT / "learner" / "grpo" / "read_resolved.sh"
NOISE = [
    "WARNING: some library printed this",
    "INFO 11-21 12:00:00 [__init__.py:42] Automatically detected platform cpu.",
    "lower_case=ignored",
    " SERVER_PORT=1  # leading space: not a KEY=VALUE line",
    "PATH=$(touch /tmp/pwned) two words",
    "",
]


def _config(tmp_path: Path, model_dir: Path, extra: str = "") -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(
        f"extends: {SERVER_PRESET}\nmodel: {{path: {model_dir}}}\nserver: {{model: {model_dir}}}\n{extra}"
    )
    return path


def test_resolver_prints_the_launcher_variables(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["--config", str(_config(tmp_path, model_dir))]) == 0
    env = read_resolved(capsys.readouterr().out)
    assert env["SERVER_HOST"] == "127.0.0.1" and env["SERVER_PORT"] == "8080"
    assert env["SERVER_GPUS"] == "0,1,2,3,4,5" and env["TRAIN_GPUS"] == "6,7" and env["NPROC"] == "2"
    assert (env["SERVER_TP"], env["SERVER_DP"]) == ("1", "6")
    assert env["MODEL_PATH"] == env["SERVER_MODEL"] == str(model_dir.resolve())
    assert env["SERVER_BASE_URL"] == "http://127.0.0.1:8080"
    assert env["ROLLOUT_TIMEOUT_S"] == "300" and env["EFFECTIVE_BATCH_SIZE"] == "32"
    assert env["LOG_DIR"].endswith("runs/grpo_summary_1024_server/rollout_server")


def test_flags_override_the_yaml(tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    config = str(_config(tmp_path, model_dir))
    assert main(["--config", config, "--port", "9100", "--server-gpus", "0,1,2,3,4,5"]) == 0
    env = read_resolved(capsys.readouterr().out)
    assert env["SERVER_PORT"] == "9100" and env["SERVER_BASE_URL"] == "http://127.0.0.1:9100"
    assert main(["--config", config, "--train-gpus", "5,6"]) == 2
    assert "train_gpus" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("extra", "rule"),
    [
        ("server: {host: 0.0.0.0}\n", "rule 2"),
        ("server: {port: 70000}\n", "rule 3"),
        ("server: {vllm: {enable_lora: true}}\n", "rule 6"),
    ],
)
def test_invalid_config_exits_2_naming_the_rule(
    tmp_path: Path, model_dir: Path, capsys: pytest.CaptureFixture[str], extra: str, rule: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(f"extends: {_config(tmp_path, model_dir)}\n{extra}")
    assert main(["--config", str(path)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert rule in captured.err and captured.err.count("\n") == 1


def test_missing_file_exits_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--config", str(tmp_path / "nope.yaml")]) == 2
    assert "not found" in capsys.readouterr().err


def test_module_entry_point_runs(tmp_path: Path, model_dir: Path) -> None:
    inherited = os.environ.get("PYTHONPATH")  # kept: dependencies may live on it (the device machines)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), inherited]))}
    cmd = [sys.executable, "-m", "learner.grpo.resolve", "--config", str(_config(tmp_path, model_dir))]
    ok = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert read_resolved(ok.stdout)["NPROC"] == "2"
    bad = subprocess.run(
        [*cmd, "--port", "70000"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=60
    )
    assert bad.returncode == 2 and "server.port" in bad.stderr


VALUES = {"SERVER_HOST": "127.0.0.1", "MODEL_PATH": "/models/it's a dir", "EMPTY": "", "NPROC": "2"}


def test_python_reader_ignores_noise_lines() -> None:
    text = "\n".join([NOISE[0], *format_env(VALUES).splitlines(), *NOISE[1:]])
    assert read_resolved(text) == VALUES


def test_shell_reader_ignores_noise_lines(tmp_path: Path) -> None:
    text = "\n".join([NOISE[0], *format_env(VALUES).splitlines(), *NOISE[1:]])
    script = (
        f"source {shlex.quote(str(READER_SH))}\n"
        "declare -A CFG\n"
        "read_resolved CFG\n"
        'for k in "${!CFG[@]}"; do printf "%s\\t%s\\n" "$k" "${CFG[$k]}"; done\n'
    )
    out = subprocess.run(
        ["bash", "-c", script], input=text, capture_output=True, text=True, timeout=30, cwd=tmp_path
    )
    assert out.returncode == 0, out.stderr
    parsed = dict(line.split("\t", 1) for line in out.stdout.splitlines())
    assert parsed == VALUES
    assert not (tmp_path / "pwned").exists() and not Path("/tmp/pwned").exists()
