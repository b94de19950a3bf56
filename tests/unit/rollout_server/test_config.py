"""Server config: YAML loading, `extends:`, validation messages, `__main__` exit codes
(docs/ARCHITECTURE.md#configuration)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from rollout_server.__main__ import main
from rollout_server.config import REPO_ROOT, ConfigError, ServerConfig, deep_merge, load_server_config

REPO = Path(__file__).resolve().parents[3]


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_tiny_cpu_config_loads() -> None:
    cfg = load_server_config(REPO / "configs" / "server_tiny_cpu.yaml")
    assert (cfg.backend, cfg.dtype, cfg.host) == ("vllm", "float32", "127.0.0.1")
    assert 1024 <= cfg.vllm.max_model_len <= 2048 and cfg.vllm.enforce_eager
    assert cfg.model_path == REPO_ROOT / ".cache" / "models" / "tiny-qwen2"


def test_defaults() -> None:
    cfg = ServerConfig(model="/m")
    assert (cfg.host, cfg.port, cfg.backend, cfg.gpus, cfg.auth_token, cfg.vllm.data_parallel_size) == (
        "127.0.0.1",
        8000,
        "vllm",
        None,
        None,
        1,
    )
    with pytest.raises(ValueError):
        cfg.port = 9  # type: ignore[misc]  # frozen


def test_extends_deep_merges_and_lists_replace(tmp_path: Path) -> None:
    write(
        tmp_path / "base.yaml",
        "server:\n  model: /m\n  port: 9001\n  vllm:\n    max_model_len: 4096\n"
        "    limit_mm_per_prompt: {image: 2}\n"
        "    engine_kwargs: {a: [1, 2]}\n",
    )
    child = write(
        tmp_path / "child.yaml",
        "extends: base.yaml\nserver:\n  vllm:\n    enforce_eager: true\n    engine_kwargs: {a: [3]}\n",
    )
    cfg = load_server_config(child)
    assert cfg.port == 9001 and cfg.vllm.max_model_len == 4096 and cfg.vllm.enforce_eager
    assert cfg.vllm.limit_mm_per_prompt == {"image": 2}
    assert cfg.vllm.engine_kwargs == {"a": [3]}


def test_deep_merge_is_pure() -> None:
    base = {"a": {"b": 1, "c": [1]}}
    assert deep_merge(base, {"a": {"c": [2]}}) == {"a": {"b": 1, "c": [2]}}
    assert base == {"a": {"b": 1, "c": [1]}}


def test_whole_run_yaml_reads_only_server_section(tmp_path: Path) -> None:
    run = write(
        tmp_path / "run.yaml",
        "model: {path: /learner/model}\ntraining: {learning_rate: 1.0e-5, bogus_learner_key: 1}\n"
        "rollout: {mode: server}\nserver:\n  model: /m\n  port: 8123\n",
    )
    cfg = load_server_config(run)
    assert cfg.port == 8123 and cfg.model == "/m"


def test_unknown_key_names_file_and_dotted_key(tmp_path: Path) -> None:
    parent = write(tmp_path / "parent.yaml", "server:\n  model: /m\n  vllm:\n    max_modle_len: 10\n")
    child = write(tmp_path / "child.yaml", "extends: parent.yaml\nserver:\n  port: 8001\n")
    with pytest.raises(ConfigError) as info:
        load_server_config(child)
    message = str(info.value)
    assert str(parent) in message and "server.vllm.max_modle_len" in message and "unknown key" in message


@pytest.mark.parametrize(
    ("yaml_text", "fragments"),
    [
        ("server: {model: /m, host: 0.0.0.0}", ["server.host", "allow_non_loopback"]),
        ("server: {model: /m, port: 70000}", ["server.port"]),
        ("server: {model: /m, gpus: '0,1', vllm: {data_parallel_size: 3}}", ["server.gpus", "= 3"]),
        ("server: {model: /m, backend: tgi}", ["server.backend"]),
        ("server: {port: 8000}", ["server.model", "missing"]),
        ("server: {model: /m, vllm: {gpu_memory_utilization: 1.5}}", ["server.vllm.gpu_memory_utilization"]),
        ("server: [1, 2]", ["must be a mapping"]),
        ("- a\n- b\n", ["must be a mapping"]),
        ("server: {model: /m\n", ["invalid YAML"]),
    ],
    ids=[
        "non-loopback",
        "port-range",
        "tp-dp-gpus",
        "backend",
        "missing-model",
        "gpu-util",
        "section-list",
        "doc-list",
        "bad-yaml",
    ],
)
def test_invalid_configs(tmp_path: Path, yaml_text: str, fragments: list[str]) -> None:
    path = write(tmp_path / "c.yaml", yaml_text)
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    for fragment in fragments:
        assert fragment in str(info.value)


def test_non_loopback_allowed_when_asked(tmp_path: Path) -> None:
    path = write(
        tmp_path / "c.yaml", "server: {model: /m, host: 0.0.0.0, allow_non_loopback: true, auth_token: t0k}"
    )
    assert load_server_config(path).host == "0.0.0.0"


def test_non_loopback_needs_a_token_or_the_explicit_opt_out(tmp_path: Path) -> None:
    """Anyone who reaches an open port could replace the served weights, so a non-loopback bind needs
    `auth_token`, or `allow_unauthenticated: true` (which the server then logs loudly at start)."""
    path = write(tmp_path / "c.yaml", "server: {model: /m, host: 0.0.0.0, allow_non_loopback: true}")
    with pytest.raises(ConfigError) as info:
        load_server_config(path)
    message = str(info.value)
    assert f"{path}: server.auth_token: server.host '0.0.0.0' is reachable from other hosts" in message
    assert "server.allow_unauthenticated: true" in message
    with pytest.raises(ConfigError, match="auth_token"):
        load_server_config(path, overrides={"auth_token": ""})  # an empty token is no token
    opted_out = load_server_config(path, overrides={"allow_unauthenticated": True})
    assert opted_out.unauthenticated_exposure
    assert not load_server_config(path, overrides={"auth_token": "t0k"}).unauthenticated_exposure
    assert not ServerConfig(model="/m", allow_unauthenticated=True).unauthenticated_exposure  # loopback


def test_unauthenticated_exposure_is_logged_at_start(caplog: pytest.LogCaptureFixture) -> None:
    from fastapi.testclient import TestClient

    from rollout_server.app import create_app
    from tests.unit.rollout_server.fakes import FakeEngine

    open_cfg = ServerConfig(model="/m", host="0.0.0.0", allow_non_loopback=True, allow_unauthenticated=True)
    with caplog.at_level("WARNING", logger="rollout_server.app"):
        with TestClient(create_app(open_cfg, engine=FakeEngine())):
            pass
    assert any("UNAUTHENTICATED" in r.getMessage() and "0.0.0.0" in r.getMessage() for r in caplog.records)
    caplog.clear()
    with TestClient(create_app(ServerConfig(model="/m"), engine=FakeEngine())):
        pass
    assert not any("UNAUTHENTICATED" in r.getMessage() for r in caplog.records)


def test_gpus_accept_string_int_list(tmp_path: Path) -> None:
    assert ServerConfig(model="/m", gpus="0,1", vllm={"data_parallel_size": 2}).gpus == (0, 1)
    assert ServerConfig(model="/m", gpus=3).gpus == (3,)
    assert ServerConfig(model="/m", gpus=[4, 5], vllm={"tensor_parallel_size": 2}).gpus == (4, 5)


def test_overrides_win_and_are_named(tmp_path: Path) -> None:
    path = write(tmp_path / "c.yaml", "server: {model: /m, port: 8000}")
    assert load_server_config(path, overrides={"port": 9100, "host": None}).port == 9100
    with pytest.raises(ConfigError, match="<command line>: server.host"):
        load_server_config(path, overrides={"host": "10.0.0.1"})


def test_extends_cycle_and_missing_file(tmp_path: Path) -> None:
    write(tmp_path / "a.yaml", "extends: b.yaml\n")
    write(tmp_path / "b.yaml", "extends: a.yaml\n")
    with pytest.raises(ConfigError, match="cycle"):
        load_server_config(tmp_path / "a.yaml")
    with pytest.raises(ConfigError, match="does not exist"):
        load_server_config(tmp_path / "nope.yaml")


def test_main_config_error_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "c.yaml", "server: {model: /m, bogus: 1}")
    assert main(["--config", str(path)]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "server.bogus" in err


def test_main_missing_model_dir_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = write(tmp_path / "c.yaml", f"server: {{model: {tmp_path / 'absent'}}}")
    assert main(["--config", str(path)]) == 2
    assert "not a local directory" in capsys.readouterr().err


def test_print_launch_env_subprocess(tmp_path: Path) -> None:
    (tmp_path / "model").mkdir()
    path = write(tmp_path / "c.yaml", f"server: {{model: {tmp_path / 'model'}, port: 8001}}")
    out = subprocess.run(
        [sys.executable, "-m", "rollout_server", "--config", str(path), "--print-launch-env", "--gpus", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    lines = dict(line.split("=", 1) for line in out.splitlines())
    assert lines["PORT"] == "8001" and lines["GPUS"] == "2" and lines["HOST"] == "127.0.0.1"
