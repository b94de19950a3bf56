"""Learner-side bucket streaming (`learner.weights.sync_stream`): zero-copy parts, prefetch."""

from __future__ import annotations

import threading

import pytest
import torch
from safetensors.torch import load

from learner.weights.codec import tensor_spec
from learner.weights.sync_stream import bucket_payloads, prefetched
from learner.weights.types import SyncError
from shared_schemas.buckets import plan_buckets


def state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(4, 3),
        "b": torch.randn(3, dtype=torch.bfloat16),
        "i": torch.arange(5),
    }


def test_parts_are_the_safetensors_file_and_view_the_tensors() -> None:
    tensors = state()
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors.items()], 1 << 20)
    ((bucket, parts),) = list(bucket_payloads(buckets, tensors.items()))
    assert load(b"".join(bytes(p) for p in parts)).keys() == tensors.keys()
    decoded = load(b"".join(bytes(p) for p in parts))
    assert all(torch.equal(decoded[n], t) for n, t in tensors.items())
    tensors["w"].add_(1)  # views, not copies
    assert torch.equal(load(b"".join(bytes(p) for p in parts))["w"], tensors["w"])


def test_out_of_order_tensor_raises() -> None:
    tensors = state()
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors.items()], 1 << 20)
    with pytest.raises(SyncError, match="expected tensor 'w'"):
        list(bucket_payloads(buckets, reversed(list(tensors.items()))))


def test_prefetched_keeps_order_and_raises_in_place() -> None:
    assert list(prefetched(iter(range(10)))) == list(range(10))

    def failing():
        yield 1
        raise RuntimeError("export failed")

    out = prefetched(failing())
    assert next(out) == 1
    with pytest.raises(RuntimeError, match="export failed"):
        next(out)


def test_prefetched_stops_its_producer_when_closed_early() -> None:
    produced = []

    def endless():
        i = 0
        while True:
            produced.append(i)
            yield i
            i += 1

    out = prefetched(endless())
    assert next(out) == 0
    out.close()
    assert not [t for t in threading.enumerate() if t.name == "sync-prefetch"]
    assert len(produced) <= 4  # depth 1: the producer never ran far ahead
