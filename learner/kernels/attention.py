"""Attention for the learner's teacher-forced forward: each packed segment attends only to itself, no mask.

Why: a packed row (`learner.batching.packed_batch.pack_segments`) holds k segments of a micro-batch in one
padding-free row. With `attn_implementation="sdpa"` transformers isolates them with a block-diagonal mask of
the WHOLE row, `[1, 1, T, T]` — built once per forward (T² bytes) and then attended in full: every query
scores all T keys, so attention costs T² instead of the segments' Σ Lᵢ², and SDPA with an arbitrary mask
cannot use the flash kernel (figures: bench/RESULTS.md, "Figures moved out of the code"). This module
attends per segment instead, for every device:

- packed rows (the forward receives `cu_seq_lens_q`, which
  `PackedBatch.model_inputs(flash_varlen_kwargs=True)` passes): on CUDA in bf16/fp16, ONE call of a varlen
  kernel over the whole row (`learner.kernels.varlen`: `model.varlen_kernel`, `auto` = FlashAttention-4
  where it imports and passes its check, else PyTorch's FlashAttention-2 op), driven by the row's cumulative
  segment lengths — no Python loop over segments, no host sync. Elsewhere (CPU, float32, no kernel, or every
  kernel failing its one-time check against the fallback on this device) the fallback
  (`varlen.segment_loop`): per segment `[cu[i], cu[i+1])` one `scaled_dot_product_attention(...,
  is_causal=True)` — exactly the attention the segment gets alone;
- right-padded rows (`pad_segments`): one causal SDPA call over the batch with NO mask: a real token at
  position p attends to positions ≤ p, which are all real (padding only follows), so real tokens are exact and
  padding positions, which no loss reads, are don't-care;
- the vision tower of a Qwen-VL model (its blocks attend within each image, bounds in the tower's own
  `cu_seqlens`): the same varlen call, non-causal, under `VISION_VARLEN`, instead of transformers' loop of one
  SDPA call per image per block; the fallback is the same per-image SDPA;
- mask construction is skipped entirely (the registered mask function returns None).

It is therefore ONLY valid for the learner's own training forwards (right padding or packing, never left
padding, never a KV cache): `packed_attention(model)` switches the language model (and a vision tower) to it
for the duration of a `with` block and restores the configured implementation after — rollouts (the colocated
HF decode loop, left padded) never see it. The kernel choice travels in the implementation's name
(`attention_name`: one registered function per choice), not in module state, since the backward (and the
forward that gradient checkpointing re-runs in it) runs on autograd's own threads.
`stage2.loss.segment_attention: false` turns it off (transformers' own `sdpa` with the block-diagonal mask).
Checked against `sdpa` (padded and packed, text and Qwen-VL, values and gradients) in
tests/integration/test_packed_equivalence.py and tests/integration/test_vl_packing.py; the varlen path against
the fallback in tests/unit/learner/test_packed_attention.py (layout, GQA, causality, with a stand-in kernel on
CPU) and by `bench/bench_packing.py --gpu --vlm` on CUDA (loss and gradients).
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from learner.kernels.varlen import VARLEN_KERNEL_NAMES, first_kernel, segment_loop, varlen_attention
from shared_schemas.torch_common.sdpa import NO_CUDNN_SDPA_BACKENDS

__all__ = [
    "SEGMENT_SDPA",
    "VARLEN_CHOICES",
    "VISION_VARLEN",
    "attention_functions",
    "attention_name",
    "packed_attention",
    "register_attention_functions",
    "segment_sdpa",
    "varlen_available",
    "varlen_kernel",
]

SEGMENT_SDPA = "rollmatch_segment_sdpa"
"""Attention-implementation name of `segment_sdpa` in transformers' registry (language model, kernel
`auto`; `attention_name` gives the others)."""

VISION_VARLEN = "rollmatch_flash_varlen_vision"
"""The same function's name for a vision tower. Transformers hands a vision tower's `cu_seqlens` to its
attention function only when the implementation's name contains "flash" (`is_flash_attention_requested`);
other names get one call per image. Only ever set on a vision config, never on a language model's."""

VARLEN_CHOICES: tuple[str, ...] = ("auto", *VARLEN_KERNEL_NAMES, "")
"""What a packed row may attend through: `auto` (the first of `VARLEN_KERNEL_NAMES` that runs here), one
named kernel, or "" (the per-segment loop, `packed_attention(varlen=False)`)."""


def attention_name(base: str, choice: str) -> str:
    """The registered name of `segment_sdpa` with varlen `choice` (one of `VARLEN_CHOICES`) for `base`
    (`SEGMENT_SDPA` or `VISION_VARLEN`): `base` itself for `auto`, else suffixed by the kernel or `loop`."""
    return base if choice == "auto" else f"{base}_{choice or 'loop'}"


def varlen_kernel(
    query: torch.Tensor, key: torch.Tensor | None = None, *, causal: bool = True, choice: str = "auto"
) -> str | None:
    """The varlen kernel a packed row of `query`'s device and dtype (and `key`'s head count: grouped-query
    attention or not; None = as many heads) attends through under `choice` (one of `VARLEN_CHOICES`), or
    None for the per-segment loop: CUDA, bf16 or fp16, head size ≤ 256 and a multiple of 8, the first kernel
    of the choice (`auto`: `VARLEN_KERNEL_NAMES` in order) that is present and checked for this configuration
    (`varlen.first_kernel`), and `choice` not "" (`packed_attention(..., varlen=False)`)."""
    if not (choice and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return None
    d = query.shape[-1]
    if d > 256 or d % 8:
        return None
    gqa = key is not None and key.shape[1] != query.shape[1]
    return first_kernel(choice, query.device, query.dtype, (d, causal, gqa))


def varlen_available(query: torch.Tensor) -> bool:
    """Whether a packed row of `query`'s device and dtype attends through a varlen kernel under `auto`
    (`varlen_kernel`)."""
    return varlen_kernel(query) is not None


def segment_sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    is_causal: bool | None = None,
    *,
    varlen_choice: str = "auto",
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function (see the module docstring).

    Args:
        query: `(B, H, T, D)`; key, value: `(B, H_kv, T, D)` (no KV cache: keys are the row's own tokens).
        attention_mask: ignored (None: the registered mask function builds none).
        varlen_choice: what a packed row attends through (one of `VARLEN_CHOICES`); bound per registered
            name (`attention_functions`).
        kwargs: `cu_seq_lens_q` (int32 `[k + 1]` segment bounds of a packed row, `B == 1`) and
            `max_length_q` (longest segment, tokens) when packed.

    Returns:
        `((B, T, H, D) attention output, None)`, as transformers' `sdpa_attention_forward`.
    """
    if key.shape[2] != query.shape[2]:
        raise RuntimeError(
            f"{SEGMENT_SDPA} serves teacher-forced forwards only (query {query.shape[2]} tokens vs "
            f"{key.shape[2]} keys: a KV cache?); rollouts must run with the model's own attention"
        )
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    cu = kwargs.get("cu_seq_lens_q")
    if cu is None:
        out = F.scaled_dot_product_attention(
            query,
            key,
            value,
            dropout_p=dropout,
            scale=scaling,
            is_causal=causal,
            enable_gqa=key.shape[1] != query.shape[1],
        )
        return out.transpose(1, 2).contiguous(), None
    if query.shape[0] != 1:
        raise RuntimeError(f"a packed row has batch size 1, got {query.shape[0]}")
    kernel = varlen_kernel(query, key, causal=causal, choice=varlen_choice) if dropout == 0.0 else None
    if kernel is not None:
        max_len = kwargs.get("max_length_q")
        max_len = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        out = varlen_attention(query, key, value, cu, max_len, causal=causal, scaling=scaling, kernel=kernel)
        return out, None
    return segment_loop(query, key, value, cu, causal=causal, scaling=scaling, dropout=dropout), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """`SEGMENT_SDPA`'s mask function: causality comes from `is_causal`, isolation from the segment bounds."""
    return None


def attention_functions() -> dict[str, Callable[..., tuple[torch.Tensor, None]]]:
    """`segment_sdpa` with each varlen choice, by the name `packed_attention` registers it under (both
    towers' names for every one of `VARLEN_CHOICES`)."""
    return {
        attention_name(base, choice): functools.partial(segment_sdpa, varlen_choice=choice)
        for base in (SEGMENT_SDPA, VISION_VARLEN)
        for choice in VARLEN_CHOICES
    }


@functools.cache
def register_attention_functions() -> None:
    """Registers `attention_functions` (and a mask function that builds no mask) with transformers, once per
    process; `packed_attention` calls it."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    for name, function in attention_functions().items():
        AttentionInterface.register(name, function)
        AttentionMaskInterface.register(name, _no_mask)


def _configs(model: torch.nn.Module) -> tuple[Any, Any | None]:
    """`(language config, vision config or None)`: the configs whose `_attn_implementation` the language
    model and a VL model's vision tower read (a text model's own config, no vision)."""
    base = model
    while hasattr(base, "module"):  # DDP / DeepSpeed engine wrappers
        base = base.module
    base = base.get_base_model() if hasattr(base, "get_base_model") else base
    text = getattr(base.config, "text_config", None)
    return (text if text is not None else base.config), getattr(base.config, "vision_config", None)


_ROW_BOUNDS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k")


def _drop_row_bounds(module: torch.nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Vision-tower pre-hook: drops the packed row's segment bounds from the tower's keyword arguments. They
    belong to the language model, but some transformers releases (5.17) pass the whole model's keyword
    arguments on into the tower, whose varlen branch then gets `cu_seq_lens_q` twice (its own images' too)."""
    return args, {k: v for k, v in kwargs.items() if k not in _ROW_BOUNDS}


def _vision_tower(model: torch.nn.Module, vision_config: Any) -> torch.nn.Module | None:
    """The module whose config is `vision_config` (a VL model's vision tower)."""
    return next((m for m in model.modules() if getattr(m, "config", None) is vision_config), None)


@contextlib.contextmanager
def packed_attention(
    model: torch.nn.Module, *, enabled: bool = True, varlen: bool = True, kernel: str = "auto"
) -> Iterator[None]:
    """Runs the block with `SEGMENT_SDPA` as the language model's attention, `VISION_VARLEN` as a vision
    tower's (the names of this kernel choice, `attention_name`), and no cuDNN SDPA on CUDA.

    Wrap the forward AND the backward: gradient checkpointing re-runs the forward during the backward, which
    must attend the same way (the trainer wraps its whole `training_step`). Nested blocks are no-ops, so the
    trainer's step and `forward_for_loss` inside it compose. Only configs set to `sdpa` are switched (eager
    is a debugging choice; flash-attention has varlen already). Not for concurrent use of one model from
    several threads: the trainer's step is single-threaded.

    Args:
        model: the (possibly wrapped) model.
        enabled: False runs the block unchanged (`stage2.loss.segment_attention: false`).
        varlen: False keeps the per-segment SDPA loop even where the varlen kernel runs (benches' baseline).
        kernel: `model.varlen_kernel`: `auto` (the first of `VARLEN_KERNEL_NAMES` that runs here) or one of
            them.
    """
    if kernel != "auto" and kernel not in VARLEN_KERNEL_NAMES:
        raise ValueError(f"varlen kernel {kernel!r}: use auto or one of {', '.join(VARLEN_KERNEL_NAMES)}")
    choice = kernel if varlen else ""
    text, vision = _configs(model)
    bases = ((text, SEGMENT_SDPA), (vision, VISION_VARLEN))
    switch = [(c, attention_name(base, choice)) for c, base in bases if c is not None]
    switch = [(c, name) for c, name in switch if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not enabled or not any(c is text for c, _ in switch):
        yield
        return
    register_attention_functions()
    tower = _vision_tower(model, vision) if any(c is vision for c, _ in switch) else None
    hook = tower.register_forward_pre_hook(_drop_row_bounds, with_kwargs=True) if tower is not None else None
    cuda = any(p.is_cuda for p in itertools.islice(model.parameters(), 1))
    kernels = sdpa_kernel(NO_CUDNN_SDPA_BACKENDS) if cuda else contextlib.nullcontext()
    for config, name in switch:
        config._attn_implementation = name
    try:
        with kernels:
            yield
    finally:
        for config, _ in switch:
            config._attn_implementation = "sdpa"
        if hook is not None:
            hook.remove()
