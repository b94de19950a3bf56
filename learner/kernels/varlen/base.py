"""The one interface of the varlen attention kernels (`model.varlen_kernel`), their registry, the per-segment
fallback they must match, and the one-time check that they do.

A varlen kernel attends a packed row — `T` tokens of `k` segments, bounds `cu` — with each segment attending
only to itself, in ONE call over the whole row, no Python loop over segments and no host sync. It answers two
questions, one method each:

- `missing(device)`: why it cannot run on a device at all (not installed, wrong GPU; empty: it can);
- `__call__(q, k, v, cu, max_len, causal=, scale=)`: the attention, `(T, H, D)` layout.

Implementations register under their configuration name (`register`), which must be one of
`VARLEN_KERNEL_NAMES`, the names in the order `model.varlen_kernel: auto` tries them: `fa4`
(`varlen.fa4`, FlashAttention-4) and `torch` (`varlen.torch_op`, PyTorch's FlashAttention-2 op). Both are
registered when `learner.kernels.varlen` is imported; `tests/unit/learner/test_kernels.py` ties the names to
`ModelConfig.varlen_kernel`.

Before a kernel serves a configuration (device, dtype, head size, causal, grouped kv heads) it is run once
against `segment_loop`, the per-segment SDPA fallback, in values and gradients (`kernel_works`); a kernel that
fails is logged once and the next one (or the fallback) serves from then on.
"""

from __future__ import annotations

import logging
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import Tensor

from shared_schemas.registry import registrar

__all__ = [
    "VARLEN_KERNELS",
    "VARLEN_KERNEL_NAMES",
    "VarlenKernel",
    "first_kernel",
    "get_kernel",
    "kernel_works",
    "register",
    "segment_loop",
    "varlen_attention",
]

logger = logging.getLogger(__name__)

VARLEN_KERNEL_NAMES: tuple[str, ...] = ("fa4", "torch")
"""The varlen kernels' names (`model.varlen_kernel`, besides `auto`), in the order `auto` tries them."""


class VarlenKernel:
    """One varlen attention kernel (see the module docstring). Subclasses are registered with `register`,
    which sets `name`, and implement `missing` and `_attend` (what `__call__` runs); one instance per process
    (`get_kernel`)."""

    name: ClassVar[str] = ""

    def missing(self, device: torch.device) -> str:
        """Why this kernel cannot run on `device` at all (empty: it can; its values are checked apart)."""
        raise NotImplementedError

    def __call__(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        cu: torch.Tensor,
        max_len: int,
        *,
        causal: bool,
        scale: float | None,
    ) -> torch.Tensor:
        """Attention of a packed row, each segment `[cu[i], cu[i+1])` to itself only.

        Args:
            q: `(T, H, D)`; k, v: `(T, H_kv, D)`, H a multiple of H_kv (query head h reads kv head
                h // (H / H_kv), as SDPA's `enable_gqa`). Possibly non-contiguous views.
            cu: int32 `[k + 1]` segment bounds on the tensors' device.
            max_len: longest segment (tokens).
            causal: causal within each segment (language model) or full (vision tower).
            scale: softmax scale; None = `D ** -0.5`.

        Returns:
            `(T, H, D)`, differentiable in q, k, v.
        """
        return self._attend(q, k, v, cu, max_len, causal, scale)

    def _attend(
        self, q: Tensor, k: Tensor, v: Tensor, cu: Tensor, max_len: int, causal: bool, scale: float | None
    ) -> Tensor:
        """`__call__`'s attention, its arguments positional; each kernel implements it."""
        raise NotImplementedError


VARLEN_KERNELS: dict[str, type[VarlenKernel]] = {}
"""Varlen kernel classes by `model.varlen_kernel` name."""

register = registrar(VARLEN_KERNELS, "varlen attention kernel", VARLEN_KERNEL_NAMES)
"""Class decorator: `@register(name)` adds a class to `VARLEN_KERNELS` under `name` (once)."""


_instances: dict[str, VarlenKernel] = {}
"""One instance per registered kernel, made on first use (a plain lookup after that, also in a compiled
block)."""


def get_kernel(name: str) -> VarlenKernel:
    """The kernel registered as `name`.

    Raises:
        ValueError: no kernel of that name.
    """
    kernel = _instances.get(name)
    if kernel is None:
        if name not in VARLEN_KERNELS:
            raise ValueError(f"unknown varlen kernel {name!r}; known: {', '.join(VARLEN_KERNEL_NAMES)}")
        kernel = _instances[name] = VARLEN_KERNELS[name]()
    return kernel


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
    """One varlen kernel call over a packed row, in transformers' layout.

    Args:
        query: `(1, H, T, D)`; key, value: `(1, H_kv, T, D)`, H a multiple of H_kv.
        cu: `[k + 1]` segment bounds (any int dtype, any device).
        max_len: longest segment (tokens).
        causal: causal within each segment (language model) or full (vision tower).
        scaling: softmax scale; None = `D ** -0.5`.
        kernel: one of `VARLEN_KERNEL_NAMES`.

    Returns:
        `(1, T, H, D)`.
    """
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # (T, H, D) views
    cu = cu.to(device=q.device, dtype=torch.int32)
    return get_kernel(kernel)(q, k, v, cu, max_len, causal=causal, scale=scaling).unsqueeze(0)


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
    """The fallback: one SDPA call per segment `[cu[i], cu[i+1])`, exactly the attention the segment gets
    alone; `(1, T, H, D)` like `varlen_attention`."""
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


Config = tuple[int, bool, bool]
"""An attention configuration: `(head size, causal, grouped kv heads)`."""

_checked: dict[tuple, bool] = {}
"""`(kernel, device, dtype, head size, causal, grouped kv heads)` -> whether that kernel runs that
configuration there and matches the fallback (`kernel_works`); a memo, filled once per key."""


@torch.compiler.disable
def kernel_works(
    device: torch.device, dtype: torch.dtype, kernel: str = "torch", config: Config = (64, True, True)
) -> bool:
    """Whether varlen `kernel` runs on `device` in `dtype` and matches the fallback in values and gradients,
    for one attention configuration `(head size, causal, grouped kv heads)` — the one about to be served,
    so a kernel that compiles per configuration (FA4) compiles just what training uses. Checked once per
    (kernel, device, dtype, configuration); a failure is logged once and the next kernel (or the fallback)
    serves from then on. A kernel that is not installed is skipped with an info line."""
    tag = (kernel, str(device), dtype, *config)
    if tag not in _checked:
        ok, why = True, get_kernel(kernel).missing(device)
        if why:
            logger.info("varlen kernel %s not used on %s: %s", kernel, device, why)
            _checked[tag] = False
            return False
        try:
            gen = torch.Generator(device=device).manual_seed(0)
            cu = torch.tensor([0, 5, 37, 96], dtype=torch.int32, device=device)
            d, causal, gqa = config
            heads_kv = 2 if gqa else 4
            shapes = ((1, 4, 96, d), (1, heads_kv, 96, d), (1, heads_kv, 96, d))
            leaves = [torch.randn(s, device=device, dtype=dtype, generator=gen) for s in shapes]
            outs, grads = [], []
            for use_kernel in (True, False):
                xs = [t.clone().requires_grad_(True) for t in leaves]
                if use_kernel:  # 59: the longest segment
                    out = varlen_attention(*xs, cu, 59, causal=causal, scaling=None, kernel=kernel)
                else:
                    out = segment_loop(*xs, cu, causal=causal, scaling=None, dropout=0.0)
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
                VARLEN_KERNEL_NAMES,
            )
        _checked[tag] = ok
    return _checked[tag]


def first_kernel(choice: str, device: torch.device, dtype: torch.dtype, config: Config) -> str | None:
    """The first kernel of `choice` (`auto`: `VARLEN_KERNEL_NAMES` in order) that runs on `device` in
    `dtype` and passed its check there for `config` (`kernel_works`), or None."""
    for kernel in VARLEN_KERNEL_NAMES if choice == "auto" else (choice,):
        # Checked already: a plain lookup, so a compiled block does not break its graph at the (disabled)
        # check.
        known = _checked.get((kernel, str(device), dtype, *config))
        if known if known is not None else kernel_works(device, dtype, kernel, config):
            return kernel
    return None
