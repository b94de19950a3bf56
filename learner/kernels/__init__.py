"""The compute path of the learner's training step: attention of packed rows (`attention`, over the
varlen kernels registered in `varlen`) and in-place patches of the policy model (`patches`: Liger-Kernel,
regional `torch.compile` of its blocks, Qwen3-VL's deepstack merge by index)."""

from learner.kernels.attention import (
    SEGMENT_SDPA,
    VARLEN_CHOICES,
    VISION_VARLEN,
    packed_attention,
    register_attention_functions,
    segment_sdpa,
    varlen_kernel,
)
from learner.kernels.patches import BLOCK_LISTS, apply_liger, compile_blocks, index_deepstack
from learner.kernels.varlen import (
    VARLEN_KERNEL_NAMES,
    VARLEN_KERNELS,
    VarlenKernel,
    fa4_importable,
    segment_loop,
    varlen_attention,
)

__all__ = [
    "BLOCK_LISTS",
    "SEGMENT_SDPA",
    "VARLEN_CHOICES",
    "VARLEN_KERNELS",
    "VARLEN_KERNEL_NAMES",
    "VISION_VARLEN",
    "VarlenKernel",
    "apply_liger",
    "compile_blocks",
    "fa4_importable",
    "index_deepstack",
    "packed_attention",
    "register_attention_functions",
    "segment_loop",
    "segment_sdpa",
    "varlen_attention",
    "varlen_kernel",
]
