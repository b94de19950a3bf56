"""The `bench/` scripts still run: each one's CPU smoke mode, in a subprocess, printing the JSON lines it
documents (numbers are checked only where they are invariants, not speeds)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_bench(script: str, *args: str) -> list[dict]:
    result = subprocess.run(
        [sys.executable, f"bench/{script}", *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return [json.loads(line) for line in result.stdout.splitlines() if line.startswith("{")]


def test_bench_logits_smoke_full_and_compact_agree() -> None:
    lines = run_bench("bench_logits.py", "--smoke", "--repeats", "1")
    ratios = [line for line in lines if line.get("measure") == "full_over_compact"]
    assert {line["layout"] for line in ratios} == {"packed", "padded"}
    assert all(line["loss_abs_diff"] < 1e-4 for line in ratios)
    steps = [line for line in lines if "mode" in line]
    assert all(line["read_columns"] < line["shape"][1] for line in steps)


def test_bench_rollout_batching_smoke_rows_match() -> None:
    lines = run_bench("bench_rollout_batching.py", "--smoke")
    (ratio,) = [line for line in lines if line.get("measure") == "speedup_batched_over_per_sample"]
    assert ratio["decode_attention"] == "grouped" and ratio["ratio"] > 0
    # float32 on CPU: left padding and the grouped decode attention change no greedy row.
    assert ratio["greedy_rows_identical"] == "8/8"


def test_bench_stage2_smoke() -> None:
    (line,) = run_bench("bench_stage2.py", "--objects", "10", "--samples", "5")
    assert line["objects"] == 10 and line["median_ms"] > 0
    assert set(line["stage_median_ms"]) == {"parse", "gt", "match", "targets"}


def test_bench_packing_smoke_fill() -> None:
    lines = run_bench("bench_packing.py", "--smoke")
    fills = [line for line in lines if line.get("inflow_tokens_per_row") == 1.0]
    assert fills and fills[0]["fill_mean"] >= 0.95


def test_bench_logits_vlm_smoke_image_segments() -> None:
    """`--vlm`: image segments from the learner's encoder on the tiny Qwen3-VL;
    full and compact logits agree."""
    lines = run_bench("bench_logits.py", "--vlm", "--smoke", "--repeats", "1")
    ratios = [line for line in lines if line.get("measure") == "full_over_compact"]
    assert {line["layout"] for line in ratios} == {"packed", "padded"}
    assert all(line["loss_abs_diff"] < 1e-4 for line in ratios)
    steps = [line for line in lines if "mode" in line]
    assert steps and all(line["model"] == "qwen3_vl" for line in steps)
    assert steps[0]["image_tokens_per_segment"][1] > steps[0]["image_tokens_per_segment"][0] > 0


def test_bench_sync_fleet_cpu_check_one_group_over_two_servers() -> None:
    """`bench_sync.py --gpu --servers N` (the N+1 GPU topology) in its CPU variant: gloo, two HF servers, the
    raw broadcasts to 2 and 3 ranks, syncs to 1 then 2 servers through one group, every server serving each
    sync's version once."""
    lines = run_bench(
        "bench_sync.py", "--gpu", "--cpu-check", "--servers", "2", "--models", "tiny", "--repeats", "1",
        "--bucket-mb", "1", "--prompts", "2",
    )  # fmt: skip
    assert not [line for line in lines if line["measure"] == "error"], lines
    raw = [line for line in lines if line["measure"] == "ceiling_raw_gloo_broadcast"]
    assert [line["world_size"] for line in raw] == [2, 3] and all(line["received_ok"] for line in raw)
    syncs = [line for line in lines if line["measure"] == "fleet_sync"]
    assert [(line["servers"], line["stages"]["collective_world_size"]) for line in syncs] == [
        (1, 2.0),
        (2, 3.0),
    ]
    for line in syncs:
        assert all(
            served == [version] * line["servers"]
            for version, served in line["sync_version_and_served_versions"]
        )
        assert line["effect_after_sync"]["max_gap_nats"] < 0.05
    (scaling,) = [line for line in lines if line["measure"] == "fleet_scaling"]
    assert scaling["sync_seconds_2"] > 0


def test_bench_fleet_cpu_check_identity_throughput_and_a_killed_server() -> None:
    """`bench_fleet.py` (the rollout half of the N+1 GPU bench) in its CPU variant: two HF servers, the
    trainer's step batch of image prompts gives the same sampled tokens on one server and on both, the
    throughput line has fixed-length rows and the 2-rounds-vs-1 workload, and a server SIGKILLed mid-call
    fails the call with `InferFailed` naming it."""
    lines = run_bench("bench_fleet.py", "--cpu-check", "--servers", "2", "--repeats", "1")
    assert not [line for line in lines if line["measure"] == "error"], lines
    (identity,) = [line for line in lines if line["measure"] == "fleet_identity"]
    assert identity["identical"] and identity["rows"] == 16 and identity["distinct_rows"] > 1
    (tput,) = [line for line in lines if line["measure"] == "fleet_throughput"]
    assert tput["new_tokens_per_row"] == [8] and tput["tokens_identical_1_vs_n"]
    assert (tput["decode_rounds_one_server"], tput["decode_rounds_per_server_fleet"]) == (2, 1)
    (kill,) = [line for line in lines if line["measure"] == "fleet_kill"]
    assert kill["matches_policy"] and kill["names_dead_server"] and not kill["hung"], kill


def test_bench_learner_configs_load_with_liger_and_a_model_directory(tmp_path) -> None:
    """`bench_learner.py --vlm-2b --liger` writes ONE `model:` mapping (path, dtype, liger_kernel) that the
    learner's loader accepts; the learner itself refuses the switch on CPU at model load, not here."""
    sys.path.insert(0, str(REPO / "bench"))
    try:
        import bench_learner
    finally:
        sys.path.remove(str(REPO / "bench"))
    from learner.config import load_run_config

    model_dir = tmp_path / "qwen3-vl-2b-shapes"
    _, configs = bench_learner.write_configs(
        tmp_path, 8000, 8, [1, 4], "colocate-hf", bench_learner.VLM_BASE_CONFIG, model_dir, liger=True
    )
    for m, path in configs.items():
        cfg = load_run_config(path)
        assert cfg.model.liger_kernel is True and cfg.model.path == str(model_dir)
        assert cfg.rollout.mode == "colocate" and cfg.stage2.rollout_buffer.m_steps == m


def test_bench_packing_vlm_phase_split() -> None:
    """`--phases` cuts the packed step into its phases, whose spans add up to the step (on CPU the spans are
    host time); the compiled variant (`--compile all --skip-eager`) ran on an H200 (bench/RESULTS.md)."""
    lines = run_bench("bench_packing.py", "--gpu", "--vlm", "--smoke", "--no-compare-loop", "--phases", "1")
    (split,) = [line for line in lines if line.get("mode") == "phases"]
    assert "error" not in split, split
    phases = split["phases"]
    assert list(phases) == ["embed", "vision", "merge", "lm", "head", "loss", "backward"]
    assert all(p["gpu_span_ms"] >= 0 for p in phases.values())
    assert abs(sum(p["gpu_span_ms"] for p in phases.values()) - split["step_ms"]) < 0.5


def test_bench_packing_attention_replay() -> None:
    """`--attn-replay` records one packed row's attention calls (vision tower and language model) and times
    them through every kernel that runs here: on CPU only the per-segment loop (the varlen kernels are CUDA
    only; their figures on an H200 are in bench/RESULTS.md)."""
    lines = run_bench(
        "bench_packing.py", "--gpu", "--vlm", "--smoke", "--no-compare-loop", "--attn-replay", "2"
    )
    (replay,) = [line for line in lines if line.get("mode") == "attn_replay"]
    assert "error" not in replay, replay
    assert set(replay["calls"]) == {"vision", "language"}
    for tower in ("vision", "language"):
        assert replay["calls"][tower]["count"] >= 1 and replay["calls"][tower]["segments"] >= 1
        assert list(replay[tower]) == ["loop"] and replay[tower]["loop"]["fwd_bwd_ms"] > 0


def test_openai_command_gives_vllm_the_engine_args_of_our_server(tmp_path) -> None:
    """`bench/_vs_openai.py`: vLLM's own command-line parser reads the flags built from a `server:` section
    back into the engine args our server builds from it (the GPU bench's section: LoRA, mm limits, seqs)."""
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from rollout_server.config import ServerConfig
    from rollout_server.engines.vllm.params import engine_kwargs_from_config

    sys.path.insert(0, str(REPO / "bench"))
    try:
        from _vs_openai import OURS_ONLY, openai_command
    finally:
        sys.path.remove(str(REPO / "bench"))
    model = REPO / "assets" / "tiny-qwen2-copy"
    section = {"port": 8000, "model": str(model), "dtype": "bfloat16", "seed": 0, "gpus": [1],
               "vllm": {"max_model_len": 2048, "limit_mm_per_prompt": {"image": 1, "video": 0},
                        "max_num_seqs": 256, "enable_lora": True, "max_lora_rank": 8,
                        "gpu_memory_utilization": 0.7}}  # fmt: skip
    cmd, env = openai_command(section, 8123, {})
    assert env["CUDA_VISIBLE_DEVICES"] == "1"
    parser = AsyncEngineArgs.add_cli_args(FlexibleArgumentParser())
    parser.add_argument("--host")
    parser.add_argument("--port")
    parsed = AsyncEngineArgs.from_cli_args(parser.parse_args(cmd[3:]))
    wanted = engine_kwargs_from_config(ServerConfig.model_validate(section), cpu=True)
    for key, value in wanted.items():
        if key not in OURS_ONLY:
            assert getattr(parsed, key) == value, key
