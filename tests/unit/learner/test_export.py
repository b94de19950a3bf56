"""Weight export for syncs (docs/ALGORITHM.md#sync-cadence): base-model names, merged values, always
unmerged."""

from __future__ import annotations

import copy
import json
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM

from learner.weights.codec import dtype_code
from learner.weights.export import (
    adapter_state,
    exported_state,
    full_state_items,
    full_state_specs,
    merged_adapters,
)


def load_base(model_dir: Path) -> torch.nn.Module:
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)


def lora_model(model_dir: Path, *, use_dora: bool = False, modules_to_save: list[str] | None = None):
    model = get_peft_model(
        load_base(model_dir),
        LoraConfig(
            r=4,
            lora_alpha=8,
            target_modules=["q_proj", "v_proj", "down_proj"],
            modules_to_save=modules_to_save,
            use_dora=use_dora,
        ),
    )
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            # lora_B starts at zero (merge would be a no-op); make the adapter matter.
            if "lora_B" in name or "lora_magnitude" in name:
                param.add_(0.05 * torch.randn(param.shape, generator=gen))
    return model


def untied_names(model: torch.nn.Module) -> list[str]:
    """State-dict names with each tensor once (a tied duplicate only under its first name)."""
    seen: set[int] = set()
    names = []
    for name, tensor in model.state_dict().items():
        if tensor.data_ptr() not in seen:
            seen.add(tensor.data_ptr())
            names.append(name)
    return names


def weights_snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_plain_model_exports_its_state_dict(tiny_model_dir: Path) -> None:
    model = load_base(tiny_model_dir)
    with merged_adapters(model):
        items = list(full_state_items(model))
    reference = model.state_dict()
    assert [n for n, _ in items] == untied_names(model)
    assert all(torch.equal(t, reference[n]) for n, t in items)


def test_a_tied_head_is_sent_once_under_the_embedding_name(tiny_model_dir: Path) -> None:
    model = load_base(tiny_model_dir)
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tiny model ties them
    names = [n for n, _ in full_state_items(model)]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    assert len(names) == len(model.state_dict()) - 1
    assert [s.name for s in full_state_specs(model)] == names


@pytest.mark.parametrize("use_dora", [False, True], ids=["lora", "dora"])
def test_lora_export_names_and_merged_values(tiny_model_dir: Path, use_dora: bool) -> None:
    model = lora_model(tiny_model_dir, use_dora=use_dora)
    base_names = untied_names(load_base(tiny_model_dir))
    reference = copy.deepcopy(model).merge_and_unload().state_dict()
    before = weights_snapshot(model)

    with merged_adapters(model):
        # Items are views of the live weights: copy them before the block unmerges.
        items = {name: t.clone() for name, t in full_state_items(model)}

    assert list(items) == base_names  # wrapper prefix stripped, .base_layer dropped, no lora_ key
    assert not any("lora_" in n or "base_layer" in n for n in items)
    for name in base_names:
        torch.testing.assert_close(items[name], reference[name], rtol=1e-5, atol=1e-6, msg=name)
    # The adapter changed the exported q_proj (the merge really happened) ...
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(
        items[q], before[f"base_model.model.{q.replace('.weight', '.base_layer.weight')}"]
    )
    # ... and the live model is unmerged again, bit for bit (merge + unmerge alone is not exact).
    assert not any(getattr(m, "merged", False) for m in model.modules())
    after = weights_snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items())


def test_unmerged_also_when_the_body_raises(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    before = weights_snapshot(model)
    with pytest.raises(RuntimeError, match="send failed"), merged_adapters(model):
        assert any(getattr(m, "merged", False) for m in model.modules())
        raise RuntimeError("send failed")
    assert not any(getattr(m, "merged", False) for m in model.modules())
    after = weights_snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items())


def test_modules_to_save_exports_the_trained_copy(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir, modules_to_save=["norm"])
    names = list(model.state_dict())
    assert any("modules_to_save" in n for n in names) and any("original_module" in n for n in names)
    with torch.no_grad():
        model.base_model.model.model.norm.modules_to_save["default"].weight.fill_(3.0)
    with merged_adapters(model):
        items = dict(full_state_items(model))
    assert list(items) == untied_names(load_base(tiny_model_dir))
    assert torch.equal(items["model.norm.weight"], torch.full_like(items["model.norm.weight"], 3.0))
    assert not any("modules_to_save" in n or "original_module" in n for n in items)


def test_specs_match_items_and_dtype_cast(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    specs = full_state_specs(model, torch.bfloat16)
    with merged_adapters(model):
        items = list(full_state_items(model, torch.bfloat16))
    assert [s.name for s in specs] == [n for n, _ in items]
    assert all(
        s.dtype == dtype_code(t.dtype) == "BF16" and s.shape == tuple(t.shape)
        for s, (_, t) in zip(specs, items, strict=True)
    )


def test_zero3_style_gather_groups_by_bucket(tiny_model_dir: Path) -> None:
    """With an injected gather (what DeepSpeed's GatheredParameters does under ZeRO-3): every parameter is
    gathered exactly once, groups stay within the bucket bound, yielded tensors are copies."""
    model = load_base(tiny_model_dir)
    groups: list[list[int]] = []
    live = {id(p) for p in model.parameters()}

    @contextmanager
    def gather(params):
        groups.append([id(p) for p in params])
        yield

    bucket = 200_000
    items = list(full_state_items(model, gather=gather, bucket_bytes=bucket))
    assert [n for n, _ in items] == untied_names(model)
    gathered = [pid for group in groups for pid in group]
    assert set(gathered) == live and len(groups) > 1
    params = {id(p): p for p in model.parameters()}
    for group in groups:
        size = sum(params[pid].numel() * 4 for pid in group)
        assert len(group) == 1 or size <= bucket
    state = model.state_dict()
    for name, tensor in items:
        assert torch.equal(tensor, state[name]) and tensor.data_ptr() != state[name].data_ptr()


def test_adapter_state(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir)
    config, state = adapter_state(model)
    json.dumps(config)  # JSON-able: it travels in the sync manifest
    assert config["r"] == 4 and sorted(config["target_modules"]) == ["down_proj", "q_proj", "v_proj"]
    assert state and all("lora_" in k and ".default." not in k for k in state)
    assert all(k.startswith("base_model.model.") for k in state)
    with pytest.raises(ValueError, match="PEFT"):
        adapter_state(load_base(tiny_model_dir))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_streamed_merge_equals_the_in_place_merge_and_never_touches_the_model(
    tiny_model_dir: Path, dtype: torch.dtype
) -> None:
    """Plain LoRA merges on the fly: the same bits as PEFT's merge, no snapshot,
    no merge of the live model."""
    model = lora_model(tiny_model_dir, modules_to_save=["lm_head"]).to(dtype)
    before = weights_snapshot(model)
    with merged_adapters(model):
        reference = {name: t.clone() for name, t in full_state_items(model)}
    with exported_state(model) as items:
        streamed = {}
        for name, tensor in items:
            assert not any(getattr(m, "merged", False) for m in model.modules())
            streamed[name] = tensor
    assert list(streamed) == list(reference)
    assert all(torch.equal(streamed[n], reference[n]) for n in reference)
    after = weights_snapshot(model)
    assert all(torch.equal(after[n], v) for n, v in before.items())


def test_dora_falls_back_to_the_in_place_merge(tiny_model_dir: Path) -> None:
    model = lora_model(tiny_model_dir, use_dora=True)
    with exported_state(model) as items:
        assert any(getattr(m, "merged", False) for m in model.modules())  # merged inside the block
        names = [n for n, _ in items]
    assert not any(getattr(m, "merged", False) for m in model.modules())
    assert names == [s.name for s in full_state_specs(model)]
