"""The shm transport's files (`learner.weights.transports.shm.ShmStager`): atomic names, in-place reuse, and
the learner's parameters living in the files between syncs (never in a file a server may still read)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch
from safetensors.torch import load, save_file

from learner.weights.codec import tensor_spec
from learner.weights.sync_stream import bucket_payloads
from learner.weights.transports.shm import ShmStager
from shared_schemas.buckets import plan_buckets


def state() -> dict[str, torch.Tensor]:
    return {
        "w": torch.randn(4, 3),
        "b": torch.randn(3, dtype=torch.bfloat16),
        "i": torch.arange(5),
    }


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


def parameters() -> dict[str, torch.nn.Parameter]:
    return {
        "w": torch.nn.Parameter(torch.randn(64, 32)),
        "v": torch.nn.Parameter(torch.randn(16)),
        "e": torch.nn.Parameter(torch.randn(8, 4)),
    }


def in_file(mapped_range: tuple[int, int], tensor: torch.Tensor) -> bool:
    start, end = mapped_range
    return start <= tensor.data_ptr() < end


def spare_range(stager: ShmStager, index: int = 0) -> tuple[int, int]:
    mapped = stager._mapped[index]
    return mapped.address, mapped.address + mapped.size


def test_shared_parameters_live_in_the_file_and_the_next_sync_writes_only_the_header(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """After `share`, the parameters ARE the file's tensor bytes: training writes the file, and the next
    sync copies none of them (only the header), yet the file decodes to the current parameters."""
    params = parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(params)):
        pass
    before = {n: p.detach().clone() for n, p in params.items()}
    with caplog.at_level(logging.INFO, logger="learner.weights.transports.shm"):
        placed = stager.share(params.values())
        assert stager.share(params.values()) == 0  # nothing written since: nothing moves, nothing said
    (said,) = [r.getMessage() for r in caplog.records]
    assert "now live in the bucket files" in said and "shm_share_parameters: false" in said
    assert placed == sum(p.numel() * p.element_size() for p in params.values())
    assert all(in_file(spare_range(stager), p) for p in params.values())
    assert all(torch.equal(p, before[n]) for n, p in params.items())
    # An optimizer step writes into the file.
    for p in params.values():
        p.grad = torch.ones_like(p)
    torch.optim.AdamW(params.values(), lr=0.1).step()
    (spare,) = stager._spares.values()
    assert torch.equal(decoded(spare)["w"], params["w"].detach())
    with stager.staged(2, 0, one_bucket(params)) as name:
        got = decoded(tmp_path / name)
        assert all(torch.equal(got[n], p.detach()) for n, p in params.items())
    assert stager.shared_bytes == placed
    # One storage per parameter: a checkpoint writer does not take them for tied weights.
    save_file({n: p.detach() for n, p in params.items()}, tmp_path / "checkpoint.safetensors")
    stager.close()
    assert all(torch.isfinite(p).all() for p in params.values())  # the memory outlives the file names


def test_discard_moves_shared_parameters_back_before_training_goes_on(tmp_path: Path) -> None:
    """A failed sync may leave a server reading a file: the parameters leave it, so training never
    changes what such a server would load."""
    params = parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(params)):
        pass
    stager.share(params.values())
    with stager.staged(2, 0, one_bucket(params)) as name:
        held = tmp_path / "server-held.safetensors"
        held.hardlink_to(tmp_path / name)
    sent = decoded(held)
    stager.discard()
    assert not any(p.data_ptr() == 0 for p in params.values())
    assert all(torch.equal(p.detach(), sent[n]) for n, p in params.items())
    with torch.no_grad():
        for p in params.values():
            p.add_(1)
    assert all(torch.equal(decoded(held)[n], t) for n, t in sent.items())


def test_a_file_a_server_still_holds_is_left_and_the_parameters_move_to_the_new_one(tmp_path: Path) -> None:
    params = parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(params)) as name:
        pass
    stager.share(params.values())
    held = tmp_path / "server-held.safetensors"
    (spare,) = stager._spares.values()
    held.hardlink_to(spare)  # a server whose sync has not ended
    with stager.staged(2, 0, one_bucket(params)) as name:
        assert (tmp_path / name).stat().st_ino != held.stat().st_ino
    assert stager.shared_bytes == 0
    sent = decoded(held)
    stager.share(params.values())
    with torch.no_grad():
        params["w"].mul_(2)
    assert torch.equal(decoded(held)["w"], sent["w"])  # the held file no longer backs the parameters
    assert all(in_file(spare_range(stager), p) for p in params.values())
    stager.close()


def test_a_changed_layout_writes_a_new_file_and_never_clobbers_shared_parameters(tmp_path: Path) -> None:
    params = parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(params)):
        pass
    stager.share(params.values())
    values = {n: p.detach().clone() for n, p in params.items()}
    swapped = {"e": params["e"], "w": params["w"], "v": params["v"]}  # same bytes, other offsets
    with stager.staged(2, 0, one_bucket(swapped)) as name:
        got = decoded(tmp_path / name)
    assert all(torch.equal(got[n], values[n]) for n in values)
    assert all(torch.equal(p.detach(), values[n]) for n, p in params.items())
    assert stager.shared_bytes == 0
    stager.close()


def test_only_parameters_that_own_their_storage_and_are_aligned_are_shared(tmp_path: Path) -> None:
    flat = torch.randn(40)
    view = torch.nn.Parameter(flat[:8].view(2, 4))  # a view into a flat buffer (ZeRO-style): never moved
    odd = torch.nn.Parameter(torch.randn(3, dtype=torch.bfloat16))  # 6 bytes: the next one is misaligned
    after = torch.nn.Parameter(torch.randn(5))
    own = torch.nn.Parameter(torch.randn(4))
    tensors = {"own": own, "view": view, "odd": odd, "after": after}
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(tensors)):
        pass
    stager.share(tensors.values())
    assert in_file(spare_range(stager), own) and in_file(spare_range(stager), odd)
    assert not in_file(spare_range(stager), view) and view.data_ptr() == flat.data_ptr()
    assert not in_file(spare_range(stager), after)
    stager.close()


def test_another_models_sync_reuses_the_file_and_moves_the_shared_parameters_out(tmp_path: Path) -> None:
    """Syncing other tensors (another model) through the same stager rewrites the file in place; the
    parameters that lived in it keep their values in private memory."""
    params, other = parameters(), parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 0, one_bucket(params)):
        pass
    stager.share(params.values())
    values = {n: p.detach().clone() for n, p in params.items()}
    with stager.staged(2, 0, one_bucket(other)) as name:
        got = decoded(tmp_path / name)
    assert all(torch.equal(got[n], p.detach()) for n, p in other.items())
    assert all(torch.equal(p.detach(), values[n]) for n, p in params.items())
    assert stager.reused_bytes > 0 and stager.shared_bytes == 0
    stager.close()


def test_share_moves_only_what_the_last_sync_wrote(tmp_path: Path) -> None:
    """A bucket an earlier sync wrote holds bytes that training has changed since: its parameters stay."""
    first, second = parameters(), parameters()
    stager = ShmStager(tmp_path)
    with stager.staged(1, 1, one_bucket(first)):
        pass  # a sync that never committed (no share) ...
    with torch.no_grad():
        first["w"].add_(1)  # ... and training went on
    trained = first["w"].detach().clone()
    with stager.staged(2, 0, one_bucket(second)):
        pass
    stager.share([*first.values(), *second.values()])
    assert torch.equal(first["w"].detach(), trained)
    assert not in_file(spare_range(stager, 0), first["w"]) and 1 not in stager._mapped
    assert all(in_file(spare_range(stager, 0), p) for p in second.values())
    stager.close()
