"""Faster kernels for the policy's training step: Liger-Kernel's Triton RMSNorm, rotary and SwiGLU on a
Qwen3-VL model, or regional torch.compile of its blocks (the two do not compose: dynamo cannot trace Liger's
RMSNorm function), and Qwen3-VL's deepstack merge without host waits.

Measured by `bench/bench_packing.py --gpu --vlm --liger / --compile all` (bench/RESULTS.md, "learner
throughput").
"""

from __future__ import annotations

import torch
from torch import nn

from learner.yaml_loader import ConfigError


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


BLOCK_LISTS = ("model.layers", "visual.blocks")
"""Name suffixes of the module lists whose blocks `compile_blocks` compiles: decoder layers (a text model's
`model.layers`, a VL model's `language_model.layers`) and ViT blocks."""


def compile_blocks(model: nn.Module, lists: tuple[str, ...] = BLOCK_LISTS, **compile_kwargs: object) -> int:
    """Regional ``torch.compile`` of every block of ``model``'s block lists (in place), ``dynamic=True`` so
    that packed rows of every length share one graph; returns how many blocks were compiled.
    ``compile_kwargs`` go to ``torch.compile`` as well (the bench's ``--inductor-options``); compiling again
    replaces the earlier compilation.

    Compiling blocks rather than the model keeps the compile short (one graph per block type, reused by every
    layer) and leaves the data-dependent parts (image grids, position ids, the losses) eager. Generation stays
    eager (`rollout_server.engines.hf_decode` decodes under ``torch.compiler.set_stance("force_eager")``).
    Gains, and the variants measured and left out: bench/RESULTS.md, "learner throughput".
    """
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith(lists):
            for block in module:
                block.compile(**{"dynamic": True, **compile_kwargs})
                n += 1
    return n


def index_deepstack(model: nn.Module, enabled: bool = True) -> int:
    """Replaces Qwen3-VL's deepstack merge (the ViT's mid-layer features added at the image tokens of the
    first decoder layers) by an ``index_add`` at the image positions, found once per forward; returns how
    many language models were patched (0: not a Qwen3-VL).

    Transformers' version reads and writes ``hidden[mask]`` with a boolean mask: each of the 3 deepstack
    layers makes the host wait for the GPU twice in the forward and twice more in the backward, and after each
    wait the GPU idles until the host has launched again. The index form waits once per forward (``nonzero``
    of the mask) and never in the backward; values equal (the same bf16 additions at the same positions).
    ``enabled=False`` restores transformers' version.
    """
    n = 0
    for module in model.modules():
        if type(module).__name__ == "Qwen3VLTextModel" and hasattr(module, "_deepstack_process"):
            if enabled:
                module._deepstack_process = _indexed_deepstack
            else:
                module.__dict__.pop("_deepstack_process", None)
            n += 1
    return n


def _indexed_deepstack(
    hidden_states: torch.Tensor, visual_pos_masks: torch.Tensor, visual_embeds: torch.Tensor
) -> torch.Tensor:
    """``hidden_states`` ``[B, T, D]`` with ``visual_embeds`` ``[n, D]`` added at the ``n`` True positions of
    ``visual_pos_masks`` ``[B, T]`` (row-major order, as transformers' boolean indexing), out of place."""
    index = getattr(visual_pos_masks, "_rm_flat_index", None)
    if index is None:  # the mask is built once per forward and shared by the deepstack layers
        index = visual_pos_masks.to(hidden_states.device).reshape(-1).nonzero().squeeze(1)
        visual_pos_masks._rm_flat_index = index
    flat = hidden_states.reshape(-1, hidden_states.shape[-1])
    merged = flat.index_add(0, index, visual_embeds.to(flat.device, flat.dtype))
    return merged.view_as(hidden_states)
