"""Overlapped rollouts (`rollout.async`, issue 13) end to end against a REAL vLLM rollout server.

Runs are assembled by `build_run` (the code path of `python -m learner`) on the tiny Qwen2 model, with the
`RolloutSource` instance instrumented (infer / sync calls recorded, as in `test_learner_loop`) and the
planner's `build` wrapped to record which sample ids each optimizer step trains on and the results it trains
them with.

1. async on, `max_staleness: 1`: the first step's loss equals a synchronous run's; every trained rollout lags
   its update by at most 1 step, computed per sample from the `weight_version` the server stamped on it and
   the versions the run's syncs made; every sample id is trained exactly as often (and at the same step) as in
   the synchronous run; steps 1.. train on background results (the overlap really happens).
2. With the E/M rollout buffer and post-rollout packing: the next E-step's window is requested during the
   M-step before it; the same sample ids per step as synchronously.
3. Resume from a checkpoint saved while a background request was outstanding: the resumed run requests that
   window again and trains exactly the remaining samples (none skipped or repeated).
4. A server killed during a background request fails the step that needed it with the synchronous run's error
   (`InferFailed` naming the server), fast, with no hang.
5. Two servers (vLLM + HF backend): the background requests are chunked over both like synchronous ones, every
   sync reaches both.
6. Two learner ranks (`scripts/start_learner.sh --nproc 2`, gloo): each rank requests its own windows in the
   background, rank 0 alone syncs, staleness stays within the bound on every rank; a server killed mid-run
   stops both ranks with an error naming it.

Engines: the session's shared seed-0 vLLM server (weights restored after each test) and cheap HF-backend
servers for the two-server and kill tests.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from typing import Any

import pytest
import yaml
from transformers import TrainerCallback

from learner.config import RunConfig
from learner.report import load_metrics
from tests.integration.learner_fixtures import (  # noqa: F401 - fixture
    EXIT_LOOP_RUNS,
    REPO,
    demo_data_fixture,
    exit_problems,
    start_learner_2rank,
    start_server,
)
from tests.integration.test_learner_loop import (  # noqa: F401 - fixtures
    Recorded,
    build_recorded,
    restores_seed0,
    served_version,
    server_cfg,
    signature,
    train_until_server_killed,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ASYNC = {"async": {"enabled": True, "max_staleness": 1}}


def run(
    cfg: RunConfig, *, resume: str | None = None, callbacks: list[Any] = ()
) -> tuple[Recorded, list[dict]]:
    """Trains `cfg`; returns the recorder and,
    per optimizer step that built micro-batches, what it trained on."""
    rec = build_recorded(cfg)
    trained: list[dict[str, Any]] = []
    planner = rec.trainer.planner
    build = planner.build

    def recording_build(raws, rollouts, *, global_step, metrics):
        trained.append(
            {
                "step": global_step,
                "ids": [int(s["sample_id"]) for raw in raws for s in raw],
                "versions": None if rollouts is None else [r.weight_version for r in rollouts.results],
                "staleness": None if rollouts is None else list(rollouts.staleness),
            }
        )
        return build(raws, rollouts, global_step=global_step, metrics=metrics)

    planner.build = recording_build
    for callback in callbacks:
        callback.trainer = rec.trainer
        rec.trainer.add_callback(callback)
    try:
        rec.trainer.train(resume_from_checkpoint=resume)
    finally:
        rec.close()
    return rec, trained


def losses(rec: Recorded) -> list[dict[str, Any]]:
    return [entry for entry in rec.trainer.state.log_history if "loss" in entry]


def check_staleness(rec: Recorded, trained: list[dict[str, Any]], bound: int) -> list[int]:
    """Per trained sample: step − the step whose sync made the version that generated it;
    all within `bound`."""
    synced_at = {version: step for step, _, version in rec.syncs}
    lags = []
    for entry in trained:
        for version in entry["versions"]:
            lag = entry["step"] - synced_at[version]
            assert 0 <= lag <= bound, (entry["step"], version, synced_at)
            lags.append(lag)
    return lags


# -- 1. first-step loss, staleness bound, sample ids ---------------------------------------------------------
@pytest.mark.usefixtures("restores_seed0")
def test_async_matches_sync_first_step_and_trains_every_sample_as_often(
    tiny_model_dir, demo_data, vllm_server, tmp_path
):
    training = {"max_steps": 4}
    sync, sync_trained = run(
        server_cfg(tiny_model_dir, demo_data, tmp_path / "sync", [vllm_server], training=training)
    )
    overlapped, async_trained = run(
        server_cfg(
            tiny_model_dir, demo_data, tmp_path / "async", [vllm_server], training=training, rollout=ASYNC
        )
    )
    assert overlapped.trainer.state.global_step == 4
    # Step 0 has nothing requested ahead: the same sync, the same rollouts, hence the same loss.
    assert losses(overlapped)[0]["loss"] == losses(sync)[0]["loss"]
    assert losses(overlapped)[0]["loss/total"] == losses(sync)[0]["loss/total"]
    # The same windows at the same steps (seeds of the training step): every sample id as often.
    assert [(e["step"], e["ids"]) for e in async_trained] == [(e["step"], e["ids"]) for e in sync_trained]
    assert sorted(i for e in async_trained for i in e["ids"]) == sorted(
        i for e in sync_trained for i in e["ids"]
    )
    # Staleness per sample, from the server's stamps and the run's own syncs: within the bound, and 1
    # from step 1 on (trained on rollouts generated while the previous step trained).
    assert check_staleness(sync, sync_trained, 0) == [0] * 16
    lags = check_staleness(overlapped, async_trained, 1)
    assert lags == [0] * 4 + [1] * 12
    assert [e["staleness"] for e in async_trained] == [[0] * 4] + [[1] * 4] * 3
    # Sync cadence: once per optimizer step, right after it, before the background request that needs it; the
    # last step (no later window to request) does not sync.
    assert [step for step, _, _ in overlapped.syncs] == [0, 1, 2]
    logged = losses(overlapped)
    assert [e["rollout/prefetched"] for e in logged] == [0.0, 4.0, 4.0, 4.0]
    assert [e["rollout/staleness_max"] for e in logged] == [0.0, 1.0, 1.0, 1.0]
    assert all(e["rollout/regenerated"] == 0.0 for e in logged)


# -- 2. E/M buffer + post-rollout packing --------------------------------------------------------------------
@pytest.mark.usefixtures("restores_seed0")
def test_async_with_rollout_buffer_and_packing_requests_next_e_step_during_m_step(
    tiny_model_dir, demo_data, vllm_server, tmp_path
):
    sections = {
        "training": {"max_steps": 4},
        "stage2": {
            "rollout_buffer": {"enabled": True, "m_steps": 2},
            "packing": {"enabled": True, "packing_length": 1024, "packing_buffer": 8},
        },
    }
    sync, sync_trained = run(
        server_cfg(tiny_model_dir, demo_data, tmp_path / "sync", [vllm_server], **sections)
    )
    overlapped, async_trained = run(
        server_cfg(tiny_model_dir, demo_data, tmp_path / "async", [vllm_server], rollout=ASYNC, **sections)
    )
    # E-steps 0 and 2 build; M-steps 1 and 3 replay. The window of step 2 is requested during M-step 1, right
    # after step 1's sync (the synchronous run syncs at step 2 instead).
    assert [e["step"] for e in async_trained] == [e["step"] for e in sync_trained] == [0, 2]
    assert [e["ids"] for e in async_trained] == [e["ids"] for e in sync_trained]
    assert [step for step, _, _ in sync.syncs] == [0, 2]
    assert [step for step, _, _ in overlapped.syncs] == [0, 1]
    assert check_staleness(overlapped, async_trained, 1) == [0] * 4 + [1] * 4
    reuse = [e.get("rollout/buffer_reuse") for e in losses(overlapped)]
    assert reuse == [0.0, 1.0, 0.0, 1.0]
    assert losses(overlapped)[0]["loss"] == losses(sync)[0]["loss"]


@pytest.mark.usefixtures("restores_seed0")
def test_max_staleness_2_requests_the_next_e_step_two_steps_ahead(
    tiny_model_dir, demo_data, vllm_server, tmp_path
):
    sections = {"training": {"max_steps": 6}, "stage2": {"rollout_buffer": {"enabled": True, "m_steps": 3}}}
    rollout = {"async": {"enabled": True, "max_staleness": 2}}
    overlapped, trained = run(
        server_cfg(tiny_model_dir, demo_data, tmp_path / "async", [vllm_server], rollout=rollout, **sections)
    )
    # E-steps 0 and 3;
    # step 3's window is requested during M-step 1 (two steps ahead), right after step 1's sync.
    assert [e["step"] for e in trained] == [0, 3]
    assert [step for step, _, _ in overlapped.syncs] == [0, 1]
    assert check_staleness(overlapped, trained, 2) == [0] * 4 + [2] * 4
    assert [e.get("rollout/buffer_reuse") for e in losses(overlapped)] == [0.0, 1.0, 1.0, 0.0, 1.0, 1.0]


# -- 2b. several servers -------------------------------------------------------------------------------------
@pytest.mark.usefixtures("restores_seed0")
def test_async_over_two_servers_chunks_and_syncs_both(tiny_model_dir, demo_data, vllm_server, tmp_path):
    hf_server = start_server(tiny_model_dir, tmp_path / "hf_server", backend="hf")
    try:
        training = {"max_steps": 3}
        servers = [vllm_server, hf_server]
        sync, sync_trained = run(
            server_cfg(tiny_model_dir, demo_data, tmp_path / "sync", servers, training=training)
        )
        overlapped, async_trained = run(
            server_cfg(
                tiny_model_dir, demo_data, tmp_path / "async", servers, training=training, rollout=ASYNC
            )
        )
        assert hf_server.weight_version() == overlapped.syncs[-1][2]  # every sync reached both servers
    finally:
        hf_server.stop()
    assert [(e["step"], e["ids"]) for e in async_trained] == [(e["step"], e["ids"]) for e in sync_trained]
    assert check_staleness(overlapped, async_trained, 1) == [0] * 4 + [1] * 8
    # The same chunks as a synchronous run (2 + 2 requests, one per server), so the same tokens at step 0.
    assert signature(overlapped.rollouts[:1]) == signature(sync.rollouts[:1])
    assert losses(overlapped)[0]["loss"] == losses(sync)[0]["loss"]


# -- 3. resume with a background request outstanding at save time --------------------------------------------
class PendingAtSave(TrainerCallback):
    """Records which step's window was being generated in the background at each checkpoint save."""

    def __init__(self) -> None:
        self.trainer: Any = None
        self.pending: dict[int, int | None] = {}

    def on_save(self, args, state, control, **kwargs) -> None:
        self.pending[state.global_step] = self.trainer.overlap.pending_step


@pytest.mark.usefixtures("restores_seed0")
def test_resume_with_a_prefetch_in_flight_skips_and_repeats_nothing(
    tiny_model_dir, demo_data, vllm_server, tmp_path
):
    training = {"max_steps": 4, "save_strategy": "steps", "save_steps": 2}

    def cfg(name: str) -> RunConfig:
        return server_cfg(
            tiny_model_dir, demo_data, tmp_path / name, [vllm_server], training=training, rollout=ASYNC
        )

    saves = PendingAtSave()
    # One straight run (4 steps, checkpoint after step 2 while step 2's window is being generated).
    straight, straight_trained = run(cfg("full"), callbacks=[saves])
    assert saves.pending == {2: 2, 4: None}
    checkpoint = tmp_path / "full" / "checkpoint-2"
    assert checkpoint.is_dir()
    resumed, resumed_trained = run(cfg("resumed"), resume=str(checkpoint))
    assert resumed.trainer.state.global_step == 4
    # The window in flight at save time is requested again by the resumed run (same seeds), nothing else.
    assert [(e["step"], e["ids"]) for e in resumed_trained] == [
        (e["step"], e["ids"]) for e in straight_trained[2:]
    ]
    all_ids = [i for e in straight_trained[:2] + resumed_trained for i in e["ids"]]
    assert sorted(all_ids) == sorted(i for e in straight_trained for i in e["ids"])
    assert len(all_ids) == len(set(all_ids)) == 16
    assert resumed_trained[0]["staleness"] == [0] * 4  # generated after the resumed run's own sync
    assert check_staleness(resumed, resumed_trained, 1) == [0] * 4 + [1] * 4


# -- 4. a server killed during a background request ----------------------------------------------------------
def test_server_killed_during_prefetch_fails_like_a_synchronous_rollout(tiny_model_dir, demo_data, tmp_path):
    # Call 2 is the background request of step 1's window, made while step 0 trains; the server dies under it.
    rec, url, info, failed_after = train_until_server_killed(
        tiny_model_dir, demo_data, tmp_path, kill_at_call=2, **ASYNC
    )
    assert failed_after < 20  # no hang: raised by step 1 as soon as it needs the window
    assert url in str(info.value)
    assert rec.trainer.state.global_step == 1


# -- 5. two learner ranks (torchrun, gloo) -------------------------------------------------------------------
@pytest.mark.usefixtures("restores_seed0")
def test_two_ranks_each_request_their_own_windows_and_rank0_syncs(
    tiny_model_dir, demo_data, vllm_server, tmp_path
):
    cfg = server_cfg(
        tiny_model_dir, demo_data, tmp_path / "run", [vllm_server], training={"max_steps": 3}, rollout=ASYNC
    )
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
    before = served_version(vllm_server)
    result = start_learner_2rank(config, timeout=600)
    output = result.stdout + result.stderr
    assert not exit_problems(result), output[-6000:]
    steps = [r for r in load_metrics(tmp_path / "run" / "metrics.jsonl") if "loss" in r]
    assert [s["step"] for s in steps] == [1, 2, 3]
    # the engaged strategy is measured and said: DDP over 2 ranks, each rank's AdamW state (2 fp32 moments)
    assert "training strategy (measured after step 1): ddp" in output, output[-3000:]
    assert all(f"rank {r}/2: ddp" in output for r in (0, 1))
    assert steps[0]["dist/world_size"] == 2.0 and steps[0]["dist/strategy_code"] == 1.0
    assert steps[0]["dist/optimizer_state_bytes_rank0"] == steps[0]["dist/optimizer_state_bytes_max"] > 0
    # Metrics are summed over ranks: 2 x 4 samples per step, from step 1 on all from the background requests.
    assert [s["rollout/samples"] for s in steps] == [8.0] * 3
    assert [s["rollout/prefetched"] for s in steps] == [0.0, 8.0, 8.0]
    assert [s["rollout/staleness_max"] for s in steps] == [0.0, 1.0, 1.0]
    assert all(s["rollout/regenerated"] == 0.0 for s in steps)
    # Rank 0 alone syncs, once per step that a later window needs (steps 0 and 1).
    sync_lines = [line for line in output.splitlines() if "weight sync step" in line]
    assert len(sync_lines) == 2 and all("[rank0]" in line for line in sync_lines), sync_lines
    assert served_version(vllm_server) == before + 2


@pytest.mark.usefixtures("restores_seed0")
@pytest.mark.parametrize("rollout", [{}, ASYNC], ids=["sync", "async"])
def test_two_rank_runs_exit_cleanly_every_time(tiny_model_dir, demo_data, vllm_server, tmp_path, rollout):
    """The two-rank learner, run again and again: every run exits 0 with its gloo threads joined before Python
    finalizes (`learner.__main__.shutdown`; the learner warns by name about a collective
    thread still alive). The async variant's first run is
    `test_two_ranks_each_request_their_own_windows_and_rank0_syncs`'s (same check), so it adds the others."""
    runs = EXIT_LOOP_RUNS - 1 if rollout else EXIT_LOOP_RUNS
    if runs == 0:
        pytest.skip("ROLLMATCH_EXIT_LOOP_RUNS=1: the one async two-rank run is the windows test's")
    for attempt in range(runs):
        cfg = server_cfg(
            tiny_model_dir,
            demo_data,
            tmp_path / f"run{attempt}",
            [vllm_server],
            training={"max_steps": 2},
            rollout=rollout,
        )
        config = tmp_path / f"run{attempt}.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        result = start_learner_2rank(config, timeout=600)
        problems = exit_problems(result)
        assert not problems, (
            f"attempt {attempt + 1}/{runs}: {problems}\n{(result.stdout + result.stderr)[-4000:]}"
        )


def test_two_ranks_stop_together_when_the_server_dies_mid_run(tiny_model_dir, demo_data, tmp_path):
    """A server killed while two learner ranks overlap rollouts with training: both ranks exit with an error
    naming the server, within the client's timeouts (no rank left waiting in a collective)."""
    server = start_server(tiny_model_dir, tmp_path / "hf_server", backend="hf")
    try:
        cfg = server_cfg(
            tiny_model_dir,
            demo_data,
            tmp_path / "run",
            [server],
            rollout={"infer_timeout_s": 20, "timeout_s": 20, **ASYNC},
            training={"max_steps": 40},
        )
        config = tmp_path / "run.yaml"
        config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_none=True)))
        env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower() and k != "WORLD_SIZE"}
        metrics = tmp_path / "run" / "metrics.jsonl"
        with (tmp_path / "learner.log").open("w") as log:
            learner = subprocess.Popen(
                ["bash", str(REPO / "scripts" / "start_learner.sh"), "--config", str(config), "--nproc", "2"],
                cwd=REPO,
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                deadline = time.monotonic() + 300
                while not (metrics.exists() and metrics.read_text().count('"loss"') >= 2):
                    assert learner.poll() is None, (tmp_path / "learner.log").read_text()[-4000:]
                    assert time.monotonic() < deadline, "the learner did not train 2 steps in 300 s"
                    time.sleep(0.2)
                server.kill()  # steps overlap: a background request is in flight or about to be
                killed_at = time.monotonic()
                rc = learner.wait(timeout=120)
                stopped_after = time.monotonic() - killed_at
            finally:
                if learner.poll() is None:
                    os.killpg(learner.pid, signal.SIGKILL)
    finally:
        server.stop()
    output = (tmp_path / "learner.log").read_text()
    assert rc != 0, output[-4000:]
    assert stopped_after < 60, f"ranks took {stopped_after:.0f} s to stop"
    assert server.base_url in output, output[-4000:]
    # Both ranks raised (neither was left in a collective). Each one shows it by its own traceback or, when
    # torchrun's report came before that rank's stderr was flushed (either rank, measured in CI), by its exit
    # code 1 in torchrun's failure summary (a rank that torchrun had to terminate would
    # show a signal instead).
    lines = output.splitlines()
    for rank in (0, 1):
        traceback = any(line.startswith(f"[rank{rank}]") and "Error" in line for line in lines)
        summary = re.search(rf"rank\s*:\s*{rank} \(local_rank: {rank}\)\s*\n\s*exitcode\s*:\s*1 ", output)
        assert traceback or summary, f"rank {rank}: " + output[-4000:]
