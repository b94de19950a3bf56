"""`AdapterStore`: PEFT folders on disk, fresh LoRA ids, the default adapter."""

from __future__ import annotations

import json
from pathlib import Path

from rollout_server.engines.base import AdapterUpdate
from rollout_server.engines.vllm.adapters import AdapterStore, adapter_rank


def _update(name: str, version: int) -> AdapterUpdate:
    return AdapterUpdate(
        version=version,
        adapter_name=name,
        adapter_config={"r": 4, "peft_type": "LORA"},
        adapter_safetensors=b"blob",
    )


def test_written_folder_is_a_peft_adapter_with_a_fresh_id(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path / "adapters")
    first = store.write(_update("pol/icy", 3))
    second = store.write(_update("pol/icy", 4))
    folder = Path(first.lora_path)
    assert folder.parent == tmp_path / "adapters" and "/" not in folder.name
    assert json.loads((folder / "adapter_config.json").read_text())["r"] == 4
    assert (folder / "adapter_model.safetensors").read_bytes() == b"blob"
    assert first.lora_int_id != second.lora_int_id and first.lora_path != second.lora_path


def test_serving_sets_the_default_and_returns_the_replaced_adapter(tmp_path: Path) -> None:
    store = AdapterStore(tmp_path)
    assert store.resolve(None) is None and store.names == ()
    a1 = store.write(_update("a", 1))
    assert store.serve("a", a1) is None
    assert store.resolve(None) is a1 and store.resolve("a") is a1
    b2 = store.write(_update("b", 2))
    store.serve("b", b2)
    assert store.resolve(None) is b2 and store.resolve("a") is a1 and store.names == ("a", "b")
    a3 = store.write(_update("a", 3))
    assert store.serve("a", a3) is a1
    store.delete(a1)
    assert not Path(a1.lora_path).exists()
    store.clear_default()
    assert store.resolve(None) is None and store.resolve("b") is b2
    store.close()
    assert not tmp_path.exists()


def test_adapter_rank_reads_r_and_rank_pattern() -> None:
    assert adapter_rank({"r": 8}) == 8
    assert adapter_rank({"r": 8, "rank_pattern": {"q_proj": 32}}) == 32
    assert adapter_rank({}) is None
