"""`AdapterStore`: synced PEFT adapters as vLLM `LoRARequest`s
(docs/ARCHITECTURE.md#sync-weights, `mode: adapter`).

Each adapter sync is written as a PEFT folder (`adapter_config.json` + `adapter_model.safetensors`) under a
private temp directory, one folder per (name, version), and gets a fresh LoRA int id, so vLLM never serves a
stale cached copy. Requests naming an adapter get its latest version; after an adapter sync the newest
adapter is also the default for requests that name none; a full sync clears that default (its weights
already hold the merged adapter).
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path
from typing import Any

from rollout_server.engines.base import AdapterUpdate

__all__ = ["AdapterStore", "adapter_rank"]


def adapter_rank(adapter_config: dict[str, Any]) -> int | None:
    """The largest LoRA rank an adapter config asks for (`r` and any `rank_pattern` value), if stated."""
    ranks = [adapter_config["r"]] if isinstance(adapter_config.get("r"), int) else []
    pattern = adapter_config.get("rank_pattern") or {}
    if isinstance(pattern, dict):
        ranks += [v for v in pattern.values() if isinstance(v, int)]
    return max(ranks) if ranks else None


def _safe_name(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:64] or "adapter"


class AdapterStore:
    """Adapter folders on disk and the `LoRARequest` serving each adapter name."""

    def __init__(self, root: Path | None = None) -> None:
        self._root = Path(root) if root is not None else Path(tempfile.mkdtemp(prefix="rollmatch-adapters-"))
        self._root.mkdir(parents=True, exist_ok=True)
        self._served: dict[str, Any] = {}
        self._default: str | None = None
        self._next_id = 1

    @property
    def names(self) -> tuple[str, ...]:
        """Adapter names that requests may use."""
        return tuple(self._served)

    def resolve(self, name: str | None) -> Any:
        """The `LoRARequest` for a request's `adapter` (None → the default adapter, or no LoRA)."""
        key = name if name is not None else self._default
        return self._served.get(key) if key is not None else None

    def write(self, update: AdapterUpdate) -> Any:
        """Writes the adapter folder (atomically) and returns a new, not yet served `LoRARequest`."""
        from vllm.lora.request import LoRARequest

        folder = self._root / f"{_safe_name(update.adapter_name)}-v{update.version}"
        tmp = folder.with_name(folder.name + ".tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        (tmp / "adapter_config.json").write_text(json.dumps(update.adapter_config))
        (tmp / "adapter_model.safetensors").write_bytes(update.adapter_safetensors)
        shutil.rmtree(folder, ignore_errors=True)
        tmp.rename(folder)
        lora = LoRARequest(
            lora_name=f"{update.adapter_name}-v{update.version}",
            lora_int_id=self._next_id,
            lora_path=str(folder),
        )
        self._next_id += 1
        return lora

    def serve(self, name: str, lora: Any) -> Any:
        """Makes `lora` the adapter `name` and the default; returns the `LoRARequest` replaced (or None)."""
        previous = self._served.get(name)
        self._served[name] = lora
        self._default = name
        return previous

    def clear_default(self) -> None:
        """Requests naming no adapter use the base weights again (after a full sync)."""
        self._default = None

    @staticmethod
    def delete(lora: Any) -> None:
        """Removes an adapter folder from disk."""
        shutil.rmtree(lora.lora_path, ignore_errors=True)

    def close(self) -> None:
        """Removes every adapter folder."""
        shutil.rmtree(self._root, ignore_errors=True)
