"""Worker-side mapping of staged bucket files (`rollout_server.engines.vllm.worker.map_safetensors`)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest
import torch
from safetensors.torch import save

from rollout_server.engines.vllm.worker import WeightLoadExtension, map_safetensors


def test_maps_every_dtype_without_copy(tmp_path: Path) -> None:
    tensors = {
        "a": torch.arange(12, dtype=torch.float32).reshape(3, 4),
        "b": torch.randn(5, dtype=torch.bfloat16),
        "c": torch.tensor([1, 2, 3], dtype=torch.int64),
        "odd": torch.tensor([7], dtype=torch.uint8),  # pushes the next tensor off its alignment
        "d": torch.randn(2, 2, dtype=torch.float16),
        "empty": torch.empty(0, 4),
    }
    path = tmp_path / "b.safetensors"
    path.write_bytes(save(tensors))
    mapped = dict(map_safetensors(str(path)))
    assert set(mapped) == set(tensors)
    for name, tensor in tensors.items():
        assert mapped[name].dtype == tensor.dtype and torch.equal(mapped[name], tensor), name


def test_bad_offsets_are_refused(tmp_path: Path) -> None:
    header = b'{"w":{"dtype":"F32","shape":[4],"data_offsets":[0,32]}}'
    path = tmp_path / "bad.safetensors"
    path.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 16)
    with pytest.raises(ValueError, match="do not hold"):
        map_safetensors(str(path))


def test_symlink_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "t.safetensors"
    target.write_bytes(save({"a": torch.zeros(2)}))
    (tmp_path / "link").symlink_to(target)
    with pytest.raises(OSError):
        map_safetensors(str(tmp_path / "link"))


def test_stage_files_then_discard(tmp_path: Path) -> None:
    path = tmp_path / "b.safetensors"
    path.write_bytes(save({"a": torch.ones(3)}))
    worker = WeightLoadExtension()
    assert worker.rollmatch_stage_files([str(path)]) == 1
    assert worker.rollmatch_stage_files([str(path)]) == 2  # one call per bucket adds up
    assert worker.rollmatch_discard_weights() is True and worker.rollmatch_discard_weights() is False
