"""``--memory-sweep``: the peak memory of a packed row's step, gradient checkpointing off and on."""

from __future__ import annotations

import torch

from .common import train_tokens_per_s


def peak_memory(model, rows, checkpointing: bool, device, coord_ids, run: dict) -> dict:
    """Peak allocated memory (GiB) and tokens/s of the second of two packed rows, checkpointing on or off."""
    was = model.is_gradient_checkpointing
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_disable()
    try:
        tps, info = train_tokens_per_s(model, rows, coord_ids, device, 1, False, **run)
    except torch.OutOfMemoryError:
        torch.cuda.empty_cache()
        return {"oom": True}
    finally:
        (model.gradient_checkpointing_enable if was else model.gradient_checkpointing_disable)()
    return {"tokens": info["tokens"], "tokens_per_s": round(tps, 1), "peak_mem_gib": info.get("peak_mem_gib")}
