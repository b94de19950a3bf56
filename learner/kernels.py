"""Fused GPU kernels for the policy: Liger-Kernel's Triton RMSNorm, rotary and SwiGLU on a Qwen3-VL model.

Measured by `bench/bench_packing.py --gpu --vlm --liger` (bench/RESULTS.md, "learner throughput").
"""

from __future__ import annotations

import torch
from torch import nn

from learner.config import ConfigError


def apply_liger(model: nn.Module) -> list[str]:
    """Patches ``model`` (a Qwen3-VL, in place) with Liger-Kernel and returns what was patched.

    Liger's own Qwen3-VL patch (what HF ``Trainer`` applies for ``use_liger_kernel``): Triton RMSNorm of the
    language model and rotary embeddings of both towers; its fused linear cross-entropy is left off, as the
    learner's losses read compact logits. Liger's patch has no SwiGLU for Qwen3-VL, so the language MLPs get
    Liger's fused SiLU·mul here. Values equal the unpatched model's within bf16 noise (the bench compares the
    loss of one packed row before and after).

    Raises:
        ConfigError: no CUDA device, liger-kernel not installed, or not a Qwen3-VL model.
    """
    if not torch.cuda.is_available():
        raise ConfigError("model.liger_kernel needs a CUDA device (Triton kernels); set it false on CPU")
    try:
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction
        from liger_kernel.transformers import apply_liger_kernel_to_qwen3_vl
    except ImportError as exc:
        raise ConfigError(
            f"model.liger_kernel: liger-kernel is not importable ({exc}); pip install 'rollmatch[gpu]'"
        ) from exc
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    mlps = [m for m in base.modules() if type(m).__name__ == "Qwen3VLTextMLP"]
    if not mlps:
        raise ConfigError(
            f"model.liger_kernel supports Qwen3-VL only; {type(base).__name__} has no Qwen3VLTextMLP"
        )
    apply_liger_kernel_to_qwen3_vl(model=base, rope=True, rms_norm=True, fused_linear_cross_entropy=False)
    for mlp in mlps:
        mlp.forward = lambda x, m=mlp: m.down_proj(LigerSiLUMulFunction.apply(m.gate_proj(x), m.up_proj(x)))
    return ["rms_norm", "rope", f"swiglu x{len(mlps)}"]
