"""Worker side of a vLLM weight update (`rollout_server.engines.vllm.worker`): mapping staged bucket files,
the commit path's choice, and the in-place commit against a model with vLLM's `load_weights` contract (the
real engine's commit runs in `tests/integration/test_vllm_sync.py`; the in-place one on CUDA in
`tests/gpu/test_colocate_ipc.py`)."""

from __future__ import annotations

import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import save

from rollout_server.engines.vllm.worker import (
    WeightLoadExtension,
    commit_path,
    load_in_place,
    map_safetensors,
)


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


@pytest.mark.parametrize(
    ("device", "lora", "quantized", "path"),
    [
        ("cuda", False, False, "in_place"),
        ("cpu", False, False, "reload"),  # CPU packing replaces linear weights: nothing to copy into
        ("cuda", True, False, "reload"),  # LoRA: base weights under base_layer
        ("cuda", False, True, "reload"),  # quantized: served from a processed copy
    ],
)
def test_commit_path_is_in_place_only_where_it_is_exact(device, lora, quantized, path) -> None:
    assert commit_path(device, lora=lora, quantized=quantized) == path


class _FusedModel(torch.nn.Module):
    """vLLM's `load_weights` contract: checkpoint names → fused slots of live parameters (q/k/v → qkv),
    and a tied head that shares the embedding's parameter (its checkpoint name is skipped)."""

    def __init__(self) -> None:
        super().__init__()
        self.qkv = torch.nn.Parameter(torch.zeros(6, 2), requires_grad=False)
        self.embed = torch.nn.Parameter(torch.zeros(4, 2), requires_grad=False)
        self.lm_head = self.embed  # tied

    def load_weights(self, weights: Any) -> set[str]:
        loaded = set()
        for name, tensor in weights:
            if name == "lm_head.weight":
                continue
            if name in ("q", "k", "v"):
                shard = "qkv".index(name)
                self.qkv.data[2 * shard : 2 * shard + 2].copy_(tensor)
                loaded.add("qkv")
            else:
                self.embed.data.copy_(tensor)
                loaded.add("embed")
        return loaded


def test_in_place_commit_fills_fused_slots_and_the_tied_head_keeping_the_parameters() -> None:
    model = _FusedModel()
    qkv_before, embed_before = model.qkv, model.embed
    staged = [(n, torch.full((2, 2), float(i + 1), dtype=torch.bfloat16)) for i, n in enumerate("qkv")]
    staged.append(("embed.weight", torch.arange(8, dtype=torch.float32).reshape(4, 2)))
    plan, via = load_in_place(model, staged)
    assert via == "load_weights" and plan is not None  # the first commit records where each tensor landed
    assert model.qkv is qkv_before and model.embed is embed_before  # copied into, never replaced
    assert model.qkv[:, 0].tolist() == [1, 1, 2, 2, 3, 3]  # cast from bf16 into the fp32 parameter
    assert torch.equal(model.lm_head, torch.arange(8, dtype=torch.float32).reshape(4, 2))
    again = [(n, t + 10) for n, t in staged]
    assert load_in_place(model, again, plan)[1] == "plan"  # the next one replays it
    assert model.qkv[:, 0].tolist() == [11, 11, 12, 12, 13, 13] and model.lm_head[0, 0] == 10


def _worker(device: str, model: torch.nn.Module, reloads: list[Any]) -> WeightLoadExtension:
    worker = WeightLoadExtension()
    worker.device = torch.device(device) if device == "cpu" else SimpleNamespace(type=device)  # type: ignore[attr-defined]
    worker.model_runner = SimpleNamespace(
        vllm_config=SimpleNamespace(lora_config=None, model_config=SimpleNamespace(quantization=None)),
        get_model=lambda: model,
        reload_weights=lambda weights_iterator, is_checkpoint_format: reloads.append(list(weights_iterator)),
    )
    return worker


@pytest.mark.parametrize(("device", "reloaded"), [("cuda", False), ("cpu", True)])
def test_commit_takes_the_chosen_path_and_forgets_the_stage(tmp_path: Path, device, reloaded) -> None:
    path = tmp_path / "b.safetensors"
    path.write_bytes(save({"embed.weight": torch.ones(4, 2)}))
    model, reloads = _FusedModel(), []
    worker = _worker(device, model, reloads)
    worker.rollmatch_stage_files([str(path)])
    report = worker.rollmatch_commit_weights()
    assert report["tensors"] == 1 and report["via"] == ("reload" if reloaded else "load_weights")
    assert bool(reloads) == reloaded and bool(model.embed.sum()) != reloaded
    assert worker.rollmatch_discard_weights() is False  # nothing left staged
    with pytest.raises(RuntimeError, match="stage them first"):
        worker.rollmatch_commit_weights()
