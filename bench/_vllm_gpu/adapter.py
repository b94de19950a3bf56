"""Stage `adapter`: adapter (LoRA) syncs into a LoRA-enabled vLLM server on `--server-gpu` (`enable_lora`,
`max_lora_rank` 8), from a learner on GPU 0 holding the VL model with a random, non-zero PEFT LoRA (r 8 on the
language model's q_proj / v_proj), through the production path (`WeightSyncPolicy`, `rollout.sync.mode:
adapter`, HTTP): the seconds of one adapter sync (a warm-up, then `--adapter-syncs` timed), and whether the
served output became the adapter's: the largest log-prob gap between the learner with its adapter and the
server's greedy tokens, on the base weights before the sync and under the adapter's name after it, and the
fraction of greedy tokens the adapter changed.
"""

from __future__ import annotations

from typing import Any

from _sync_gpu import greedy_gap

from _vllm_gpu.common import Bench, token_prompts

LORA_RANK = 8
TARGETS = r".*language_model.*\.(q_proj|v_proj)"
"""PEFT's regex of the adapted modules: the language model's attention, as vLLM serves LoRA for it."""


def adapter(bench: Bench) -> None:
    import torch
    from peft import LoraConfig, get_peft_model

    from learner.rollout.server_source import ServerRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy

    section = bench.server_section(bench.vl_model(), "vllm", enable_lora=True, max_lora_rank=LORA_RANK)
    server = bench.start(section, "server-lora")
    try:
        torch.manual_seed(0)
        lora = LoraConfig(
            r=LORA_RANK, lora_alpha=2 * LORA_RANK, target_modules=TARGETS, init_lora_weights=False
        )
        model = get_peft_model(bench.load_vl_model(), lora).eval()
        prompts = token_prompts(8)
        policy = WeightSyncPolicy(SyncConfig(mode="adapter", fallback_to_full=False, transport="http"))
        with ServerRolloutSource([server.base], timeout_s=900) as source:
            before = greedy_gap(source, model, prompts)
            base_tokens = _greedy_tokens(source, prompts, None)
            seconds = []
            for step in range(bench.args.adapter_syncs + 1):
                seconds.append(policy.maybe_sync(model, step, source))
            name = policy.request_adapter
            after = greedy_gap(source, model, prompts, adapter=name)
            adapter_tokens = _greedy_tokens(source, prompts, name)
            version = source.health().weight_version
        report = policy.last_report
        timed = seconds[1:]
        pairs = zip(sum(base_tokens, []), sum(adapter_tokens, []), strict=True)
        changed = sum(a != b for a, b in pairs) / max(1, sum(map(len, base_tokens)))
        bench.emit({"measure": "adapter_sync", "transport": "http", "mode": policy.mode, "adapter": name,
                    "bytes": report.bytes if report else None, "seconds": round(min(timed), 4),
                    "all_seconds": [round(s, 4) for s in timed], "warmup_s": round(seconds[0], 4),
                    "weight_version": version, "gap_before_sync": before, "gap_after_sync": after,
                    "tokens_changed_by_adapter": round(changed, 3)})  # fmt: skip
    finally:
        server.stop()


def _greedy_tokens(source: Any, prompts: list[list[int]], adapter: str | None) -> list[list[int]]:
    from shared_schemas.infer import InferBatch, InferRequest, RequestConfig

    batch = InferBatch(
        infer_requests=[
            InferRequest(prompt_token_ids=p, request_id=f"tok-{i}") for i, p in enumerate(prompts)
        ],
        request_config=RequestConfig(max_tokens=16, temperature=0.0, ignore_eos=True, adapter=adapter),
    )
    return [r.choices[0].token_ids for r in source.infer(batch)]
