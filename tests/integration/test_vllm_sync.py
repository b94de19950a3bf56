"""`/sync_weights/` against real vLLM servers: full syncs, rejected syncs that change nothing, adapter syncs.

Every test leaves the servers serving the weights it found (versions only grow).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
import torch

from learner.rollout.errors import ServerError
from tests.integration.conftest import ServerProcess
from tests.integration.vllm_helpers import (
    SyncFailed,
    begin_sync,
    checkpoint_tensors,
    encode_tensors,
    infer,
    infer_raw,
    sync_adapter,
    sync_full,
    tokens_of,
)

pytestmark = pytest.mark.integration

PROMPTS = [[5 + i, 6, 7, 100 + 3 * i] for i in range(6)]
MAX_TOKENS = 16


def _body(adapter: str | None = None) -> dict[str, Any]:
    return {
        "infer_requests": [{"prompt_token_ids": p} for p in PROMPTS],
        "request_config": {
            "max_tokens": MAX_TOKENS,
            "ignore_eos": True,
            "logprobs": True,
            "adapter": adapter,
        },
    }


def _answers(server: ServerProcess, adapter: str | None = None) -> list[tuple[list[int], list[float] | None]]:
    return [
        (r.choices[0].token_ids, r.choices[0].logprobs)
        for r in infer(server.base_url, _body(adapter)).results
    ]


@pytest.fixture()
def seed0_restored(vllm_server: ServerProcess, tiny_model_dir: Path) -> Iterator[list[Any]]:
    """The seed-0 server's answers before the test; afterwards its seed-0 weights are synced back."""
    before = _answers(vllm_server)
    yield before
    if vllm_server.health()["weight_version"] > 0 and _answers(vllm_server) != before:
        sync_full(
            vllm_server.base_url,
            checkpoint_tensors(tiny_model_dir),
            vllm_server.health()["weight_version"] + 1,
        )
    assert _answers(vllm_server) == before


def test_full_sync_makes_the_server_answer_like_the_seed1_server(
    vllm_server: ServerProcess,
    vllm_server_seed1: ServerProcess,
    tiny_model_dir_seed1: Path,
    seed0_restored: list[Any],
) -> None:
    reference = _answers(vllm_server_seed1)
    assert reference != seed0_restored
    version = vllm_server.health()["weight_version"] + 1
    # 64 KiB buckets: the tiny model travels in several buckets.
    commit = sync_full(
        vllm_server.base_url, checkpoint_tensors(tiny_model_dir_seed1), version, bucket_bytes=1 << 16
    )
    assert commit["weight_version"] == version and commit["mode"] == "full"
    assert vllm_server.health()["weight_version"] == version
    out = infer(vllm_server.base_url, _body())
    assert {r.weight_version for r in out.results} == {version} and out.weight_version == version
    assert [(r.choices[0].token_ids, r.choices[0].logprobs) for r in out.results] == reference


def _rename(tensors: dict[str, np.ndarray], old: str, new: str) -> dict[str, np.ndarray]:
    return {(new if k == old else k): v for k, v in tensors.items()}


BAD_SYNCS = {
    "wrong-shape": (
        lambda t: {**t, "model.norm.weight": np.zeros((3, 5), np.float32)},
        "begin",
        400,
        "model.norm.weight",
    ),
    "unknown-name": (
        lambda t: _rename(t, "model.norm.weight", "model.no_such_norm.weight"),
        "begin",
        400,
        "model.no_such_norm.weight",
    ),
    "partial-layer": (
        lambda t: {"model.layers.0.self_attn.q_proj.weight": t["model.layers.0.self_attn.q_proj.weight"]},
        "commit",
        400,
        "qkv_proj",
    ),
}


@pytest.mark.parametrize("case", list(BAD_SYNCS), ids=list(BAD_SYNCS))
def test_rejected_sync_names_the_problem_and_changes_nothing(
    vllm_server: ServerProcess, tiny_model_dir_seed1: Path, seed0_restored: list[Any], case: str
) -> None:
    mutate, phase, status, named = BAD_SYNCS[case]
    version = vllm_server.health()["weight_version"]
    with pytest.raises(SyncFailed) as failed:
        sync_full(vllm_server.base_url, mutate(checkpoint_tensors(tiny_model_dir_seed1)), version + 1)
    assert (failed.value.phase, failed.value.status) == (phase, status), str(failed.value)
    assert named in failed.value.error["message"]
    assert vllm_server.health()["weight_version"] == version
    assert _answers(vllm_server) == seed0_restored


def test_missing_bucket_and_stale_version_are_refused(
    vllm_server: ServerProcess, tiny_model_dir: Path, tiny_model_dir_seed1: Path, seed0_restored: list[Any]
) -> None:
    if vllm_server.health()["weight_version"] == 0:  # make "current version" a legal manifest version
        sync_full(vllm_server.base_url, checkpoint_tensors(tiny_model_dir), 1)
    tensors = checkpoint_tensors(tiny_model_dir_seed1)
    version = vllm_server.health()["weight_version"]
    with pytest.raises(SyncFailed) as missing:
        sync_full(vllm_server.base_url, tensors, version + 1, bucket_bytes=1 << 16, skip=(1,))
    assert missing.value.phase == "commit" and 400 <= missing.value.status < 500
    assert "bucket" in missing.value.error["message"]
    buckets, _ = encode_tensors(tensors, 1 << 20)
    stale = begin_sync(vllm_server.base_url, {"mode": "full", "version": version, "buckets": buckets})
    assert stale.status_code == 409 and stale.json()["error"]["type"] == "stale_version"
    assert str(version) in stale.json()["error"]["message"]
    assert vllm_server.health()["weight_version"] == version
    assert _answers(vllm_server) == seed0_restored


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset | tuple):
        return sorted(value) if isinstance(value, set | frozenset) else list(value)
    return str(value)


def _peft_adapter(model_dir: Path) -> tuple[Any, dict[str, Any], dict[str, np.ndarray]]:
    """A random (non-zero) PEFT LoRA on q_proj/v_proj: the model, its adapter config and state dict."""
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    torch.manual_seed(0)
    config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(base, config).eval()
    state = {k: v.detach().numpy().copy() for k, v in get_peft_model_state_dict(model).items()}
    return model, json.loads(json.dumps(config.to_dict(), default=_jsonable)), state


def _hf_greedy(model: Any) -> list[list[int]]:
    outs = []
    with torch.no_grad():
        for prompt in PROMPTS:
            out = model.generate(
                torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, min_new_tokens=MAX_TOKENS, do_sample=False
            )
            outs.append(out[0, len(prompt) :].tolist())
    return outs


def test_adapter_sync_serves_the_peft_adapter(
    vllm_server_seed1: ServerProcess, tiny_model_dir_seed1: Path
) -> None:
    """vLLM serving the synced adapter == HF PEFT with the same adapter (fp32, greedy); the newest adapter is
    the default; a full sync clears the default again."""
    base = _answers(vllm_server_seed1)
    model, config, state = _peft_adapter(tiny_model_dir_seed1)
    expected = _hf_greedy(model)
    version = vllm_server_seed1.health()["weight_version"] + 1
    try:
        commit = sync_adapter(vllm_server_seed1.base_url, "policy", config, state, version)
        assert (commit["mode"], commit["weight_version"]) == ("adapter", version)
        default = infer(vllm_server_seed1.base_url, _body())
        assert {r.weight_version for r in default.results} == {version}
        assert tokens_of(default) == expected != [t for t, _ in base]
        assert tokens_of(infer(vllm_server_seed1.base_url, _body("policy"))) == expected
        unknown = infer_raw(vllm_server_seed1.base_url, _body("nope"))
        assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "unknown_adapter"
    finally:
        sync_full(vllm_server_seed1.base_url, checkpoint_tensors(tiny_model_dir_seed1), version + 1)
    assert _answers(vllm_server_seed1) == base


def test_adapter_sync_on_a_lora_less_server_is_409(vllm_server: ServerProcess, tiny_model_dir: Path) -> None:
    _, config, state = _peft_adapter(tiny_model_dir)
    version = vllm_server.health()["weight_version"]
    with pytest.raises(SyncFailed) as refused:
        sync_adapter(vllm_server.base_url, "policy", config, state, version + 1)
    assert (refused.value.phase, refused.value.status) == ("begin", 409)
    assert refused.value.error["type"] == "lora_disabled"
    assert vllm_server.health()["weight_version"] == version
    adapter_request = infer_raw(vllm_server.base_url, _body("policy"))
    assert adapter_request.status_code == 409


def test_collective_sync_whose_learner_goes_silent_changes_nothing(
    vllm_server: ServerProcess, tiny_model_dir_seed1: Path, seed0_restored: list[Any]
) -> None:
    """gloo transport, learner side driven by hand: the group forms, the first of several buckets is
    broadcast, then the learner goes silent (killed mid-sync). The commit fails once the group's timeout has
    passed, naming the transport; nothing is applied; a bucket PUT on a collective sync is refused; the next
    gloo sync forms a new group and serves the new weights."""
    from learner.rollout.client import RolloutClient
    from learner.weights.group_send import CollectiveSender, flat_bucket
    from shared_schemas.sync import SyncManifest

    tensors = checkpoint_tensors(tiny_model_dir_seed1)
    buckets, blobs = encode_tensors(tensors, 1 << 16)
    assert len(buckets) >= 3
    version = vllm_server.health()["weight_version"]
    manifest = SyncManifest.model_validate({"mode": "full", "version": version + 1, "buckets": buckets})
    sender = CollectiveSender("gloo", "127.0.0.1", timeout_s=3.0)
    with RolloutClient(vllm_server.base_url, timeout_s=60) as client:
        ranks = client.health().collective_ranks
        assert ranks == 1  # one worker (TP 1, DP 1)
        (spec,) = sender.specs([client.base_url], [ranks])
        assert (spec.world_size, spec.rank_offset) == (2, 1)
        begin = client.sync_begin(manifest, collective=spec)
        assert begin.collective_ranks == 1 and begin.collective_joining
        refused = httpx.put(
            f"{vllm_server.base_url}/sync_weights/{begin.sync_id}/buckets/0", content=blobs[0], timeout=30
        )
        assert refused.status_code == 409 and refused.json()["error"]["type"] == "collective_sync"
        sender.connect([client.base_url], [begin])
        parts = _parts(blobs[0])
        sender.broadcast(flat_bucket(parts, manifest.buckets[0].nbytes), 0)
        with pytest.raises(ServerError) as failed:  # buckets 1.. never come
            client.sync_commit(begin.sync_id)
        assert failed.value.type == "collective_failed" and "gloo" in str(failed.value)
        assert vllm_server.health()["weight_version"] == version
        assert _answers(vllm_server) == seed0_restored
        sender.close()

        sender = CollectiveSender("gloo", "127.0.0.1", timeout_s=30.0)
        begin = client.sync_begin(manifest, collective=sender.specs([client.base_url], [ranks])[0])
        assert begin.collective_joining, "the failed group was dropped: a new one is formed"
        sender.connect([client.base_url], [begin])
        for spec, blob in zip(manifest.buckets, blobs, strict=True):
            sender.broadcast(flat_bucket(_parts(blob), spec.nbytes), spec.index)
        committed = client.sync_commit(begin.sync_id)
        sender.close()
    assert committed.weight_version == version + 1 and "workers_receive_s" in committed.stages
    assert (
        _answers(vllm_server) != seed0_restored
    )  # the seed-1 weights are served (the fixture restores seed 0)


def _parts(blob: bytes) -> list[memoryview]:
    """A safetensors blob as (header, data) parts, the shape `flat_bucket` takes."""
    (header_len,) = np.frombuffer(blob[:8], dtype="<u8")
    view = memoryview(blob)
    return [view[: 8 + int(header_len)], view[8 + int(header_len) :]]
