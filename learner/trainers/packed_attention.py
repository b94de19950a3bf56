"""Attention for the learner's teacher-forced forward: one causal SDPA call per packed segment, no mask.

Why: a packed row (`learner.batching.packed_batch.pack_segments`) holds k segments of a micro-batch in one
padding-free row. With `attn_implementation="sdpa"` transformers isolates them with a block-diagonal mask of
the WHOLE row, `[1, 1, T, T]` — built once per forward (T² bytes) and then attended in full: every query
scores all T keys, so attention costs T² instead of the segments' Σ Lᵢ², and SDPA with an arbitrary mask
cannot use the flash kernel. On a CPU with an 8k-token row of 16 image segments the forward took 10 s where
the same segments right-padded took ~1 s. Flash-attention's varlen kernel avoids this on GPUs that have it;
this module does the same with plain SDPA, for every device:

- packed rows (the forward receives `cu_seq_lens_q`, which
  `PackedBatch.model_inputs(flash_varlen_kwargs=True)` passes): per segment `[cu[i], cu[i+1])`, one
  `scaled_dot_product_attention(..., is_causal=True)` — exactly the attention the segment gets alone;
- right-padded rows (`pad_segments`): one causal SDPA call over the batch with NO mask: a real token at
  position p attends to positions ≤ p, which are all real (padding only follows), so real tokens are exact and
  padding positions, which no loss reads, are don't-care;
- mask construction is skipped entirely (the registered mask function returns None).

It is therefore ONLY valid for the learner's own training forwards (right padding or packing, never left
padding, never a KV cache): `packed_attention(model)` switches the language model to it for the duration of a
`with` block and restores the configured implementation after — rollouts (the colocated HF decode loop, left
padded) never see it. `stage2.loss.segment_attention: false` turns it off (transformers' own `sdpa` with the
block-diagonal mask). Checked against `sdpa` (padded and packed, text and Qwen-VL, values and gradients) in
tests/integration/test_packed_equivalence.py and tests/integration/test_vl_packing.py.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

__all__ = ["SEGMENT_SDPA", "packed_attention", "segment_sdpa"]

SEGMENT_SDPA = "rollmatch_segment_sdpa"
"""Attention-implementation name under which `segment_sdpa` is registered with transformers."""

_registered = False
_lock = threading.Lock()


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function (see the module docstring).

    Args:
        query: `(B, H, T, D)`; key, value: `(B, H_kv, T, D)` (no KV cache: keys are the row's own tokens).
        attention_mask: ignored (None: the registered mask function builds none).
        kwargs: `cu_seq_lens_q` (int32 `[k + 1]` segment bounds of a packed row, `B == 1`) when packed.

    Returns:
        `((B, T, H, D) attention output, None)`, as transformers' `sdpa_attention_forward`.
    """
    if key.shape[2] != query.shape[2]:
        raise RuntimeError(
            f"{SEGMENT_SDPA} serves teacher-forced forwards only (query {query.shape[2]} tokens vs "
            f"{key.shape[2]} keys: a KV cache?); rollouts must run with the model's own attention"
        )
    gqa = key.shape[1] != query.shape[1]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        out = F.scaled_dot_product_attention(
            query, key, value, dropout_p=dropout, scale=scaling, is_causal=causal, enable_gqa=gqa
        )
    else:
        if query.shape[0] != 1:
            raise RuntimeError(f"a packed row has batch size 1, got {query.shape[0]}")
        bounds = cu.tolist()
        out = torch.cat(
            [
                F.scaled_dot_product_attention(
                    query[:, :, a:b],
                    key[:, :, a:b],
                    value[:, :, a:b],
                    dropout_p=dropout,
                    scale=scaling,
                    is_causal=causal,
                    enable_gqa=gqa,
                )
                for a, b in zip(bounds[:-1], bounds[1:], strict=True)
            ],
            dim=2,
        )
    return out.transpose(1, 2).contiguous(), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """`SEGMENT_SDPA`'s mask function: causality comes from `is_causal`, isolation from the segment bounds."""
    return None


def _register() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(SEGMENT_SDPA, segment_sdpa)
        AttentionMaskInterface.register(SEGMENT_SDPA, _no_mask)
        _registered = True


def _text_configs(model: torch.nn.Module) -> list[Any]:
    """The config whose `_attn_implementation` the language model reads: a VL model's `text_config` (its
    vision tower keeps its own attention), else the model's config."""
    base = model
    while hasattr(base, "module"):  # DDP / DeepSpeed engine wrappers
        base = base.module
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    text = getattr(base.config, "text_config", None)
    return [text if text is not None else base.config]


_CUDA_BACKENDS = [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH]
"""SDPA kernels allowed on CUDA: every backend but cuDNN, which builds (and caches) one execution graph per
new sequence length — a packed row calls attention once per segment, nearly every one a new length. Measured
on an H100 with a Qwen3-VL-2B-shaped model: packed ÷ padded tokens/s 0.63× with cuDNN allowed, 1.34× without
(bench/RESULTS.md)."""


@contextlib.contextmanager
def packed_attention(model: torch.nn.Module, *, enabled: bool = True) -> Iterator[None]:
    """Runs the block with `SEGMENT_SDPA` as the language model's attention (and no cuDNN SDPA on CUDA).

    Wrap the forward AND the backward: gradient checkpointing re-runs the forward during the backward, which
    must attend the same way (the trainer wraps its whole `training_step`). Nested blocks are no-ops, so the
    trainer's step and `forward_for_loss` inside it compose. Only models configured for `sdpa` are switched
    (eager is a debugging choice; flash-attention has varlen already). Not for concurrent use of one model
    from several threads: the trainer's step is single-threaded.
    """
    configs = [c for c in _text_configs(model) if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not enabled or not configs:
        yield
        return
    _register()
    cuda = any(p.is_cuda for p in itertools.islice(model.parameters(), 1))
    kernels = sdpa_kernel(_CUDA_BACKENDS) if cuda else contextlib.nullcontext()
    for config in configs:
        config._attn_implementation = SEGMENT_SDPA
    try:
        with kernels:
            yield
    finally:
        for config in configs:
            config._attn_implementation = "sdpa"
