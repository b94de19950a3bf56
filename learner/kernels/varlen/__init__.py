"""Varlen attention kernels of packed rows behind one interface (`base.VarlenKernel`), registered by name:
`fa4` (FlashAttention-4), `torch` (PyTorch's varlen op) — `model.varlen_kernel` — with the per-segment SDPA
fallback they are checked against once per configuration."""

from learner.kernels.varlen import fa4, torch_op  # noqa: F401  (registers the kernels)
from learner.kernels.varlen.base import (
    VARLEN_KERNEL_NAMES,
    VARLEN_KERNELS,
    VarlenKernel,
    first_kernel,
    get_kernel,
    kernel_works,
    register,
    segment_loop,
    varlen_attention,
)
from learner.kernels.varlen.fa4 import Fa4Varlen, fa4_importable, fa4_supported
from learner.kernels.varlen.torch_op import TorchVarlen

__all__ = [
    "VARLEN_KERNELS",
    "VARLEN_KERNEL_NAMES",
    "Fa4Varlen",
    "TorchVarlen",
    "VarlenKernel",
    "fa4_importable",
    "fa4_supported",
    "first_kernel",
    "get_kernel",
    "kernel_works",
    "register",
    "segment_loop",
    "varlen_attention",
]
