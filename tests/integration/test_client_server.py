"""The learner's side of the wire against REAL rollout server processes (no mocks).

The sync tests use the session's seed-0 vLLM server (`vllm_server`, no LoRA); the kill test adds a
throw-away HF-backend server (no second vLLM engine) that it kills.

- a full sync of the seed-1 tiny model through `WeightSyncPolicy` + `ServerRolloutSource`, over http, shm
  and gloo (the collective transport: vLLM's weight-transfer engine in the workers), makes the server answer
  like the seed-1 model;
- an adapter sync against a LoRA-less server raises `SyncRejected`, and the policy falls back to full once
  (the merged LoRA weights are then served);
- killing a server makes the next `infer` fail fast, naming that server (no hang).

Every test leaves the shared server serving the seed-0 weights it started with.
"""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from learner.rollout.base import SyncRejected, WeightUpdate
from learner.rollout.client import InferFailed, ServerRolloutSource
from learner.weights.export import adapter_state
from learner.weights.sync import SyncConfig, WeightSyncPolicy
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig
from tests.integration.conftest import ServerProcess
from tests.integration.learner_fixtures import start_server

pytestmark = pytest.mark.integration

PROMPTS = [
    [{"role": "user", "content": "List every object in the image."}],
    [{"role": "user", "content": 'Reply with one JSON object: {"object_1": <|coord_12|>'}],
    [{"role": "user", "content": "hello"}],
]
MAX_TOKENS = 12


def load_lm(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


@dataclass(frozen=True)
class Answer:
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]


def rollout(source: ServerRolloutSource) -> list[Answer]:
    """Greedy answers with the logprob of every token, through the learner's client.

    The tiny random models answer every prompt greedily with the same newline token, so token ids alone
    cannot tell two weight sets apart; the logprobs can.
    """
    batch = InferBatch(
        infer_requests=[InferRequest(messages=m, request_id=f"p{i}") for i, m in enumerate(PROMPTS)],
        request_config=RequestConfig(max_tokens=MAX_TOKENS, temperature=0.0, seed=7, logprobs=True),
    )
    results = source.infer(batch)
    assert [r.request_id for r in results] == ["p0", "p1", "p2"]
    return [Answer(r.prompt_token_ids, r.choices[0].token_ids, r.choices[0].logprobs or []) for r in results]


def reference(model: torch.nn.Module, answers: list[Answer]) -> list[Answer]:
    """What `model` answers to the same prompts: greedy tokens and their logprobs."""
    out = []
    for answer in answers:
        prompt = torch.tensor([answer.prompt])
        with torch.no_grad():
            ids = model.generate(
                prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=MAX_TOKENS, do_sample=False
            )[0]
            logits = model(ids[None, :-1]).logits[0, len(answer.prompt) - 1 :]
        tokens = ids[len(answer.prompt) :]
        logprobs = torch.log_softmax(logits.float(), -1).gather(-1, tokens[:, None])[:, 0]
        out.append(Answer(answer.prompt, tokens.tolist(), logprobs.tolist()))
    return out


def same_model(served: list[Answer], expected: list[Answer], atol: float = 1e-4) -> bool:
    """Same greedy tokens and logprobs within `atol`."""
    return all(
        s.tokens == e.tokens and torch.allclose(torch.tensor(s.logprobs), torch.tensor(e.logprobs), atol=atol)
        for s, e in zip(served, expected, strict=True)
    )


def restore_seed0(source: ServerRolloutSource, tiny_model_dir: Path, transport: str = "http") -> None:
    WeightSyncPolicy(SyncConfig(transport=transport)).maybe_sync(load_lm(tiny_model_dir), 0, source)  # type: ignore[arg-type]


@pytest.mark.parametrize("transport", ["http", "shm", "gloo"])
def test_full_sync_serves_the_seed1_model(
    vllm_server: ServerProcess, tiny_model_dir: Path, tiny_model_dir_seed1: Path, transport: str
) -> None:
    seed0, seed1 = load_lm(tiny_model_dir), load_lm(tiny_model_dir_seed1)
    shm_dir = vllm_server.shm_dir if transport == "shm" else None
    # 0.1 MiB buckets: several buckets per sync.
    with ServerRolloutSource(
        [vllm_server.base_url], timeout_s=30, transport=transport, shm_dir=shm_dir, bucket_mb=0.1
    ) as source:
        before = rollout(source)
        assert same_model(before, reference(seed0, before))
        assert not same_model(reference(seed1, before), reference(seed0, before)), "seed-0/1 must differ"
        policy = WeightSyncPolicy(SyncConfig(transport=transport))
        try:
            seconds = policy.maybe_sync(seed1, 0, source)
            report = policy.last_report
            assert report is not None and report.transport == transport and report.mode == "full"
            assert seconds > 0 and source.health().weight_version == policy.version == report.version
            after = rollout(source)
            assert same_model(after, reference(seed1, after))
            assert source.last_infer.staleness == [0, 0, 0]
            assert policy.maybe_sync(seed1, 0, source) == 0.0  # same step: no second sync
        finally:
            # Through the same source: a gloo restore reuses the group the first sync formed.
            restore_seed0(source, tiny_model_dir, transport)
        assert same_model(rollout(source), before, atol=0.0)
    if transport == "shm":
        assert list(vllm_server.shm_dir.iterdir()) == [], "bucket files are removed after the sync"


def test_adapter_sync_rejected_then_policy_falls_back_to_full(
    vllm_server: ServerProcess, tiny_model_dir: Path
) -> None:
    model = get_peft_model(
        load_lm(tiny_model_dir), LoraConfig(r=4, target_modules=["q_proj", "v_proj", "o_proj"])
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0, 0.2, generator=torch.Generator().manual_seed(3))
    merged = copy.deepcopy(model).merge_and_unload().eval()
    with ServerRolloutSource([vllm_server.base_url], timeout_s=30) as source:
        assert not source.health().lora_enabled
        config, state = adapter_state(model)
        version = source.health().weight_version + 1
        update = WeightUpdate(
            mode="adapter", version=version, tensors=state, adapter_config=config, adapter_name="a"
        )
        with pytest.raises(SyncRejected, match="without LoRA"):
            source.sync_weights(update)
        assert source.health().weight_version == version - 1, "a refused sync applies nothing"

        policy = WeightSyncPolicy(SyncConfig(mode="adapter", fallback_to_full=True))
        try:
            policy.maybe_sync(model, 0, source)
            assert policy.mode == "full" and policy.last_report is not None
            assert policy.last_report.mode == "full" and policy.request_adapter is None
            after = rollout(source)
            assert same_model(after, reference(merged, after))
            assert not same_model(after, reference(load_lm(tiny_model_dir), after))
            policy.maybe_sync(model, 1, source)  # stays full: no second adapter attempt
            assert policy.last_report.mode == "full"
        finally:
            restore_seed0(source, tiny_model_dir)


def test_killed_server_fails_fast_naming_it(
    vllm_server: ServerProcess, tiny_model_dir: Path, tmp_path: Path
) -> None:
    doomed = start_server(tiny_model_dir, tmp_path, backend="hf", max_model_len=512)
    infer_timeout_s = 30.0
    try:
        with ServerRolloutSource(
            [vllm_server.base_url, doomed.base_url], timeout_s=5, infer_timeout_s=infer_timeout_s
        ) as source:
            assert len(rollout(source)) == 3
            doomed.kill()
            started = time.monotonic()
            with pytest.raises(InferFailed) as info:
                rollout(source)
            elapsed = time.monotonic() - started
    finally:
        doomed.stop()
    assert elapsed < infer_timeout_s
    assert info.value.url == doomed.base_url and doomed.base_url in str(info.value)
    assert info.value.indices == [2]  # 3 requests over 2 servers: the second server held index 2


def test_gloo_sync_reaches_a_vllm_and_an_hf_server_at_once(
    vllm_server: ServerProcess, tiny_model_dir: Path, tiny_model_dir_seed1: Path, tmp_path: Path
) -> None:
    """One group per server, both fed by the same broadcasts: the vLLM workers (vLLM's weight-transfer engine)
    and the HF engine (in its process) receive, stage and serve the seed-1 weights; the restore reuses both
    groups."""
    seed1 = load_lm(tiny_model_dir_seed1)
    hf_server = start_server(tiny_model_dir, tmp_path, backend="hf", max_model_len=512)
    try:
        with ServerRolloutSource(
            [vllm_server.base_url, hf_server.base_url], timeout_s=30, transport="gloo", bucket_mb=0.1
        ) as source:
            policy = WeightSyncPolicy(SyncConfig(transport="gloo"))
            try:
                policy.maybe_sync(seed1, 0, source)
                assert {
                    h.weight_version for h in map(_health_of, [vllm_server.base_url, hf_server.base_url])
                } == {policy.version}
                after = rollout(source)  # request 2 runs on the HF server
                assert same_model(after, reference(seed1, after))
                assert "server_workers_receive_s" in source.last_sync_stages
            finally:
                restore_seed0(source, tiny_model_dir, "gloo")
            assert same_model(rollout(source), reference(load_lm(tiny_model_dir), after))
    finally:
        hf_server.stop()


def _health_of(base_url: str) -> Health:
    with ServerRolloutSource([base_url], timeout_s=10) as source:
        return source.health()
