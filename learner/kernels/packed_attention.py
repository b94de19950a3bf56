"""Attention for the learner's teacher-forced forward: each packed segment attends only to itself, no mask.

Why: a packed row (`learner.batching.packed_batch.pack_segments`) holds k segments of a micro-batch in one
padding-free row. With `attn_implementation="sdpa"` transformers isolates them with a block-diagonal mask of
the WHOLE row, `[1, 1, T, T]` — built once per forward (T² bytes) and then attended in full: every query
scores all T keys, so attention costs T² instead of the segments' Σ Lᵢ², and SDPA with an arbitrary mask
cannot use the flash kernel. On a CPU with an 8k-token row of 16 image segments the forward took 10 s where
the same segments right-padded took ~1 s. This module attends per segment instead, for every device:

- packed rows (the forward receives `cu_seq_lens_q`, which
  `PackedBatch.model_inputs(flash_varlen_kwargs=True)` passes): on CUDA in bf16/fp16, ONE call of a varlen
  flash kernel over the whole row, driven by the row's cumulative segment lengths — no Python loop over
  segments, no host sync. The kernel (`model.varlen_kernel`, `VARLEN_KERNELS`): FlashAttention-4's
  (`learner.trainers.fa4_varlen`, Hopper and Blackwell, the optional `flash-attn-4` wheel; the compiled 8k
  image step of a 2B Qwen3-VL 1.10x faster on an H200) where it imports and passes its
  check, else PyTorch's own (`torch.nn.attention.varlen.varlen_attn`, FlashAttention-2 kernels). Elsewhere
  (CPU, float32, no kernel, or every kernel failing its one-time check against the fallback on this
  device) the fallback: per segment
  `[cu[i], cu[i+1])` one `scaled_dot_product_attention(..., is_causal=True)` — exactly the attention the
  segment gets alone;
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
HF decode loop, left padded) never see it. `stage2.loss.segment_attention: false` turns it off (transformers'
own `sdpa` with the block-diagonal mask). Checked against `sdpa` (padded and packed, text and Qwen-VL, values
and gradients) in tests/integration/test_packed_equivalence.py and tests/integration/test_vl_packing.py; the
varlen path against the fallback in tests/unit/learner/test_packed_attention.py (layout, GQA, causality, with
a stand-in kernel on CPU) and by `bench/bench_packing.py --gpu --vlm` on CUDA (loss and gradients).
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch.nn.attention import sdpa_kernel

from learner.trainers.fa4_varlen import fa4_supported, fa4_varlen
from shared_schemas.torch_common.sdpa import NO_CUDNN_SDPA_BACKENDS

__all__ = [
    "SEGMENT_SDPA",
    "VARLEN_KERNELS",
    "VISION_VARLEN",
    "packed_attention",
    "register_attention_functions",
    "segment_loop",
    "segment_sdpa",
    "varlen_attention",
    "varlen_available",
    "varlen_kernel",
]

logger = logging.getLogger(__name__)

SEGMENT_SDPA = "rollmatch_segment_sdpa"
"""Attention-implementation name of `segment_sdpa` in transformers' registry (language model)."""

VISION_VARLEN = "rollmatch_flash_varlen_vision"
"""The same function's name for a vision tower. Transformers hands a vision tower's `cu_seqlens` to its
attention function only when the implementation's name contains "flash" (`is_flash_attention_requested`);
other names get one call per image. Only ever set on a vision config, never on a language model's."""

_registered = False
_lock = threading.Lock()
VARLEN_KERNELS = ("fa4", "torch")
"""Varlen kernels in the order `model.varlen_kernel: auto` tries them: FlashAttention-4 (`fa4_varlen`), then
PyTorch's varlen op."""

_use_varlen = ["auto"]
"""The varlen kernel choice (`auto` or one of `VARLEN_KERNELS`; empty = the per-segment loop), set by
`packed_attention(varlen=..., kernel=...)`. A module global, not a context variable: the backward (and the
forward that gradient checkpointing re-runs in it) runs on autograd's own threads."""
_varlen_checked: dict[tuple, bool] = {}
"""`(kernel, device, dtype, head size, causal, grouped kv heads)` -> whether that kernel runs that
configuration there and matches the fallback (`_varlen_works`)."""


@functools.cache
def _varlen_op() -> tuple[Callable[..., torch.Tensor], frozenset[str]] | None:
    """`(torch.nn.attention.varlen.varlen_attn, its keyword parameters)`, or None where this torch lacks it.
    Its API moved between releases: causality as `is_causal` (first) or `window_size` (later), `scale` and
    `enable_gqa` only in later ones; `varlen_attention` adapts to what is there. Cached: it runs in every
    attention layer of every forward."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn, frozenset(inspect.signature(varlen_attn).parameters)


def varlen_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    max_len: int,
    *,
    causal: bool,
    scaling: float | None,
    kernel: str = "torch",
) -> torch.Tensor:
    """One varlen flash call over a packed row.

    Args:
        query: `(1, H, T, D)`; key, value: `(1, H_kv, T, D)`, H a multiple of H_kv.
        cu: `[k + 1]` segment bounds (any int dtype, any device).
        max_len: longest segment (tokens).
        causal: causal within each segment (language model) or full (vision tower).
        scaling: softmax scale; None = `D ** -0.5`.
        kernel: one of `VARLEN_KERNELS`.

    Returns:
        `(1, T, H, D)`.
    """
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) views
    cu = cu.to(device=q.device, dtype=torch.int32)
    if kernel == "fa4":
        return fa4_varlen(q, k, v, cu, max_len, causal=causal, scale=scaling).unsqueeze(0)
    op = _varlen_op()
    assert op is not None
    fn, params = op
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    kw: dict[str, Any] = {}
    if "window_size" in params:
        kw["window_size"] = (-1, 0) if causal else (-1, -1)
    else:
        kw["is_causal"] = causal
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kw["enable_gqa"] = True
        else:  # SDPA's enable_gqa grouping: query head h reads kv head h // (H / H_kv)
            group = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    if "scale" in params:
        kw["scale"] = scaling
    elif scaling is not None and abs(scaling * q.shape[-1] ** 0.5 - 1.0) > 1e-6:
        q = q * (scaling * q.shape[-1] ** 0.5)
    out = fn(q, k, v, cu, cu, max_len, max_len, **kw)
    return out.unsqueeze(0)


def segment_loop(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    cu: torch.Tensor,
    *,
    causal: bool,
    scaling: float | None,
    dropout: float,
) -> torch.Tensor:
    """The fallback: one SDPA call per segment; `(1, T, H, D)` like `varlen_attention`."""
    gqa = key.shape[1] != query.shape[1]
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
    return out.transpose(1, 2).contiguous()


def _kernel_present(kernel: str, device: torch.device) -> str:
    """Why `kernel` cannot run on `device` at all (empty: it can; its values are checked separately)."""
    if kernel == "fa4":
        return "" if fa4_supported(device) else "flash-attn-4 not importable or the GPU is not SM 9.x/10.x"
    if kernel == "torch":
        return "" if _varlen_op() is not None else "this torch has no torch.nn.attention.varlen"
    raise ValueError(f"unknown varlen kernel {kernel!r}; known: {', '.join(VARLEN_KERNELS)}")


@torch.compiler.disable
def _varlen_works(
    device: torch.device,
    dtype: torch.dtype,
    kernel: str = "torch",
    config: tuple[int, bool, bool] = (64, True, True),
) -> bool:
    """Whether varlen `kernel` runs on `device` in `dtype` and matches the fallback in values and gradients,
    for one attention configuration `(head size, causal, grouped kv heads)` — the one about to be served,
    so a kernel that compiles per configuration (FA4) compiles just what training uses. Checked once per
    (kernel, device, dtype, configuration); a failure is logged once and the next kernel (or the fallback)
    serves from then on. A kernel that is not installed is skipped with an info line."""
    tag = (kernel, str(device), dtype, *config)
    if tag not in _varlen_checked:
        ok, why = True, _kernel_present(kernel, device)
        if why:
            logger.info("varlen kernel %s not used on %s: %s", kernel, device, why)
            _varlen_checked[tag] = False
            return False
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            cu = torch.tensor([0, 5, 37, 96], dtype=torch.int32, device=device)
            d, causal, gqa = config
            heads_kv = 2 if gqa else 4
            shapes = ((1, 4, 96, d), (1, heads_kv, 96, d), (1, heads_kv, 96, d))
            leaves = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
            outs, grads = [], []
            for fn in (varlen_attention, segment_loop):
                xs = [t.clone().requires_grad_(True) for t in leaves]
                kw = {"kernel": kernel} if fn is varlen_attention else {"dropout": 0.0}
                args = (cu, 59) if fn is varlen_attention else (cu,)  # 59: the longest segment
                out = fn(*xs, *args, causal=causal, scaling=None, **kw)
                out.float().square().sum().backward()
                outs.append(out.detach().float())
                grads.append([x.grad.float() for x in xs])
            errs = [(outs[0] - outs[1]).norm() / outs[1].norm()]
            errs += [(a - b).norm() / b.norm() for a, b in zip(grads[0], grads[1], strict=True)]
            worst = max(float(e) for e in errs)
            if not worst < 2e-2:
                ok, why = False, f"relative error {worst:.3g} vs per-segment SDPA ({config=})"
        except Exception as err:  # noqa: BLE001 - any failure means: use the fallback, and say why
            ok, why = False, f"{type(err).__name__}: {err}"
        if ok:
            shape = dict(zip(("head_size", "causal", "grouped_kv"), config, strict=True))
            logger.info("varlen attention kernel %s serves %s on %s in %s", kernel, shape, device, dtype)
        else:
            logger.warning(
                "varlen attention kernel %s unusable on %s in %s (%s); packed rows use the next kernel of "
                "%s, else attend per segment in a loop (slower, same values). Upgrade torch (its "
                "torch.nn.attention.varlen) or flash-attn-4, or set model.varlen_kernel to another kernel.",
                kernel,
                device,
                dtype,
                why[:300],
                VARLEN_KERNELS,
            )
        _varlen_checked[tag] = ok
    return _varlen_checked[tag]


def varlen_kernel(
    query: torch.Tensor,
    key: torch.Tensor | None = None,
    *,
    causal: bool = True,
    choice: str | None = None,
) -> str | None:
    """The varlen kernel a packed row of `query`'s device and dtype (and `key`'s head count: grouped-query
    attention or not; None = as many heads) attends through (see the module docstring), or None for the
    per-segment loop: CUDA, bf16 or fp16, head size ≤ 256 and a multiple of 8, the first kernel of the
    choice (`auto`: `VARLEN_KERNELS` in order) that is present and checked for this configuration, and not
    turned off by `packed_attention(..., varlen=False)`. `choice`: that of the enclosing `packed_attention`
    unless given."""
    choice = _use_varlen[0] if choice is None else choice
    if not (choice and query.is_cuda and query.dtype in (torch.bfloat16, torch.float16)):
        return None
    d = query.shape[-1]
    if d > 256 or d % 8:
        return None
    gqa = key is not None and key.shape[1] != query.shape[1]
    return _first_kernel(choice, query.device, query.dtype, (d, causal, gqa))


def _first_kernel(
    choice: str, device: torch.device, dtype: torch.dtype, config: tuple[int, bool, bool]
) -> str | None:
    """The first kernel of `choice` (`auto`: `VARLEN_KERNELS` in order) that runs on `device` in `dtype` and
    passed its check there for `config` (`_varlen_works`), or None."""
    for kernel in VARLEN_KERNELS if choice == "auto" else (choice,):
        # Checked already: a plain lookup, so a compiled block does not break its graph at the (disabled)
        # check.
        known = _varlen_checked.get((kernel, str(device), dtype, *config))
        if known if known is not None else _varlen_works(device, dtype, kernel, config):
            return kernel
    return None


def varlen_available(query: torch.Tensor) -> bool:
    """Whether a packed row of `query`'s device and dtype attends through a varlen kernel
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
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """Transformers attention function (see the module docstring).

    Args:
        query: `(B, H, T, D)`; key, value: `(B, H_kv, T, D)` (no KV cache: keys are the row's own tokens).
        attention_mask: ignored (None: the registered mask function builds none).
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
    kernel = varlen_kernel(query, key, causal=causal) if dropout == 0.0 else None
    if kernel is not None:
        max_len = kwargs.get("max_length_q")
        max_len = int(max_len) if max_len is not None else int((cu[1:] - cu[:-1]).max())
        out = varlen_attention(query, key, value, cu, max_len, causal=causal, scaling=scaling, kernel=kernel)
        return out, None
    return segment_loop(query, key, value, cu, causal=causal, scaling=scaling, dropout=dropout), None


def _no_mask(*args: Any, **kwargs: Any) -> None:
    """`SEGMENT_SDPA`'s mask function: causality comes from `is_causal`, isolation from the segment bounds."""
    return None


def register_attention_functions() -> None:
    global _registered
    with _lock:
        if _registered:
            return
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        for name in (SEGMENT_SDPA, VISION_VARLEN):
            AttentionInterface.register(name, segment_sdpa)
            AttentionMaskInterface.register(name, _no_mask)
        _registered = True


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
    tower's, and no cuDNN SDPA on CUDA.

    Wrap the forward AND the backward: gradient checkpointing re-runs the forward during the backward, which
    must attend the same way (the trainer wraps its whole `training_step`). Nested blocks are no-ops, so the
    trainer's step and `forward_for_loss` inside it compose. Only configs set to `sdpa` are switched (eager
    is a debugging choice; flash-attention has varlen already). Not for concurrent use of one model from
    several threads: the trainer's step is single-threaded.

    Args:
        model: the (possibly wrapped) model.
        enabled: False runs the block unchanged (`stage2.loss.segment_attention: false`).
        varlen: False keeps the per-segment SDPA loop even where the varlen kernel runs (benches' baseline).
        kernel: `model.varlen_kernel`: `auto` (the first of `VARLEN_KERNELS` that runs here) or one of them.
    """
    if kernel != "auto" and kernel not in VARLEN_KERNELS:
        raise ValueError(f"varlen kernel {kernel!r}: use auto or one of {', '.join(VARLEN_KERNELS)}")
    text, vision = _configs(model)
    switch = [(c, name) for c, name in ((text, SEGMENT_SDPA), (vision, VISION_VARLEN)) if c is not None]
    switch = [(c, name) for c, name in switch if getattr(c, "_attn_implementation", None) == "sdpa"]
    if not enabled or not any(c is text for c, _ in switch):
        yield
        return
    register_attention_functions()
    tower = _vision_tower(model, vision) if any(c is vision for c, _ in switch) else None
    hook = tower.register_forward_pre_hook(_drop_row_bounds, with_kwargs=True) if tower is not None else None
    cuda = any(p.is_cuda for p in itertools.islice(model.parameters(), 1))
    kernels = sdpa_kernel(NO_CUDNN_SDPA_BACKENDS) if cuda else contextlib.nullcontext()
    saved, _use_varlen[0] = _use_varlen[0], (kernel if varlen else "")
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
        _use_varlen[0] = saved
