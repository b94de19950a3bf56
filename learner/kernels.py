"""Faster kernels for the policy's training step: Liger-Kernel's Triton RMSNorm, rotary and SwiGLU on a
Qwen3-VL model, or regional torch.compile of its blocks (the two do not compose: dynamo cannot trace Liger's
RMSNorm function), and Qwen3-VL's deepstack merge without host waits.

Measured by `bench/bench_packing.py --gpu --vlm --liger / --compile all` (bench/RESULTS.md, "learner
throughput").
"""

from __future__ import annotations

from collections.abc import Iterator

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


BLOCK_LISTS = ("model.layers", "visual.blocks")
"""Name suffixes of the module lists whose blocks `compile_blocks` compiles: decoder layers (a text model's
`model.layers`, a VL model's `language_model.layers`) and ViT blocks."""


def compile_blocks(
    model: nn.Module, lists: tuple[str, ...] = BLOCK_LISTS, *, runs: bool = True, **compile_kwargs: object
) -> int:
    """Regional ``torch.compile`` of ``model``'s block lists (in place), ``dynamic=True`` so that packed rows
    of every length share one graph; returns how many blocks were compiled. ``compile_kwargs`` go to
    ``torch.compile`` as well (the bench's ``--inductor-options``); compiling again replaces the earlier
    compilation.

    Two region sizes, the same arithmetic:

    - every block compiled on its own (``runs=False``; always installed): one graph per block type, reused
      by every layer;
    - ``runs=True``: each run of consecutive blocks that nothing outside reads in between compiled as ONE
      region (`_BlockRuns`): Qwen3-VL's language model reads its layers' output only after the deepstack
      layers 0..n-1 (runs [0], [1], [2], [3..27] on the 2B shapes), its ViT after the deepstack taps (runs
      of 6 blocks), a text model after none (one run). A region call costs the host ~1 ms (dynamo's guards,
      AOTAutograd's and Inductor's wrappers) on top of its kernel launches, and the packed step's forward
      was launch-bound; one call per run instead of per block, and Inductor fuses across block bounds (a
      block's residual add with the next block's norm). Under gradient checkpointing the blocks run one by
      one (a checkpointed run would hold the whole run's activations in its backward).

    Blocks rather than the model keep the data-dependent parts (image grids, position ids, the losses)
    eager. Generation stays eager (`rollout_server.engines.hf_decode` decodes under
    ``torch.compiler.set_stance("force_eager")``). Measured and left out (bench/RESULTS.md): Inductor's
    ``cpp_wrapper`` (fails on the varlen attention op), dropping the blocks' module guards (no gain) and CUDA
    graphs of the blocks (slower).
    """
    n = 0
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and name.endswith(lists):
            for block in module:
                block.compile(**{"dynamic": True, **compile_kwargs})
                n += 1
            _BlockRuns.install(module, _run_bounds(model, name, len(module)) if runs else None,
                               {"dynamic": True, **compile_kwargs})  # fmt: skip
    return n


def use_block_runs(model: nn.Module, enabled: bool = True) -> int:
    """Switches the compiled runs of `compile_blocks` on or off (off: the blocks' own compiled calls, one per
    block) without recompiling anything; returns how many block lists were switched. For A/B timing."""
    lists = [m for m in model.modules() if type(m) is _BlockRuns]
    for blocks in lists:
        blocks.__dict__["_rm_runs_on"] = enabled
    return len(lists)


def _run_bounds(model: nn.Module, list_name: str, n_blocks: int) -> list[range]:
    """The runs of ``list_name``'s blocks that nothing outside the list reads in between: a run ends after
    each block whose output the model reads (Qwen3-VL's deepstack taps) and at the last block."""
    config = getattr(model, "config", None)
    vision = getattr(config, "vision_config", None)
    taps = list(getattr(vision, "deepstack_visual_indexes", None) or [])
    if list_name.endswith("visual.blocks"):
        ends = set(taps)
    elif taps and "language_model" in list_name:  # deepstack adds to the output of text layers 0..n-1
        ends = set(range(len(taps)))
    else:
        ends = set()
    ends = sorted(e for e in ends if 0 <= e < n_blocks - 1) + [n_blocks - 1]
    starts = [0] + [e + 1 for e in ends[:-1]]
    return [range(a, b + 1) for a, b in zip(starts, ends, strict=True)]


class _RunCall:
    """One compiled call running a run of blocks in order, each with the same extra arguments (what the
    model's own loop passes every block). Not an ``nn.Module``: the blocks stay where they are registered."""

    def __init__(self, blocks: list[nn.Module], compile_kwargs: dict) -> None:
        self.blocks = blocks
        self.compiled = torch.compile(self._run, **compile_kwargs)

    def _run(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        for block in self.blocks:  # `_call_impl`: the block's hooks and forward, not its own compiled call
            hidden_states = block._call_impl(hidden_states, *args, **kwargs)
        return hidden_states

    def __call__(self, hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        return self.compiled(hidden_states, *args, **kwargs)


def _passthrough(hidden_states: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    """A block that its run's first block already ran."""
    return hidden_states


class _BlockRuns(nn.ModuleList):
    """A block list whose iteration (the model's own ``for i, block in enumerate(self.layers)``) yields one
    compiled `_RunCall` at the first block of each run and a pass-through at the others, so indices, the
    model's reads between runs and every registered name, parameter and state-dict key stay as they were.
    Iterates the plain blocks where no runs are installed or gradient checkpointing is on."""

    @classmethod
    def install(cls, blocks: nn.ModuleList, bounds: list[range] | None, compile_kwargs: dict) -> None:
        """Turns ``blocks`` into a `_BlockRuns` (in place) with ``bounds``' runs; None or all runs of one
        block: the plain list back."""
        if not bounds or all(len(r) == 1 for r in bounds):
            if type(blocks) is cls:
                blocks.__class__ = nn.ModuleList
            blocks.__dict__.pop("_rm_calls", None)
            return
        members = list(blocks._modules.values())
        calls: list = []
        for run in bounds:
            head = members[run.start] if len(run) == 1 else _RunCall(members[run.start : run.stop], compile_kwargs)
            calls += [head] + [_passthrough] * (len(run) - 1)
        blocks.__class__ = cls
        blocks.__dict__["_rm_calls"] = calls  # not via nn.Module.__setattr__: nothing new is registered
        blocks.__dict__["_rm_runs_on"] = True

    def __iter__(self) -> Iterator:
        blocks = list(self._modules.values())
        calls = self.__dict__.get("_rm_calls")
        checkpointing = any(getattr(b, "gradient_checkpointing", False) and b.training for b in blocks)
        on = calls is not None and self.__dict__.get("_rm_runs_on", False) and not checkpointing
        return iter(calls if on else blocks)

    def __getitem__(self, idx: int | slice) -> nn.Module | nn.ModuleList:
        if isinstance(idx, slice) and range(len(self))[idx] == range(len(self)):
            return self  # `self.layers[: config.num_hidden_layers]` (Qwen2's loop) keeps the runs
        return super().__getitem__(idx)


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
