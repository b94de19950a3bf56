"""The colocated vLLM weight handoffs on a CUDA GPU (`rollout.vllm.weight_handoff`: `ipc` and `bytes`), end to
end: the tiny Qwen3-VL served by a colocated engine on the learner's GPU, the learner's weights perturbed, one
full sync, then the engine's greedy tokens and log-probs must be the learner's (teacher-forced, float32): the
committed weights are the sent ones. On CUDA the commit is the in-place `load_weights`
(`rollout_server.engines.vllm.worker.commit_path`), so this also checks it, tied head included (the vision
tower is loaded by the same call, but these text prompts do not exercise it).
Skipped without CUDA (the CPU handoff is `bytes` + `reload_weights`, covered by `test_vllm_sync.py`).

    pytest -q -m gpu tests/integration/test_colocate_handoff_gpu.py
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = [
    pytest.mark.integration,
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="the ipc handoff needs a CUDA GPU"),
]

PROMPTS = [[5 + i, 6, 7, 100 + 3 * i] for i in range(4)]


def _perturb(model: Any) -> None:
    gen = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                p.add_(torch.randn(p.shape, generator=gen, device=p.device, dtype=p.dtype) * p.float().std())


def _gap(source: Any, model: Any) -> tuple[float, float]:
    """(largest |engine − learner| log-prob over the engine's greedy tokens, share of those tokens that are
    the learner's argmax)."""
    from shared_schemas.infer import InferBatch, InferRequest, RequestConfig

    batch = InferBatch(
        infer_requests=[InferRequest(prompt_token_ids=p, request_id=f"g{i}") for i, p in enumerate(PROMPTS)],
        request_config=RequestConfig(max_tokens=12, temperature=0.0, logprobs=True, ignore_eos=True),
    )
    worst, agree, total = 0.0, 0, 0
    with torch.no_grad():
        for prompt, result in zip(PROMPTS, source.infer(batch), strict=True):
            choice = result.choices[0]
            ids = torch.tensor([prompt + choice.token_ids], device="cuda")
            logp = torch.log_softmax(model(ids).logits[0, len(prompt) - 1 : -1].float(), dim=-1)
            tokens = torch.tensor(choice.token_ids, device="cuda")
            ours = logp.gather(1, tokens[:, None])[:, 0].cpu()
            worst = max(worst, float((ours - torch.tensor(choice.logprobs)).abs().max()))
            agree += int((logp.argmax(-1) == tokens).sum())
            total += len(choice.token_ids)
    return worst, agree / total


@pytest.mark.parametrize("handoff", ["ipc", "bytes"])
def test_colocated_sync_serves_the_learners_weights(tiny_vlm_dir: Path, handoff: str) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    from learner.config import RunConfig
    from learner.rollout.colocate import ColocateRolloutSource
    from learner.weights.sync import SyncConfig, WeightSyncPolicy
    from shared_schemas.vlm_shim import ensure_vl_imports

    ensure_vl_imports()
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_vlm_dir, dtype=torch.float32).cuda().eval()
    _perturb(model)  # the learner's "trained" weights: the engine serves the checkpoint until the sync
    cfg = RunConfig.model_validate(
        {
            "model": {"path": str(tiny_vlm_dir)},
            "data": {"train": ["unused.jsonl"]},
            "rollout": {
                "mode": "colocate",
                "backend": "vllm",
                "vllm": {"max_model_len": 512, "gpu_memory_utilization": 0.2, "dtype": "float32",
                         "enforce_eager": True, "weight_handoff": handoff},
            },
        }
    )  # fmt: skip
    with ColocateRolloutSource.from_config(cfg, model=model, tokenizer=None) as source:
        assert source.backend.handoff == handoff
        before, _ = _gap(source, model)
        policy = WeightSyncPolicy(SyncConfig(mode="full"), is_rank0=lambda: source.sends_weights)
        for step in range(2):  # the second sync replays the first's copy plan (handles, parameter slots)
            if step:  # new weights: the replayed commit must serve them, not step 0's
                _perturb(model)
                before, _ = _gap(source, model)
            policy.maybe_sync(model, step, source)
            stages = source.last_sync_stages
            assert stages["commit_s"] > 0 and stages["handoff_s"] > 0 and stages["cast_s"] > 0
            assert stages["commit_planned"] == float(step == 1), stages  # first: load_weights, recorded
            after, agree = _gap(source, model)
            assert after < 0.02 and before > 10 * after, (before, after, stages)
            assert agree >= 0.95
