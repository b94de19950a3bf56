"""Stage `openai`: `/infer/` against vLLM's own OpenAI server on `--server-gpu`, on the VL model (token-id
prompts of `bench/bench_server.py`'s workload, `--openai-prompts` x `--new-tokens`, greedy, `ignore_eos`), the
same engine args on both (`bench/_vs_openai.py`). Target: ratio >= 0.95."""

from __future__ import annotations

from _vs_openai import infer_vs_openai
from bench_server import workload

from _vllm_gpu.common import Bench

TARGET = 0.95


def vs_openai(bench: Bench) -> None:
    args = bench.args
    folder = bench.tmp / "openai"
    folder.mkdir()
    section = bench.server_section(bench.vl_model(), "vllm")
    prompts, warm = workload(args.openai_prompts), workload(4, seed=1)
    record = infer_vs_openai(section, folder, prompts, warm, args.new_tokens, env=bench.env,
                             deadline_s=args.startup_timeout_s + 60)  # fmt: skip
    bench.emit({**record, "backend": "vllm", "target": TARGET, "meets_target": record["ratio"] >= TARGET})
