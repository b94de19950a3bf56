"""Worker-side half of the vLLM weight update: mixed into vLLM's worker class (`worker_extension_cls`).

It runs inside every vLLM worker process (one per tensor-parallel rank), reached through
`AsyncLLM.collective_rpc(LOAD_METHOD, args=(buckets,))`. Tensors travel as safetensors bytes (DESIGN.md §6:
plain tensors would arrive as lists, and pickle is never used). Every bucket is decoded before the first
parameter is touched, so a corrupt bucket changes nothing; the load itself goes through vLLM's in-place
`reload_weights`, which maps checkpoint names (fused qkv / gate_up, tied heads, LoRA base layers, the
vision tower) exactly as loading the checkpoint from disk does.

Keep this module light: vLLM imports it by qualified name in every worker.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LOAD_METHOD", "WORKER_EXTENSION", "WeightLoadExtension"]

LOAD_METHOD = "rollmatch_load_safetensors"
"""Name of the worker method `collective_rpc` calls."""
WORKER_EXTENSION = f"{__name__}.WeightLoadExtension"
"""Qualified name passed to vLLM as `worker_extension_cls`."""


class WeightLoadExtension:
    """Adds `rollmatch_load_safetensors` to the vLLM worker (needs the worker's `model_runner`)."""

    model_runner: Any

    def rollmatch_load_safetensors(self, buckets: list[bytes]) -> int:
        """Loads every tensor of every safetensors bucket into the served model, in place.

        Args:
            buckets: safetensors-encoded buckets; names are the checkpoint's (HF) parameter names.

        Returns:
            The number of tensors loaded.
        """
        import torch
        from safetensors.torch import load

        tensors: list[tuple[str, torch.Tensor]] = []
        for bucket in buckets:
            tensors.extend(load(bytes(bucket)).items())
        with torch.no_grad():
            self.model_runner.reload_weights(weights_iterator=iter(tensors), is_checkpoint_format=True)
        return len(tensors)
