"""``server:`` has one schema (issue 36 item 1): a GRPO run validates it with the server's own
``ServerConfig``, so the resolver and the server process read the same values from the same file — the
defaults included (``data_parallel_size`` 1, ``max_model_len`` 8192, ``port`` 8000: the ones the server runs
with; GRPO's old copy said 6, 12000 and 8080)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from learner.grpo.config import ConfigError, validate_grpo_run
from learner.grpo.resolve import main, read_resolved
from rollout_server.__main__ import launch_env
from shared_schemas.config import REPO_ROOT
from shared_schemas.server_config import ServerConfig, load_server_config


def _omit_engine_defaults(raw: dict[str, Any]) -> dict[str, Any]:
    """The default preset on one rollout GPU, with ``server.port``, ``server.vllm.data_parallel_size`` and
    ``server.vllm.max_model_len`` left to their defaults (and a length budget that fits the default)."""
    del (
        raw["server"]["port"],
        raw["server"]["vllm"]["data_parallel_size"],
        raw["server"]["vllm"]["max_model_len"],
    )
    del raw["batch_plan"]["server_dp"], raw["batch_plan"]["server_gpus"]
    raw["server"]["gpus"] = [0]
    raw["grpo"]["global_max_length"] = 8192
    raw["rollout"]["servers"] = [{"base_url": "http://127.0.0.1:8000"}]
    return raw


def test_omitted_engine_knobs_resolve_to_what_the_server_runs(
    server_raw: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(_omit_engine_defaults(server_raw)), encoding="utf-8")
    run = validate_grpo_run(yaml.safe_load(config.read_text(encoding="utf-8")), REPO_ROOT)
    served = load_server_config(config)  # what `python -m rollout_server --config run.yaml` validates
    assert isinstance(run.server, ServerConfig)
    assert run.server == served  # every value, the defaults included (server.model is absolute in both)
    assert (run.server.port, run.server.vllm.data_parallel_size, run.server.vllm.max_model_len) == (
        8000,
        1,
        8192,
    )

    assert main(["--config", str(config)]) == 0
    grpo_env = read_resolved(capsys.readouterr().out)
    server_env = launch_env(served)  # what start_rollout_server.sh reads
    assert (
        (grpo_env["SERVER_DP"], grpo_env["SERVER_TP"]) == (server_env["DP"], server_env["TP"]) == ("1", "1")
    )
    assert (grpo_env["SERVER_GPUS"], grpo_env["SERVER_PORT"]) == (server_env["GPUS"], server_env["PORT"])


def test_rule_5_checks_the_length_the_server_runs(server_raw: dict[str, Any]) -> None:
    """Without ``server.vllm.max_model_len`` the server runs 8192, so a 12000-token budget is refused."""
    raw = _omit_engine_defaults(server_raw)
    raw["grpo"]["global_max_length"] = 12000
    with pytest.raises(
        ConfigError, match=r"^server\.vllm\.max_model_len: 8192 < grpo\.global_max_length 12000"
    ):
        validate_grpo_run(raw, REPO_ROOT)


def test_six_gpus_without_data_parallel_size_fail_as_in_the_server(server_raw: dict[str, Any]) -> None:
    """DP defaults to 1, as in the server: six GPUs for one replica is the server's own TP x DP error."""
    raw = _omit_engine_defaults(server_raw)
    raw["server"]["gpus"] = [0, 1, 2, 3, 4, 5]
    with pytest.raises(ConfigError, match=r"^server\.gpus: .*data_parallel_size 1 = 1 .*§2\.3 rule 4\)"):
        validate_grpo_run(raw, REPO_ROOT)


def test_unset_server_gpus_are_refused(server_raw: dict[str, Any]) -> None:
    """The server leaves ``CUDA_VISIBLE_DEVICES`` alone without ``gpus`` (every GPU, the learner's too)."""
    raw = _omit_engine_defaults(server_raw)
    del raw["server"]["gpus"]
    with pytest.raises(ConfigError, match=r"^server\.gpus: is empty or unset .*rule 7\)"):
        validate_grpo_run(raw, REPO_ROOT)


def test_server_knob_outside_the_grpo_allow_list_is_named(server_raw: dict[str, Any]) -> None:
    server_raw["server"]["drain_timeout_s"] = 5.0  # a valid server knob, not in GRPO §2.2
    with pytest.raises(ConfigError, match=r"^server\.drain_timeout_s: not in the GRPO allow-list .*rule 9\)"):
        validate_grpo_run(server_raw, REPO_ROOT)
