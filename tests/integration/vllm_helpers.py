"""HTTP helpers for the real-server integration tests: `/infer/` and the `/sync_weights/` phases, speaking
only the wire schemas (no learner code), so these tests pin the server's side of the contract."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import numpy as np
from safetensors.numpy import load_file

from shared_schemas.buckets import RawTensor, encode_bucket, plan_buckets
from shared_schemas.infer import InferResponse
from shared_schemas.sync import TensorSpec

__all__ = [
    "SyncFailed",
    "begin_sync",
    "checkpoint_tensors",
    "encode_tensors",
    "infer",
    "infer_raw",
    "sync_adapter",
    "sync_full",
    "tokens_of",
]

_CODES = {np.dtype("float32"): "F32", np.dtype("float16"): "F16", np.dtype("int64"): "I64"}


class SyncFailed(AssertionError):
    """A sync phase answered non-2xx; carries the status and the error envelope."""

    def __init__(self, phase: str, response: httpx.Response) -> None:
        super().__init__(f"{phase} -> {response.status_code}: {response.text[:500]}")
        self.phase = phase
        self.status = response.status_code
        self.error = response.json().get("error", {}) if response.content else {}


def infer_raw(base_url: str, body: dict[str, Any], timeout: float = 300) -> httpx.Response:
    """POST /infer/ and return the response as is."""
    return httpx.post(f"{base_url}/infer/", json=body, timeout=timeout)


def infer(base_url: str, body: dict[str, Any], timeout: float = 300) -> InferResponse:
    """POST /infer/; asserts 200 and parses the response."""
    resp = infer_raw(base_url, body, timeout)
    assert resp.status_code == 200, resp.text[:2000]
    return InferResponse.model_validate(resp.json())


def tokens_of(response: InferResponse) -> list[list[int]]:
    """The first choice's token ids of every result."""
    return [r.choices[0].token_ids for r in response.results]


def checkpoint_tensors(model_dir: Path) -> dict[str, np.ndarray]:
    """Every tensor of a model's `model.safetensors`, by checkpoint name."""
    return load_file(str(Path(model_dir) / "model.safetensors"))


def _raw(name: str, array: np.ndarray) -> RawTensor:
    array = np.ascontiguousarray(array)
    return RawTensor(name, _CODES[array.dtype], tuple(array.shape), array.tobytes())


def encode_tensors(
    tensors: dict[str, np.ndarray], bucket_bytes: int
) -> tuple[list[dict[str, Any]], list[bytes]]:
    """Plans buckets of at most `bucket_bytes` and encodes them:
    (manifest bucket dicts, safetensors blobs)."""
    raws = {name: _raw(name, array) for name, array in tensors.items()}
    specs = [TensorSpec(name=r.name, dtype=r.dtype, shape=r.shape) for r in raws.values()]
    buckets = plan_buckets(specs, bucket_bytes)
    blobs = [encode_bucket(raws[t.name] for t in bucket.tensors) for bucket in buckets]
    return [b.model_dump(mode="json") for b in buckets], blobs


def begin_sync(base_url: str, manifest: dict[str, Any]) -> httpx.Response:
    """POST the begin phase and return the response as is."""
    return httpx.post(f"{base_url}/sync_weights/begin", json={"manifest": manifest}, timeout=60)


def _send(
    base_url: str, manifest: dict[str, Any], blobs: list[bytes], *, skip: tuple[int, ...] = ()
) -> dict[str, Any]:
    resp = begin_sync(base_url, manifest)
    if resp.status_code != 200:
        raise SyncFailed("begin", resp)
    sync_id = resp.json()["sync_id"]
    for index, blob in enumerate(blobs):
        if index in skip:
            continue
        put = httpx.put(
            f"{base_url}/sync_weights/{sync_id}/buckets/{index}",
            content=blob,
            headers={"content-type": "application/octet-stream"},
            timeout=120,
        )
        if put.status_code != 200:
            raise SyncFailed(f"bucket {index}", put)
    commit = httpx.post(f"{base_url}/sync_weights/commit", json={"sync_id": sync_id}, timeout=300)
    if commit.status_code != 200:
        raise SyncFailed("commit", commit)
    return commit.json()


def sync_full(
    base_url: str,
    tensors: dict[str, np.ndarray],
    version: int,
    *,
    bucket_bytes: int = 256 * 1024,
    skip: tuple[int, ...] = (),
) -> dict[str, Any]:
    """A full sync over HTTP (begin → buckets → commit); returns the commit response.

    Args:
        skip: bucket indices NOT to upload (to provoke a missing-bucket rejection).

    Raises:
        SyncFailed: a phase answered non-2xx.
    """
    buckets, blobs = encode_tensors(tensors, bucket_bytes)
    return _send(base_url, {"mode": "full", "version": version, "buckets": buckets}, blobs, skip=skip)


def sync_adapter(
    base_url: str, name: str, config: dict[str, Any], tensors: dict[str, np.ndarray], version: int
) -> dict[str, Any]:
    """An adapter sync over HTTP; returns the commit response.

    Raises:
        SyncFailed: a phase answered non-2xx (409 `lora_disabled` on a LoRA-less server).
    """
    buckets, blobs = encode_tensors(tensors, 1 << 20)
    manifest = {
        "mode": "adapter",
        "version": version,
        "buckets": buckets,
        "adapter_name": name,
        "adapter_config": config,
    }
    return _send(base_url, manifest, blobs)
