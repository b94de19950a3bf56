"""The learner's side of the wire against REAL rollout server processes (no mocks).

The sync tests use the session's seed-0 vLLM server (`vllm_server`, no LoRA); the kill test adds a
throw-away HF-backend server (no second vLLM engine) that it kills.

- a full sync of the seed-1 tiny model through `WeightSyncPolicy` + `ServerRolloutSource`, over http, shm
  and gloo (the collective transport: vLLM's weight-transfer engine in the workers), makes the server answer
  like the seed-1 model;
- shm with and without shared parameters: an in-place change of the learner's weights is what the next
  sync serves (with them, that sync copies no tensor byte);
- an adapter sync against a LoRA-less server raises `SyncRejected`, and the policy falls back to full once
  (the merged LoRA weights are then served);
- killing a server makes the next `infer` fail fast, naming that server (no hang); killing one of three
  servers in the middle of a gloo sync fails the sync naming it, and no other server commits;
- a gloo sync reaches two or three servers (vLLM and HF engines) through ONE group, one broadcast per bucket.

The HF servers that are not killed come from one module pool of three (`hf_pool`, started side by side); a
server a test kills is its own. Every test leaves the servers it shares serving the seed-0 weights it found.
"""

from __future__ import annotations

import copy
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from learner.rollout.server_source import InferFailed, ServerRolloutSource
from learner.weights.export import adapter_state
from learner.weights.sync import SyncConfig, WeightSyncPolicy
from learner.weights.types import SyncError, SyncRejected, WeightUpdate
from shared_schemas.health import Health
from shared_schemas.infer import InferBatch, InferRequest, RequestConfig
from tests.integration.conftest import ServerProcess
from tests.integration.learner_fixtures import RolloutServer, start_server, start_servers

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


@pytest.fixture(scope="module")
def hf_pool(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[RolloutServer]]:
    """Three HF-backend servers of the tiny seed-0 model, shared by the module's multi-server tests (each test
    leaves them serving the seed-0 weights)."""
    tmp = tmp_path_factory.mktemp("hf_pool")
    servers = start_servers(
        tiny_model_dir, [tmp / f"hf{i}" for i in range(3)], backend="hf", max_model_len=512
    )
    yield servers
    for server in servers:
        server.stop()


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
        if transport == "shm":  # the restore rewrote the first sync's files (released by the server) in place
            assert source.last_sync_stages["shm_reused_bytes"] > 0
            # ... and what the server serves never depends on them after its sync ended: scribble over the
            # files the next sync would rewrite, the served model must not change.
            for spare in source.weight_sync.transport.stager._spares.values():  # type: ignore[attr-defined]
                spare.write_bytes(os.urandom(spare.stat().st_size))
        assert same_model(rollout(source), before, atol=0.0)
    if transport == "shm":
        assert list(vllm_server.shm_dir.iterdir()) == [], "bucket files are removed after the sync"


@pytest.mark.parametrize("share", [True, False], ids=["shared-parameters", "copied"])
def test_shm_syncs_follow_training_in_place(
    vllm_server: ServerProcess, tiny_model_dir: Path, tiny_model_dir_seed1: Path, share: bool
) -> None:
    """With `shm_share_parameters` the first sync moves the learner's parameters into the bucket files; an
    in-place update of them (what an optimizer step does) is what the next sync serves, and that sync
    copies no tensor byte. Without it every sync copies every byte."""
    model, seed1 = load_lm(tiny_model_dir), load_lm(tiny_model_dir_seed1)
    config = SyncConfig(transport="shm", bucket_mb=1, shm_share_parameters=share)
    with ServerRolloutSource(
        [vllm_server.base_url], timeout_s=30, transport="shm", shm_dir=vllm_server.shm_dir, bucket_mb=1
    ) as source:
        policy = WeightSyncPolicy(config)
        try:
            policy.maybe_sync(model, 0, source)
            assert source.last_sync_stages["shm_shared_bytes"] == 0  # the first sync writes the files
            served = rollout(source)
            with torch.no_grad():
                for param, trained in zip(model.parameters(), seed1.parameters(), strict=True):
                    param.copy_(trained)
            # Training in the files changes nothing served until the next sync commits (the engine copied
            # the bytes at its load and keeps no reference to the files).
            assert same_model(rollout(source), served, atol=0.0)
            policy.maybe_sync(model, 1, source)
            report = policy.last_report
            assert report is not None and source.health().weight_version == report.version
            shared = source.last_sync_stages["shm_shared_bytes"]
            assert shared == (report.bytes if share else 0)
            after = rollout(source)
            assert same_model(after, reference(seed1, after))
        finally:
            restore_seed0(source, tiny_model_dir, "shm")
    assert same_model(after, reference(model, after))  # the learner's weights survive the closed stager


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


@pytest.mark.parametrize("during", ["infer", "gloo_sync"])
def test_killed_server_fails_fast_naming_it(
    vllm_server: ServerProcess,
    tiny_model_dir: Path,
    tiny_model_dir_seed1: Path,
    tmp_path: Path,
    during: str,
    request: pytest.FixtureRequest,
) -> None:
    """`infer`: the next rollout fails fast naming the killed server. `gloo_sync`: three servers in one gloo
    group (vLLM, the doomed HF server, another HF server); the doomed one is SIGKILLed before the learner's
    third bucket of a seed-1 sync: the sync fails within the group's timeout naming it, neither other server
    commits (both still serve the seed-0 weights at their old version), a retry through the same source fails
    at once naming it again (the documented policy: the run stops), and a source over the two survivors (the
    dead server removed from rollout.servers) forms a new group and syncs."""
    if during == "gloo_sync":
        other = request.getfixturevalue("hf_pool")[0]
        killed_mid_gloo_sync(vllm_server, other, tiny_model_dir, tiny_model_dir_seed1, tmp_path)
        return
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


def killed_mid_gloo_sync(
    vllm_server: ServerProcess,
    other: RolloutServer,
    tiny_model_dir: Path,
    tiny_model_dir_seed1: Path,
    tmp_path: Path,
) -> None:
    from learner.weights.group_send import CollectiveSender

    seed0, seed1 = load_lm(tiny_model_dir), load_lm(tiny_model_dir_seed1)
    doomed = start_server(tiny_model_dir, tmp_path / "doomed", backend="hf", max_model_len=512)
    timeout_s = 5.0
    urls = [vllm_server.base_url, doomed.base_url, other.base_url]
    survivors = [vllm_server.base_url, other.base_url]
    try:
        with ServerRolloutSource(
            urls, timeout_s=10, transport="gloo", bucket_mb=0.1, collective_timeout_s=timeout_s
        ) as source:
            policy = WeightSyncPolicy(SyncConfig(transport="gloo"))
            policy.maybe_sync(seed0, 0, source)  # forms the group of 4 ranks; serves what it served
            assert source.last_sync_stages["collective_world_size"] == 4.0
            versions = {url: _health_of(url).weight_version for url in urls}
            assert set(versions.values()) == {policy.version}
            broadcast = CollectiveSender.broadcast

            def kill_before_bucket_2(sender: CollectiveSender, flat: torch.Tensor, index: int) -> None:
                if index == 2:
                    doomed.kill()
                broadcast(sender, flat, index)

            CollectiveSender.broadcast = kill_before_bucket_2  # type: ignore[method-assign]
            try:
                started = time.monotonic()
                with pytest.raises(SyncError) as info:
                    policy.maybe_sync(seed1, 1, source)
                elapsed = time.monotonic() - started
            finally:
                CollectiveSender.broadcast = broadcast  # type: ignore[method-assign]
            assert f"rollout server {doomed.base_url} no longer answers" in str(info.value)
            assert "No server applied this sync" in str(info.value)
            # The broadcast or the prepare round is bounded by the timeout, plus the health probe.
            assert elapsed < 2 * timeout_s + 15, elapsed
            assert {url: _health_of(url).weight_version for url in survivors} == {
                url: versions[url] for url in survivors
            }, "a server committed a sync another server did not receive"
            with pytest.raises(
                SyncError, match=doomed.base_url
            ):  # the same fleet: its group is not re-formed
                policy.maybe_sync(seed1, 2, source)
        with ServerRolloutSource(
            survivors, timeout_s=10, transport="gloo", bucket_mb=0.1, collective_timeout_s=4 * timeout_s
        ) as source:
            after_failure = rollout(source)  # request 2 runs on the HF survivor
            assert same_model(after_failure, reference(seed0, after_failure)), "old weights everywhere"
            WeightSyncPolicy(SyncConfig(transport="gloo")).maybe_sync(seed0, 0, source)
            assert (
                source.last_sync_stages["collective_world_size"] == 3.0
            )  # a new group without the dead server
            assert len({_health_of(url).weight_version for url in survivors}) == 1
            assert same_model(rollout(source), after_failure, atol=0.0)
    finally:
        doomed.stop()


@pytest.mark.parametrize("fleet", ["vllm+hf", "hf+hf", "hf+hf+hf"])
def test_gloo_sync_reaches_every_server_through_one_group(
    request: pytest.FixtureRequest,
    hf_pool: list[RolloutServer],
    tiny_model_dir: Path,
    tiny_model_dir_seed1: Path,
    fleet: str,
) -> None:
    """ONE gloo group over every server (world size 1 + every receiver), each bucket one broadcast: the vLLM
    workers (vLLM's weight-transfer engine) and the HF engines (in their processes) receive, stage and serve
    the seed-1 weights, every server commits the same version exactly once, and the fleet answers like one
    server holding the same weights (the ordered chunking: each request keeps its own seed wherever its chunk
    runs). The restore reuses the group."""
    seed1 = load_lm(tiny_model_dir_seed1)
    kinds = fleet.split("+")
    vllm = request.getfixturevalue("vllm_server") if "vllm" in kinds else None
    urls = ([vllm.base_url] if vllm is not None else []) + [s.base_url for s in hf_pool[: kinds.count("hf")]]
    with ServerRolloutSource(urls, timeout_s=30, transport="gloo", bucket_mb=0.1) as source:
        before = {url: _health_of(url).weight_version for url in urls}
        policy = WeightSyncPolicy(SyncConfig(transport="gloo"))
        try:
            policy.maybe_sync(seed1, 0, source)
            assert policy.version == max(before.values()) + 1
            assert {url: _health_of(url).weight_version for url in urls} == dict.fromkeys(
                urls, policy.version
            )
            assert source.last_sync_stages["collective_world_size"] == 1 + len(urls)  # 1 receiver each
            group = source.weight_sync.transport.sender.fleet.token  # type: ignore[attr-defined]
            after = rollout(source)  # 3 requests chunked in order over the servers
            assert same_model(after, reference(seed1, after))
            with ServerRolloutSource(urls[-1:], timeout_s=30) as single:  # one HF server, the same weights
                assert same_model(rollout(single), after, atol=0.0 if vllm is None else 1e-4)
            if vllm is not None:
                assert "server_workers_receive_s" in source.last_sync_stages
        finally:
            restore_seed0(source, tiny_model_dir, "gloo")
        assert source.weight_sync.transport.sender.fleet.token == group  # type: ignore[attr-defined]  # reused
        assert same_model(rollout(source), reference(load_lm(tiny_model_dir), after))


def _health_of(base_url: str) -> Health:
    with ServerRolloutSource([base_url], timeout_s=10) as source:
        return source.health()
