"""The HF backend behind a real uvicorn server process, with the real tiny Qwen2 model (no mocks).

Checks the wire schema, request order, prompt ids equal to the tokenizer's chat template, greedy tokens
equal to `transformers.generate`, full-weight sync over HTTP and shm (the seed-1 model's weights make the
server answer like the seed-1 model), `/health` answering during a long generation, and images refused by a
text-only checkpoint.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from shared_schemas.buckets import RawTensor, encode_bucket, plan_buckets
from shared_schemas.health import Health
from shared_schemas.infer import InferResponse
from shared_schemas.sync import TensorSpec
from shared_schemas.torch_common.gpu_ids import FAKE_GPU_UUIDS_ENV

FAKE_SERVER_GPU = "GPU-fake-server-0"

pytestmark = pytest.mark.integration

REPO = Path(__file__).resolve().parents[2]
SYSTEM = {"role": "system", "content": "You are an open-vocabulary object detector."}
MESSAGES = [
    [SYSTEM, {"role": "user", "content": [{"type": "text", "text": "List every object in the image."}]}],
    [{"role": "user", "content": "hello"}],
    [SYSTEM, {"role": "user", "content": 'Reply with one JSON object: {"object_1": <|coord_12|>'}],
]
CODES = {torch.float32: "F32", torch.bfloat16: "BF16", torch.float16: "F16"}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """A real `python -m rollout_server` (backend hf) on a free loopback port; stopped by its own pid."""
    tmp = tmp_path_factory.mktemp("hf_server")
    shm = tmp / "shm"
    port = free_port()
    cfg = tmp / "server.yaml"
    cfg.write_text(
        f"server:\n  model: {tiny_model_dir}\n  backend: hf\n  dtype: float32\n  port: {port}\n"
        f"  shm_dir: {shm}\n  hf: {{batch_size: 4}}\n  vllm: {{max_model_len: 1024}}\n"
    )
    log = (tmp / "server.log").open("w")
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    env[FAKE_GPU_UUIDS_ENV] = FAKE_SERVER_GPU  # the server "computes on" a GPU, also on a CPU host
    proc = subprocess.Popen(
        [sys.executable, "-m", "rollout_server", "--config", str(cfg)],
        cwd=REPO,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=env,
        start_new_session=True,
    )
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    try:
        while True:
            assert proc.poll() is None, (tmp / "server.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "server not healthy within 120 s"
            time.sleep(0.25)
        yield base, shm
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture(scope="module")
def hf_model(tiny_model_dir: Path) -> Any:
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def infer(base: str, body: dict[str, Any], timeout: float = 120) -> InferResponse:
    resp = httpx.post(f"{base}/infer/", json=body, timeout=timeout)
    assert resp.status_code == 200, resp.text
    return InferResponse.model_validate(resp.json())


def greedy(model: Any, prompt: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_health(server: tuple[str, Path], tiny_model_dir: Path) -> None:
    base, _ = server
    for path in ("/health", "/health/"):
        health = Health.model_validate(httpx.get(base + path, timeout=5).json())
        assert (health.status, health.engine, health.dp, health.tp, health.lora_enabled) == (
            "ok",
            "hf",
            1,
            1,
            False,
        )
        assert health.model == str(Path(tiny_model_dir).resolve()) and health.max_model_len == 1024
        assert health.gpu_uuids == [FAKE_SERVER_GPU]


@pytest.mark.parametrize(("learner_gpu", "refused"), [(FAKE_SERVER_GPU, True), ("GPU-another", False)])
def test_nccl_learner_on_the_servers_gpu_is_refused_at_start(
    server: tuple[str, Path], monkeypatch: pytest.MonkeyPatch, learner_gpu: str, refused: bool
) -> None:
    from learner.rollout import server_source
    from learner.yaml_loader import ConfigError

    base, _ = server
    monkeypatch.setattr(server_source, "learner_gpu_uuids", lambda: [learner_gpu])
    with server_source.ServerRolloutSource([base], transport="nccl") as source:
        if refused:
            with pytest.raises(ConfigError, match="NCCL cannot put two ranks on one GPU"):
                source.wait_healthy(30)
        else:
            assert source.wait_healthy(30).status == "ok"


def test_schema_order_prompt_ids_and_greedy_tokens(
    server: tuple[str, Path], tiny_tokenizer: Any, hf_model: Any
) -> None:
    base, _ = server
    body = {
        "infer_requests": [{"messages": m, "request_id": f"id-{i}"} for i, m in enumerate(MESSAGES)]
        + [{"prompt_token_ids": [1, 96, 102, 212], "request_id": "raw"}],
        "request_config": {"max_tokens": 12, "temperature": 0.0},
        "first_index": 40,
    }
    out = infer(base, body)
    assert [r.index for r in out.results] == [40, 41, 42, 43]
    assert [r.request_id for r in out.results] == ["id-0", "id-1", "id-2", "raw"]
    for messages, result in zip(MESSAGES, out.results, strict=False):
        expected = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)[
            "input_ids"
        ]
        assert result.prompt_token_ids == list(expected)
    assert out.results[3].prompt_token_ids == [1, 96, 102, 212]
    for result in out.results:
        (choice,) = result.choices
        assert choice.token_ids == greedy(hf_model, result.prompt_token_ids, 12)
        assert choice.finish_reason in {"stop", "length"}
        assert choice.text == tiny_tokenizer.decode(choice.token_ids, skip_special_tokens=True)
        assert result.weight_version == out.weight_version


def test_sampling_is_reproducible_and_chunk_invariant(server: tuple[str, Path]) -> None:
    base, _ = server
    requests = [{"messages": m} for m in MESSAGES]
    config = {"max_tokens": 10, "temperature": 1.0, "seed": 1234, "n": 2}
    whole = infer(base, {"infer_requests": requests, "request_config": config})
    tail = infer(base, {"infer_requests": requests[1:], "request_config": config, "first_index": 1})
    assert [r.choices for r in whole.results[1:]] == [r.choices for r in tail.results]
    assert whole.results[0].choices[0].token_ids != whole.results[0].choices[1].token_ids


def test_prompt_too_long_is_400_and_server_stays_up(server: tuple[str, Path]) -> None:
    base, _ = server
    body = {
        "infer_requests": [{"prompt_token_ids": [5] * 1000}],
        "request_config": {"max_tokens": 100},
        "first_index": 3,
    }
    resp = httpx.post(f"{base}/infer/", json=body, timeout=30)
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "prompt_too_long"
    assert "request 3" in resp.json()["error"]["message"]
    assert httpx.get(f"{base}/health", timeout=5).status_code == 200


def test_health_answers_during_long_generation(server: tuple[str, Path]) -> None:
    base, _ = server
    body = {
        "infer_requests": [{"prompt_token_ids": [1, 2, 3]}] * 2,
        "request_config": {"max_tokens": 300, "ignore_eos": True, "temperature": 0.0},
    }
    done = threading.Event()
    worker = threading.Thread(target=lambda: (infer(base, body, timeout=300), done.set()))
    worker.start()
    answered_while_busy = 0
    while not done.is_set() and worker.is_alive():
        resp = httpx.get(f"{base}/health", timeout=5)
        if not done.is_set():
            assert resp.status_code == 200
            answered_while_busy += 1
        time.sleep(0.05)
    worker.join(300)
    assert answered_while_busy >= 1


def state_buckets(model_dir: Path, bucket_bytes: int) -> tuple[dict[str, Any], list[bytes]]:
    """A learner-side full sync built from the seed-1 checkpoint with the torch-free codec."""
    from safetensors.torch import load_file

    state = load_file(str(model_dir / "model.safetensors"))
    items = {
        name: RawTensor(name, CODES[t.dtype], tuple(t.shape), t.contiguous().view(torch.uint8).numpy())
        for name, t in state.items()
    }
    specs = [TensorSpec(name=n, dtype=t.dtype, shape=t.shape) for n, t in items.items()]
    buckets = plan_buckets(specs, bucket_bytes)
    blobs = [encode_bucket([items[t.name] for t in b.tensors]) for b in buckets]
    return {"mode": "full", "buckets": [b.model_dump() for b in buckets]}, blobs


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_full_sync_switches_to_new_weights(
    server: tuple[str, Path], tiny_model_dir_seed1: Path, transport: str
) -> None:
    from transformers import AutoModelForCausalLM

    base, shm = server
    version = httpx.get(f"{base}/health", timeout=5).json()["weight_version"] + 1
    manifest, blobs = state_buckets(tiny_model_dir_seed1, 64 * 1024)
    assert len(blobs) > 1
    begin = httpx.post(
        f"{base}/sync_weights/begin", json={"manifest": {**manifest, "version": version}}, timeout=30
    )
    assert begin.status_code == 200, begin.text
    sync_id = begin.json()["sync_id"]
    for i, blob in enumerate(blobs):
        if transport == "http":
            resp = httpx.put(f"{base}/sync_weights/{sync_id}/buckets/{i}", content=blob, timeout=30)
        else:
            (shm / f"{sync_id}-{i}.safetensors").write_bytes(blob)
            resp = httpx.post(
                f"{base}/sync_weights/{sync_id}/buckets/{i}/shm",
                json={"file_name": f"{sync_id}-{i}.safetensors"},
                timeout=30,
            )
        assert resp.status_code == 200, resp.text
    commit = httpx.post(f"{base}/sync_weights/commit", json={"sync_id": sync_id}, timeout=60)
    assert commit.status_code == 200, commit.text
    assert commit.json()["weight_version"] == version
    seed1 = AutoModelForCausalLM.from_pretrained(tiny_model_dir_seed1, dtype=torch.float32).eval()
    out = infer(base, {"infer_requests": [{"messages": MESSAGES[0]}], "request_config": {"max_tokens": 12}})
    result = out.results[0]
    assert result.weight_version == version and out.weight_version == version
    assert result.choices[0].token_ids == greedy(seed1, result.prompt_token_ids, 12)


def test_images_sent_to_a_text_model_are_a_400(server: tuple[str, Path]) -> None:
    """A text-only checkpoint takes no images: the same 400 as a vLLM server of a text model (the HF backend
    serves images for a vision-language checkpoint: tests/integration/test_vllm_image.py)."""
    base, _ = server
    body = {
        "infer_requests": [
            {"messages": MESSAGES[1]},
            {"messages": [{"role": "user", "content": [{"type": "image", "image": "/x.png"}]}]},
        ],
        "request_config": {"max_tokens": 4},
        "first_index": 6,
    }
    resp = httpx.post(f"{base}/infer/", json=body, timeout=30)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "images_unsupported" and "request 7" in error["message"]
