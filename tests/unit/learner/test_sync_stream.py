"""Learner-side bucket streaming (`learner.rollout.sync_stream`): zero-copy parts, prefetch, shm files."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from safetensors.torch import load

from learner.rollout.base import SyncError
from learner.rollout.sync_stream import ShmStager, bucket_payloads, prefetched
from learner.weights.codec import tensor_spec
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


def one_bucket(tensors: dict[str, torch.Tensor]) -> list[memoryview]:
    buckets = plan_buckets([tensor_spec(n, t) for n, t in tensors.items()], 1 << 20)
    ((_, parts),) = list(bucket_payloads(buckets, tensors.items()))
    return parts


def decoded(path: Path) -> dict[str, torch.Tensor]:
    return load(path.read_bytes())


def test_shm_stager_writes_parts_and_removes_the_name(tmp_path: Path) -> None:
    tensors = state()
    stager = ShmStager(tmp_path)
    with stager.staged(3, 0, one_bucket(tensors)) as name:
        assert load((tmp_path / name).read_bytes()).keys() == tensors.keys()
    assert [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")] == []
    stager.close()
    assert list(tmp_path.iterdir()) == []


def test_shm_stager_rewrites_a_released_file_in_place(tmp_path: Path) -> None:
    """The next sync's bucket k goes into the same inode (its pages already allocated), with the new bytes,
    also when the bucket's size changes."""
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(state())) as name:
        first = (tmp_path / name).stat().st_ino
    for version, tensors in enumerate([state(), {"w": torch.randn(40, 3)}, {"w": torch.randn(2)}], start=2):
        with stager.staged(version, 0, one_bucket(tensors)) as name:
            assert (tmp_path / name).stat().st_ino == first
            got = decoded(tmp_path / name)
            assert got.keys() == tensors.keys()
            assert all(torch.equal(got[n], t) for n, t in tensors.items())
    assert stager.reused_bytes > 0
    stager.close()
    assert list(tmp_path.iterdir()) == []


def test_shm_stager_never_rewrites_a_file_a_server_still_holds(tmp_path: Path) -> None:
    """A server's hard link (its sync not ended) keeps the old bytes: the stager writes a new file instead."""
    stager = ShmStager(tmp_path)
    old = state()
    held = tmp_path / "server-held.safetensors"
    with stager.staged(1, 0, one_bucket(old)) as name:
        held.hardlink_to(tmp_path / name)  # what a server's adopt does
    new = state()
    with stager.staged(2, 0, one_bucket(new)) as name:
        assert (tmp_path / name).stat().st_ino != held.stat().st_ino
        assert torch.equal(decoded(tmp_path / name)["w"], new["w"])
    assert torch.equal(decoded(held)["w"], old["w"])
    assert stager.reused_bytes == 0


def test_shm_stager_discard_forgets_the_spares(tmp_path: Path) -> None:
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(state())):
        pass
    stager.discard()
    assert list(tmp_path.iterdir()) == []
    with stager.staged(2, 0, one_bucket(state())):
        pass
    assert stager.reused_bytes == 0
