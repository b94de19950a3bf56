"""Attention while decoding with a transformers model: the kernels a one-token step may use, and grouped-query
attention over the KV cache without copying it.

A batched rollout decodes one token per row per step. With left padding every step carries an additive mask,
and transformers' `sdpa` path then cannot hand grouped-query attention (GQA) to the kernel (`enable_gqa` is
only taken without a mask on CUDA): it copies the KV cache `num_key_value_groups` times (`repeat_kv`), in
every layer, at every step. An unpadded single-row rollout takes no mask and no copy, so a padded batch of 32
paid 4-20 % more per step than one row, on a step that is launch-bound anyway.

For a one-token query the copy is unnecessary: the `G` query heads that share one KV head can be laid out as
`G` queries of that KV head (`(B, H, 1, D)` viewed as `(B, H_kv, G, D)`), attended in one SDPA call with the
row's `(B, 1, 1, T)` mask broadcast over them, and the output viewed back as `(B, 1, H, D)` (query head
`h = kv_head * G + g`, the layout `repeat_kv` uses). Same arithmetic, no copy, no transpose, no per-layer
mask slice when the caller's mask already has the cache's length. Any other call (prefill, no mask, no GQA,
dropout, position bias, paged cache) goes to transformers' own `sdpa_attention_forward` unchanged.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn.attention import sdpa_kernel

from shared_schemas.torch_common.sdpa import NO_CUDNN_SDPA_BACKENDS

__all__ = ["GROUPED_DECODE_SDPA", "decode_attention", "grouped_decode_sdpa"]

GROUPED_DECODE_SDPA = "rollmatch_grouped_decode_sdpa"
"""Attention-implementation name under which `grouped_decode_sdpa` is registered with transformers."""

_registered = False
_register_lock = threading.Lock()
# Configs whose implementation is swapped right now, by identity, with how many decodes hold them (an
# HF engine group may decode on several threads with one model).
_swapped: dict[int, int] = {}


def grouped_decode_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function: GQA decode steps without `repeat_kv`, all else as `sdpa`.

    Args:
        query: `(B, H, Q, D)`; the grouped path needs `Q == 1`.
        key, value: `(B, H_kv, T, D)`, the whole cache.
        attention_mask: `(B, 1, 1, >= T)` additive or bool mask, or None.

    Returns:
        `((B, Q, H, D) attention output, None)`, as transformers' `sdpa_attention_forward`.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    if (
        query.shape[2] != 1
        or groups == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("cache") is not None
        or key.shape[1] * groups != query.shape[1]
    ):
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            is_causal=is_causal,
            **kwargs,
        )
    batch, heads, _, head_dim = query.shape
    kv_len = key.shape[-2]
    if attention_mask.shape[-1] != kv_len:
        attention_mask = attention_mask[..., :kv_len]
    grouped = query.reshape(batch, key.shape[1], groups, head_dim)
    out = torch.nn.functional.scaled_dot_product_attention(
        grouped, key, value, attn_mask=attention_mask, scale=scaling
    )
    return out.reshape(batch, 1, heads, value.shape[-1]), None


def _register() -> bool:
    """Registers `grouped_decode_sdpa` (and sdpa's mask builder) under `GROUPED_DECODE_SDPA`; False when this
    transformers has no attention / mask registries (then decoding keeps plain `sdpa`)."""
    global _registered
    with _register_lock:
        if not _registered:
            try:
                from transformers import AttentionInterface
                from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
            except ImportError:
                return False
            AttentionInterface.register(GROUPED_DECODE_SDPA, grouped_decode_sdpa)
            # Prefill passes a 2D padding mask: without a mask builder under this name transformers would
            # silently drop it.
            AttentionMaskInterface.register(GROUPED_DECODE_SDPA, sdpa_mask)
            _registered = True
    return True


def _configs(config: object) -> Iterator[object]:
    """A config and all its sub-configs (a VL model's text and vision configs)."""
    yield config
    for name in getattr(config, "sub_configs", {}) or {}:
        sub = getattr(config, name, None)
        if sub is not None:
            yield from _configs(sub)


@contextlib.contextmanager
def _grouped_decode(model: torch.nn.Module) -> Iterator[None]:
    """Switches a model whose every (sub-)config uses `sdpa` to `grouped_decode_sdpa` for the block.

    The switch is on the shared config objects, so the same model trained on another thread at the same
    time would also use it; that is harmless (non-decode calls are exactly `sdpa`). Nested and concurrent
    decodes of one model share one switch, restored by the last to leave.
    """
    config = getattr(model, "config", None)
    if config is None or not _register():
        yield
        return
    with _register_lock:
        holders = _swapped.get(id(config), 0)
        swap = holders > 0 or all(
            getattr(c, "_attn_implementation", None) == "sdpa" for c in _configs(config)
        )
        if swap:
            if holders == 0:
                config._attn_implementation = GROUPED_DECODE_SDPA
            _swapped[id(config)] = holders + 1
    if not swap:
        yield
        return
    try:
        yield
    finally:
        with _register_lock:
            _swapped[id(config)] -= 1
            if _swapped[id(config)] == 0:
                del _swapped[id(config)]
                config._attn_implementation = "sdpa"


@contextlib.contextmanager
def decode_attention(model: torch.nn.Module, device: torch.device) -> Iterator[None]:
    """The attention set-up of a decode loop: no cuDNN SDPA on CUDA, grouped GQA decode steps on any device.

    CPU kernel dispatch is left to PyTorch. Models not on `sdpa` (eager, flash, flex) are left unchanged.
    """
    kernels = sdpa_kernel(NO_CUDNN_SDPA_BACKENDS) if device.type == "cuda" else contextlib.nullcontext()
    with kernels, _grouped_decode(model):
        yield
