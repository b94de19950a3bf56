"""The learner loop end to end against REAL rollout servers and a REAL colocated vLLM engine
(issue "Learner loop").

Every run is assembled by `learner.trainers.build.build_run` (the code path of `python -m learner`) on the
tiny Qwen2 model in float32 with the synthetic detection set, and its `RolloutSource` instance is instrumented
(infer / sync calls recorded) — nothing stands in for vLLM or the server.

1. 1 server vs 2 servers vs colocate (vLLM in-process): identical rollouts and identical first-step losses.
2. One training step advances the server's `weight_version` exactly once; after the next step's sync the
   server's greedy answers (tokens and logprobs) equal the trained model's own HF greedy answers.
3. `stage2.rollout_buffer {enabled, m_steps: 3}`: one sync and one `/infer/` round per 3 optimizer steps
   (4 steps: syncs and rollouts at steps 0 and 3 only).
4. Adapter sync against a LoRA-less server falls back to full once and stays full.
5. A server killed mid-run makes the next rollout fail fast, naming the server.
6. Checkpoint + resume continues with no sample skipped or repeated (sample ids compared).
7. Guard cases are refused with one line naming the key (`python -m learner` exits 2, or `ConfigError`).

Engines: the session's shared seed-0 vLLM server (`tests/integration/conftest.py::vllm_server`; tests that
change its weights restore them), one in-process vLLM engine (started and closed inside `colocate_step`,
which runs before the shared server is first needed when this module runs alone), and cheap HF-backend
servers for the kill test. The second server of test 1 is a vLLM server (the acceptance setting: two vLLM
servers at once: the session's seed-1 server, `vllm_server_seed1`, whose weights the run's step-0 sync
replaces and the test restores) unless `ROLLMATCH_LOOP_SECOND_SERVER=hf` (hosts that must not run two vLLM
engines at once; the HF engine's float32 greedy tokens are the same, so the comparison stays exact).
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from transformers import AutoModelForCausalLM

from learner.config import ConfigError, RunConfig
from learner.rollout.colocate import ColocateRolloutSource
from learner.rollout.colocate.hf import HfColocateBackend
from learner.rollout.server_source import InferFailed, ServerRolloutSource
from learner.trainers.build import RunParts, build_run
from learner.weights.sync import SyncConfig, WeightSyncPolicy
from learner.weights.types import WeightUpdate
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig
from tests.integration.learner_fixtures import (  # noqa: F401 - fixtures
    REPO,
    demo_data_fixture,
    run_config,
    start_server,
)
from tests.integration.vllm_helpers import checkpoint_tensors, sync_full

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

SECOND_SERVER_BACKEND = os.environ.get("ROLLMATCH_LOOP_SECOND_SERVER", "vllm")
COLOCATE_VLLM = {
    "max_model_len": 256,
    "dtype": "float32",
    "enforce_eager": True,
    "kv_cache_space_gb": 1,
    "load_format": "dummy",  # real weights arrive only through the step-0 in-process sync
}


# -- fixtures ------------------------------------------------------------------------------------------------
def served_version(server: Any) -> int:
    """The weight version a server reports on `/health` (one new version per applied sync)."""
    return int(server.health()["weight_version"])


@pytest.fixture()
def restores_seed0(vllm_server: Any, tiny_model_dir: Path) -> Iterator[None]:
    """After the test, the shared server serves the seed-0 checkpoint weights again (conftest's contract)."""
    before = served_version(vllm_server)
    yield
    if served_version(vllm_server) != before:
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        with ServerRolloutSource([vllm_server.base_url], timeout_s=60) as source:
            WeightSyncPolicy(SyncConfig()).maybe_sync(model, 0, source)


@dataclass
class Recorded:
    """A built run whose `RolloutSource` instance records what the trainer asked of it."""

    parts: RunParts
    rollouts: list[list[Any]] = field(default_factory=list)
    """Results of each `infer` call."""
    syncs: list[tuple[int, str, int]] = field(default_factory=list)
    """`(global_step, mode, version)` of each `sync_weights` attempt (failed ones included)."""
    http_calls: int = 0
    """HTTP `/infer/` calls (server sources: first tries, retries and split halves)."""
    before_infer: Any = None
    """Optional hook run before each `infer` with the call number (1-based)."""

    @property
    def trainer(self) -> Any:
        return self.parts.trainer

    @property
    def source(self) -> Any:
        return self.parts.source

    def close(self) -> None:
        self.parts.source.close()


def build_recorded(cfg: RunConfig) -> Recorded:
    parts = build_run(cfg)
    rec = Recorded(parts)
    source = parts.source
    infer, sync = source.infer, source.sync_weights

    def recording_infer(batch: InferBatch) -> list[Any]:
        if rec.before_infer is not None:
            rec.before_infer(len(rec.rollouts) + 1)
        results = infer(batch)
        rec.rollouts.append(results)
        last = getattr(source, "last_infer", None)
        rec.http_calls += last.calls if last is not None else 0
        return results

    def recording_sync(update: WeightUpdate) -> Any:
        rec.syncs.append((parts.trainer.state.global_step, update.mode, update.version))
        return sync(update)

    source.infer = recording_infer  # instance attributes: the planner and the policy call these
    source.sync_weights = recording_sync
    return rec


def signature(rollouts: list[list[Any]]) -> list[tuple[Any, ...]]:
    """What must be identical between backends: request id, prompt ids, tokens, finish reason."""
    return [
        (r.request_id, tuple(r.prompt_token_ids), tuple(r.choices[0].token_ids), r.choices[0].finish_reason)
        for results in rollouts
        for r in results
    ]


def logged_first_step(cfg: RunConfig) -> tuple[list[tuple[Any, ...]], dict[str, Any]]:
    """Trains one step of 4 samples; returns the rollout signature and the step's logged metrics."""
    rec = build_recorded(cfg.model_copy(update={"training": {**cfg.training, "max_steps": 1}}))
    try:
        rec.trainer.train()
    finally:
        rec.close()
    logged = next(entry for entry in rec.trainer.state.log_history if "loss" in entry)
    assert len(rec.rollouts) == 1 and len(rec.rollouts[0]) == 4
    return signature(rec.rollouts), logged


def first_step(cfg: RunConfig) -> tuple[list[tuple[Any, ...]], float, float]:
    """Trains one step; returns the rollout signature, the logged loss and `loss/total`."""
    rollouts, logged = logged_first_step(cfg)
    return rollouts, logged["loss"], logged["loss/total"]


def server_cfg(model_dir: Path, data: Path, out: Path, servers: list[Any], **sections: Any) -> RunConfig:
    rollout = {"backend": "vllm", "mode": "server", "servers": [{"base_url": s.base_url} for s in servers]}
    return run_config(
        model_dir, data, out, **{**sections, "rollout": {**rollout, **sections.get("rollout", {})}}
    )


@pytest.fixture(scope="module")
def colocate_step(
    tiny_model_dir: Path, demo_data: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[tuple[Any, ...]], float, float]:
    """Rollouts and first-step loss through the colocated in-process vLLM engine (started and closed here).

    Requested before `one_server_step` by the test that compares them, so that when this module runs alone no
    vLLM server is up while the in-process engine runs (one engine at a time on small hosts).
    """
    cfg = run_config(
        tiny_model_dir,
        demo_data,
        tmp_path_factory.mktemp("colocate"),
        rollout={"backend": "vllm", "mode": "colocate", "vllm": COLOCATE_VLLM},
    )
    rec = build_recorded(cfg)
    try:
        assert rec.source.endpoints == ("colocate:vllm",)
        rec.trainer.train()
        report = rec.trainer.weight_sync.last_report
        # load_format dummy: only the in-process step-0 sync makes the engine serve the checkpoint's weights.
        assert report is not None and report.transport == "in_process" and report.bytes > 0
        assert rec.source.health().weight_version == 1
    finally:
        rec.close()
    logged = next(entry for entry in rec.trainer.state.log_history if "loss" in entry)
    assert len(rec.rollouts) == 1 and len(rec.rollouts[0]) == 4
    return signature(rec.rollouts), logged["loss"], logged["loss/total"]


@pytest.fixture(scope="module")
def one_server_step(
    tiny_model_dir: Path, demo_data: Path, vllm_server: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[list[tuple[Any, ...]], float, float]:
    """Rollouts and first-step loss through ONE vLLM server (the session's shared seed-0 server).

    The run's only sync is step 0's (the checkpoint's own weights), so the server keeps serving seed 0.
    """
    out = tmp_path_factory.mktemp("one_server")
    return first_step(server_cfg(tiny_model_dir, demo_data, out, [vllm_server]))


# -- 1. 1 server vs 2 servers vs colocate --------------------------------------------------------------------
def test_colocate_vllm_matches_one_server(colocate_step, one_server_step):
    # Argument order matters: the in-process engine runs (and is closed) before the server is needed.
    rollouts, loss, loss_total = one_server_step
    assert len({sig[2] for sig in rollouts}) > 1  # diverse rollouts: the comparison can fail
    assert colocate_step[0] == rollouts
    assert colocate_step[1:] == (loss, loss_total)


def test_two_servers_match_one_server(
    tiny_model_dir, tiny_model_dir_seed1, demo_data, vllm_server, one_server_step, tmp_path, request
):
    rollouts, loss, loss_total = one_server_step
    assert len({sig[2] for sig in rollouts}) >= 1 and all(len(sig[2]) >= 1 for sig in rollouts)
    if SECOND_SERVER_BACKEND == "vllm":
        # The session's seed-1 vLLM server (LoRA on: it serves base weights bit-identically to a LoRA-less
        # engine): the run's step-0 sync puts the checkpoint's seed-0 weights on it; its own come back after.
        second = request.getfixturevalue("vllm_server_seed1")
    else:
        second = start_server(tiny_model_dir, tmp_path / "second", backend=SECOND_SERVER_BACKEND)
    try:
        cfg = server_cfg(tiny_model_dir, demo_data, tmp_path / "run", [vllm_server, second])
        rollouts2, loss2, loss_total2 = first_step(cfg)
        # Both servers received the step-0 sync and served half of the requests each.
        assert served_version(second) >= 1
    finally:
        if SECOND_SERVER_BACKEND == "vllm":
            sync_full(second.base_url, checkpoint_tensors(tiny_model_dir_seed1), served_version(second) + 1)
        else:
            second.stop()
    assert rollouts2 == rollouts
    assert (loss2, loss_total2) == (loss, loss_total)


# -- 2. one step → one sync; the server then answers like the trained model ----------------------------------
def test_one_step_syncs_once_and_server_answers_like_trained_model(
    tiny_model_dir, demo_data, vllm_server, tiny_tokenizer, tmp_path, restores_seed0
):
    cfg = server_cfg(tiny_model_dir, demo_data, tmp_path / "run", [vllm_server])
    before = served_version(vllm_server)
    rec = build_recorded(cfg)
    try:
        rec.trainer.train()
        assert rec.trainer.state.global_step == 1
        assert served_version(vllm_server) == before + 1
        assert [(step, mode) for step, mode, _ in rec.syncs] == [(0, "full")]

        trained = rec.trainer.model
        # The next step's lazy sync (what step 1's first rollout would trigger) brings the trained weights.
        rec.trainer.weight_sync.maybe_sync(trained, rec.trainer.state.global_step, rec.source)
        assert served_version(vllm_server) == before + 2
        samples = [rec.trainer.train_dataset[i] for i in range(4)]
        ctx = rec.trainer.planner.ctx
        batch = InferBatch(
            infer_requests=[
                InferRequest(messages=ctx.rollout_messages(s), request_id=f"q{i}")
                for i, s in enumerate(samples)
            ],
            request_config=RequestConfig(max_tokens=16, temperature=0.0, logprobs=True),
            seeds=[11, 12, 13, 14],
        )
        served = rec.source.infer(batch)
        own = ColocateRolloutSource(HfColocateBackend(trained, tiny_tokenizer, batch_size=4)).infer(batch)
        initial_model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        initial = ColocateRolloutSource(HfColocateBackend(initial_model, tiny_tokenizer, batch_size=4)).infer(
            batch
        )
    finally:
        rec.close()
    for s, o in zip(served, own, strict=True):
        assert s.prompt_token_ids == o.prompt_token_ids
        assert s.choices[0].token_ids == o.choices[0].token_ids
        assert torch.allclose(
            torch.tensor(s.choices[0].logprobs), torch.tensor(o.choices[0].logprobs), atol=1e-3
        )
    # The comparison can fail: the step moved the weights enough to move the logprobs.
    gaps = [
        (torch.tensor(s.choices[0].logprobs[:1]) - torch.tensor(i.choices[0].logprobs[:1])).abs().max().item()
        for s, i in zip(served, initial, strict=True)
    ]
    assert max(gaps) > 1e-2


# -- 3. rollout buffer: one sync and one /infer/ round per window --------------------------------------------
def test_rollout_buffer_syncs_and_infers_once_per_window(
    tiny_model_dir, demo_data, vllm_server, tmp_path, restores_seed0
):
    cfg = server_cfg(
        tiny_model_dir,
        demo_data,
        tmp_path / "run",
        [vllm_server],
        training={"max_steps": 4},
        stage2={"rollout_buffer": {"enabled": True, "m_steps": 3}},
    )
    before = served_version(vllm_server)
    rec = build_recorded(cfg)
    try:
        rec.trainer.train()
    finally:
        rec.close()
    assert rec.trainer.state.global_step == 4
    assert [step for step, _, _ in rec.syncs] == [0, 3]
    assert len(rec.rollouts) == 2 and rec.http_calls == 2
    assert served_version(vllm_server) == before + 2
    # Steps 1 and 2 are M-steps replaying step 0's rollouts; step 3 opens the next window with an E-step.
    reuse = [entry.get("rollout/buffer_reuse") for entry in rec.trainer.state.log_history if "loss" in entry]
    assert reuse == [0.0, 1.0, 1.0, 0.0]


# -- 4. adapter sync against a LoRA-less server --------------------------------------------------------------
def test_adapter_sync_falls_back_to_full_once(
    tiny_model_dir, demo_data, vllm_server, tmp_path, caplog, restores_seed0
):
    cfg = server_cfg(
        tiny_model_dir,
        demo_data,
        tmp_path / "run",
        [vllm_server],
        model={"adapter": "lora", "lora_r": 4, "lora_alpha": 8},
        rollout={"sync": {"mode": "adapter", "fallback_to_full": True}},
        training={"max_steps": 3},
    )
    before = served_version(vllm_server)
    rec = build_recorded(cfg)
    with caplog.at_level(logging.WARNING, logger="learner.weights.sync"):
        try:
            rec.trainer.train()
        finally:
            rec.close()
    assert [(step, mode) for step, mode, _ in rec.syncs] == [
        (0, "adapter"),
        (0, "full"),
        (1, "full"),
        (2, "full"),
    ]
    assert rec.trainer.weight_sync.mode == "full"
    versions = [version for _, _, version in rec.syncs]
    assert versions == list(range(before + 1, before + 5))
    assert served_version(vllm_server) == versions[-1]  # served: the last full sync
    assert len([r for r in caplog.records if "falling back to full" in r.getMessage()]) == 1
    # After the fallback no request names the adapter (the server has none).
    assert rec.trainer.weight_sync.request_adapter is None


# -- 5. a server killed mid-run ------------------------------------------------------------------------------
def train_until_server_killed(
    model_dir: Path, data: Path, tmp: Path, *, kill_at_call: int, **rollout: Any
) -> tuple[Recorded, str, pytest.ExceptionInfo[InferFailed], float]:
    """Trains 3 steps against a fresh HF-backend server that is SIGKILLed right before `infer` call
    `kill_at_call`; returns the run, the server's URL, the raised `InferFailed` and seconds from kill to
    raise."""
    server = start_server(model_dir, tmp / "hf_server", backend="hf")
    try:
        cfg = server_cfg(
            model_dir,
            data,
            tmp / "run",
            [server],
            rollout={"infer_timeout_s": 20, "timeout_s": 20, **rollout},
            training={"max_steps": 3},
        )
        rec = build_recorded(cfg)
        killed_at: list[float] = []

        def kill(call: int) -> None:
            if call == kill_at_call:
                server.kill()
                killed_at.append(time.monotonic())

        rec.before_infer = kill
        try:
            with pytest.raises(InferFailed) as info:
                rec.trainer.train()
            failed_after = time.monotonic() - killed_at[0]
        finally:
            rec.close()
    finally:
        server.stop()
    return rec, server.base_url, info, failed_after


def test_killed_server_fails_next_rollout_fast_naming_it(tiny_model_dir, demo_data, tmp_path):
    # Call 2 comes after step 1's sync went through: the rollout is the first call to a dead server.
    rec, url, info, failed_after = train_until_server_killed(
        tiny_model_dir, demo_data, tmp_path, kill_at_call=2
    )
    assert failed_after < 20
    assert url in str(info.value)
    assert len(rec.rollouts) == 1 and rec.trainer.state.global_step == 1


# -- 6. checkpoint + resume ----------------------------------------------------------------------------------
def _sample_ids(rec: Recorded) -> list[list[int]]:
    return [[int(r.request_id.split(":")[0]) for r in results] for results in rec.rollouts]


def test_resume_from_checkpoint_skips_and_repeats_no_sample(tiny_model_dir, demo_data, tmp_path):
    # The rollout source plays no part in the data order: the in-process HF backend keeps this test cheap.
    training = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}
    full = build_recorded(run_config(tiny_model_dir, demo_data, tmp_path / "full", training=training))
    try:
        full.trainer.train()
    finally:
        full.close()
    steps = _sample_ids(full)
    flat = [i for step in steps for i in step]
    assert len(steps) == 4 and len(flat) == len(set(flat)) == 16
    dataset = full.trainer.train_dataset
    assert flat == [dataset[i]["sample_id"] for i in range(16)]

    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed = build_recorded(run_config(tiny_model_dir, demo_data, tmp_path / "resumed", training=training))
    try:
        resumed.trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        resumed.close()
    assert resumed.trainer.state.global_step == 4
    assert _sample_ids(resumed) == steps[2:]
    # The resumed steps see the same rollouts as the uninterrupted run (weights restored from the checkpoint).
    assert signature(resumed.rollouts) == signature(full.rollouts[2:])


# -- 7. guards -----------------------------------------------------------------------------------------------
def _cli_config(tmp: Path, name: str, cfg: RunConfig, **raw: Any) -> Path:
    tree = cfg.model_dump(mode="json", exclude_none=True)
    for section, values in raw.items():
        tree[section] = {**tree.get(section, {}), **values}
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(tree))
    return path


def test_cli_refuses_guard_cases_with_one_line_naming_the_key(tiny_model_dir, demo_data, tmp_path):
    base = run_config(tiny_model_dir, demo_data, tmp_path / "out")
    stage2 = base.model_dump(mode="json")["stage2"]
    rollout = base.model_dump(mode="json", exclude_none=True)["rollout"]
    cases = {
        "stage2.packing.drop_last": _cli_config(
            tmp_path, "drop_last", base, stage2={**stage2, "packing": {"enabled": True, "drop_last": False}}
        ),
        "rollout.vllm.tensor_parallel_size": _cli_config(
            tmp_path,
            "tp",
            base,
            rollout={**rollout, "backend": "vllm", "vllm": {**COLOCATE_VLLM, "tensor_parallel_size": 2}},
        ),
        "rollout.vllm.max_model_len": _cli_config(
            tmp_path, "max_len", base, rollout={**rollout, "vllm": {"max_model_len": 64}}
        ),
    }
    broken = tmp_path / "broken.jsonl"  # a data error is one line too, naming file and line
    broken.write_text(Path(base.data.train[0]).read_text().splitlines()[0] + "\n{not json\n")
    data = base.model_dump(mode="json")["data"]
    cases["broken.jsonl:2: invalid JSON"] = _cli_config(
        tmp_path, "data", base, data={**data, "train": [str(broken)]}
    )
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    procs = {
        key: subprocess.Popen(
            [sys.executable, "-m", "learner", "--config", str(path)],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for key, path in cases.items()
    }
    for key, proc in procs.items():
        _, stderr = proc.communicate(timeout=240)
        errors = [line for line in stderr.splitlines() if line.startswith(("config error:", "data error:"))]
        assert proc.returncode == 2, f"{key}: exit {proc.returncode}\n{stderr[-2000:]}"
        assert len(errors) == 1 and key in errors[0], f"{key}: {stderr[-2000:]}"


def test_server_guards_name_the_key(tiny_model_dir, demo_data, vllm_server, tmp_path):
    limit = int(vllm_server.health()["max_model_len"])
    too_long = server_cfg(
        tiny_model_dir,
        demo_data,
        tmp_path / "a",
        [vllm_server],
        rollout={"decoding": {"max_new_tokens": limit - 8}},
    )
    with pytest.raises(ConfigError, match=rf"server\.vllm\.max_model_len {limit} < longest prompt \d+ \+ "):
        build_run(too_long)
    no_fallback = server_cfg(
        tiny_model_dir,
        demo_data,
        tmp_path / "b",
        [vllm_server],
        model={"adapter": "lora", "lora_r": 4},
        rollout={"sync": {"mode": "adapter", "fallback_to_full": False}},
    )
    with pytest.raises(ConfigError, match=r"rollout\.sync\.fallback_to_full") as info:
        build_run(no_fallback)
    assert "\n" not in str(info.value)
