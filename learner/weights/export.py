"""Exporting the policy's weights for a sync (docs/ALGORITHM.md#sync-cadence,
docs/ARCHITECTURE.md#weight-sync).

Full sync: inside `merged_adapters(model)` the LoRA/DoRA deltas are merged into the base weights, and
`full_state_items` yields every tensor under the BASE model's parameter names — the names
`base_model.state_dict()` has, each tensor once (a tied `lm_head.weight` travels as
`model.embed_tokens.weight` only: the engines tie it back, and the vocabulary matrix is often the largest
tensor). The names come from walking the module tree (as PEFT's own `get_base_model_state_dict` does), not
from string surgery on keys:

- the PEFT wrapper (`base_model.model.`) is not part of any name: the walk starts at the wrapped model;
- a tuner layer (LoRA/DoRA `q_proj`) contributes only its `base_layer`, under the layer's own name, so
  `.base_layer` disappears and every adapter tensor (`lora_A`, `lora_B`, `lora_magnitude_vector`, ...)
  is dropped;
- a `modules_to_save` wrapper contributes its ACTIVE trained copy under the wrapper's name, never the
  frozen `original_module` (PEFT's `get_base_model_state_dict` keeps the latter, which the spec forbids).

`exported_state(model)` is what a full sync uses: for plain LoRA (`Linear`/`Embedding` layers, one active
adapter, no DoRA, no LoRA bias, not ZeRO-3) it merges ON THE FLY, tensor by tensor — each adapted weight is
yielded as `W + get_delta_weight()` (the value PEFT's own merge writes, computed the same way) while the model
is never touched, so nothing is materialised twice (no CPU snapshot of the adapted layers, no merge/unmerge
pass over the model) and at most the tensors of the buckets in flight exist as merged copies. Any other
adapter setup falls back to `merged_adapters` (merge in place, snapshot, unmerge, restore).

Adapter sync: `adapter_state` returns the PEFT adapter config and `get_peft_model_state_dict`.

DeepSpeed ZeRO-3 (optional; deepspeed is not a dependency and is imported only when a parameter carries
ZeRO-3 partition attributes): parameters are partitioned, so `full_state_items` gathers them bucket by
bucket with `deepspeed.zero.GatheredParameters` (a collective: EVERY rank must consume the iterator, in
the same order — `WeightSyncPolicy` drains it on ranks other than 0), and `merged_adapters` gathers the
whole model around the merge. These ZeRO-3 paths are written against DeepSpeed's documented API but are
not exercised by the CPU test suite (deepspeed is not installed there); GRPO allows stage 3 only once
the gather has been validated for the model (docs/ALGORITHM.md#grpo-topology).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from enum import Enum
from typing import Any

import torch
from peft import PeftModel, get_peft_model_state_dict
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper, ModulesToSaveWrapper
from torch import nn

from learner.weights.codec import dtype_code
from shared_schemas.sync import TensorSpec

logger = logging.getLogger(__name__)

__all__ = [
    "Gather",
    "adapter_state",
    "exported_state",
    "full_state_items",
    "full_state_specs",
    "is_peft_model",
    "is_zero3",
    "merged_adapters",
]

Gather = Callable[[Sequence[nn.Parameter]], AbstractContextManager[Any]]
"""Makes partitioned parameters whole for the duration of a `with` block (ZeRO-3)."""


def is_peft_model(model: nn.Module) -> bool:
    """True for a PEFT-wrapped model (LoRA/DoRA adapters, `modules_to_save`)."""
    return isinstance(model, PeftModel)


def is_zero3(model: nn.Module) -> bool:
    """True when the parameters are partitioned by DeepSpeed ZeRO-3 (they carry a `ds_id`)."""
    return any(hasattr(p, "ds_id") for p in model.parameters())


def _deepspeed_gather(params: Sequence[nn.Parameter]) -> AbstractContextManager[Any]:
    try:
        import deepspeed  # optional: only ZeRO-3 runs reach this line
    except ImportError as exc:
        raise RuntimeError(
            "parameters are ZeRO-3 partitioned but deepspeed is not importable; install deepspeed"
        ) from exc
    # modifier_rank=None: read-only gather, nothing is written back on exit.
    return deepspeed.zero.GatheredParameters(list(params), modifier_rank=None)


def _default_gather(model: nn.Module, gather: Gather | None) -> Gather | None:
    if gather is not None:
        return gather
    return _deepspeed_gather if is_zero3(model) else None


@contextmanager
def merged_adapters(model: nn.Module, *, gather: Gather | None = None) -> Iterator[nn.Module]:
    """Merges the active LoRA/DoRA adapters into the base weights for the block, ALWAYS unmerging after.

    Merge followed by unmerge is not bit-exact (in bf16 it can move a frozen base weight by an ulp per
    sync, which adds up over a run), so the base weights of the adapted layers are also copied to CPU
    before the merge and written back after the unmerge: the model leaves the block bit-identical.

    A model without adapters, or one whose adapters are already merged (by the caller, who then owns
    unmerging), is yielded unchanged.

    Args:
        model: the policy (a `PeftModel` or a plain model).
        gather: ZeRO-3 gather (default: DeepSpeed's when the model is partitioned); the whole model is
            gathered around merge/yield/unmerge, read-only.

    Yields:
        `model`, with merged weights inside the block.
    """
    if not is_peft_model(model):
        yield model
        return
    tuners = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    if any(m.merged for m in tuners):
        logger.warning("adapters are already merged; exporting as is and leaving them merged")
        yield model
        return
    gather = _default_gather(model, gather)
    whole = gather(list(model.parameters())) if gather is not None else nullcontext()
    with whole:
        saved = _snapshot_base_weights(tuners)
        try:
            with torch.no_grad():
                model.merge_adapter()
            yield model
        finally:
            # Also after a failed merge: unmerge() only touches layers that did merge.
            with torch.no_grad():
                model.unmerge_adapter()
                for param, value in saved:
                    param.copy_(value)


def _snapshot_base_weights(tuners: Sequence[BaseTunerLayer]) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """CPU copies of the parameters a merge writes (the wrapped base layers' weights and biases)."""
    seen: set[int] = set()
    saved = []
    for tuner in tuners:
        for param in tuner.get_base_layer().parameters(recurse=False):
            if id(param) not in seen:
                seen.add(id(param))
                saved.append((param, param.detach().to("cpu", copy=True)))
    return saved


def _walk(module: nn.Module, prefix: str) -> Iterator[tuple[str, Any]]:
    """Yields `(base name, tensor)` for the state-dict entries of `module`, adapter wrappers resolved (an
    adapted layer's weight as a `_Merged`, so the export can add the delta)."""
    if isinstance(module, ModulesToSaveWrapper):
        active = module.active_adapters[0] if module.active_adapters else None
        if active is not None and not module.disable_adapters and active in module.modules_to_save:
            yield from _walk(module.modules_to_save[active], prefix)
        else:
            yield from _walk(module.original_module, prefix)
        return
    if isinstance(module, AuxiliaryTrainingWrapper):
        # Other wrappers (trainable tokens) merge into the module they wrap.
        yield from _walk(module.original_module, prefix)
        return
    if isinstance(module, BaseTunerLayer):
        for name, tensor in _walk(module.base_layer, prefix):
            yield name, _Merged(tensor, module) if name == f"{prefix}weight" else tensor
        return
    for name, param in module._parameters.items():
        if param is not None:
            yield prefix + name, param
    for name, buf in module._buffers.items():
        if buf is not None and name not in module._non_persistent_buffers_set:
            yield prefix + name, buf
    for name, child in module._modules.items():
        if child is not None:
            yield from _walk(child, f"{prefix}{name}.")


class _Merged:
    """A base-layer weight whose tuner layer's delta is added when it is exported with `merge=True`."""

    __slots__ = ("tensor", "tuner")

    def __init__(self, tensor: torch.Tensor, tuner: BaseTunerLayer) -> None:
        self.tensor = tensor
        self.tuner = tuner

    def value(self, merge: bool) -> torch.Tensor:
        tensor = self.tensor
        if not merge:
            return tensor
        adapter = _active_adapter(self.tuner)
        if adapter is None:
            return tensor
        with torch.no_grad():
            # Exactly PEFT's unsafe merge, `weight.data += get_delta_weight(adapter)`, into a new tensor.
            return (tensor.detach() + self.tuner.get_delta_weight(adapter)).to(tensor.dtype)


def _active_adapter(tuner: BaseTunerLayer) -> str | None:
    """The adapter a merge would add for this layer (None: the layer does not carry the active adapter)."""
    if tuner.disable_adapters or not tuner.active_adapters:
        return None
    adapter = tuner.active_adapters[0]
    weights = getattr(tuner, "lora_A", {}) or {}
    embeddings = getattr(tuner, "lora_embedding_A", {}) or {}
    return adapter if adapter in weights or adapter in embeddings else None


def _streamable(model: nn.Module) -> bool:
    """Whether the adapters can be merged on the fly (see the module docstring), exactly as PEFT merges."""
    from peft.tuners.lora import layer as lora

    if not is_peft_model(model) or is_zero3(model):
        return False
    for module in model.modules():
        if not isinstance(module, BaseTunerLayer):
            continue
        if (
            type(module) not in (lora.Linear, lora.Embedding)
            or module.merged
            or len(module.active_adapters) > 1
        ):
            return False
        adapter = _active_adapter(module)
        if adapter is not None and (adapter in module.lora_variant or module.lora_bias.get(adapter, False)):
            return False  # DoRA and other variants, LoRA biases: merge in place
    return True


@contextmanager
def exported_state(
    model: nn.Module, dtype: torch.dtype | None = None, *, bucket_bytes: int = 512 * 2**20
) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
    """The full-sync export: `(base name, merged tensor)` items, adapters merged on the fly when possible,
    else inside `merged_adapters` (the block then holds the merge; consume the items inside it).

    Args:
        model: the policy.
        dtype: see `full_state_items`.
        bucket_bytes: see `full_state_items`.

    Yields:
        The items, in `full_state_specs` order.
    """
    if _streamable(model):
        yield full_state_items(model, dtype, bucket_bytes=bucket_bytes, merge=True)
        return
    with merged_adapters(model):
        yield full_state_items(model, dtype, bucket_bytes=bucket_bytes)


def _base_entries(model: nn.Module) -> list[tuple[str, Any]]:
    """State-dict entries under base names, each tensor once: a tied duplicate (`lm_head.weight` sharing
    `model.embed_tokens.weight`) is left out, as engines load tied weights from the first name (vLLM skips
    `lm_head.weight` of a tied model), and sending it would double the bytes of the vocabulary matrix."""
    root = model.base_model.model if is_peft_model(model) else model
    seen: set[int] = set()
    entries: list[tuple[str, Any]] = []
    for name, tensor in _walk(root, ""):
        key = id(tensor.tensor if isinstance(tensor, _Merged) else tensor)
        if key not in seen:
            seen.add(key)
            entries.append((name, tensor))
    return entries


def _full_shape(tensor: torch.Tensor) -> tuple[int, ...]:
    # A ZeRO-3 partitioned parameter is empty locally; its real shape is ds_shape.
    return tuple(getattr(tensor, "ds_shape", tensor.shape))


def _cast_dtype(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.dtype:
    return dtype if dtype is not None and tensor.is_floating_point() else tensor.dtype


def full_state_specs(model: nn.Module, dtype: torch.dtype | None = None) -> tuple[TensorSpec, ...]:
    """Names, dtype codes and shapes `full_state_items` will yield, in order, without reading data."""
    return tuple(
        TensorSpec(name=name, dtype=dtype_code(_cast_dtype(t, dtype)), shape=_full_shape(t))
        for name, t in _plain_entries(model)
    )


def _plain_entries(model: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [(name, t.tensor if isinstance(t, _Merged) else t) for name, t in _base_entries(model)]


def full_state_items(
    model: nn.Module,
    dtype: torch.dtype | None = None,
    *,
    bucket_bytes: int = 512 * 2**20,
    gather: Gather | None = None,
    merge: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields `(base-model name, tensor)` for a full sync, in `base_model.state_dict()` order.

    Call it inside `merged_adapters(model)` so adapter deltas are included. Tensors are detached; without
    `dtype` (or for integer buffers) they are views of the live weights, so consume each before the
    weights change.

    Args:
        model: the policy.
        dtype: cast floating-point tensors to this dtype (the server's engine dtype); None keeps them.
        bucket_bytes: ZeRO-3 only: gather at most about this many bytes at a time.
        gather: ZeRO-3 gather (default: DeepSpeed's when the model is partitioned, else none). Under a
            gather, yielded tensors are copies, valid after the group is released.
        merge: add each adapted layer's LoRA delta to its weight on the fly (`exported_state` decides when
            that is exact); the model is not modified. Not with a gather.

    Yields:
        One pair per base-model state-dict entry; a tied duplicate only under its first name.
    """
    gather = _default_gather(model, gather)
    if gather is None:
        for name, entry in _base_entries(model):
            tensor = entry.value(merge) if isinstance(entry, _Merged) else entry
            yield name, tensor.detach().to(_cast_dtype(tensor, dtype))
        return
    if merge:
        raise ValueError(
            "merging adapters on the fly is not supported with a ZeRO-3 gather; use merged_adapters"
        )
    entries = _plain_entries(model)
    for group in _size_groups(entries, bucket_bytes):
        params = [t for _, t in group if isinstance(t, nn.Parameter)]
        with gather(params):
            copies = [(name, t.detach().to(_cast_dtype(t, dtype), copy=True)) for name, t in group]
        yield from copies


def _size_groups(
    entries: Sequence[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of about `bucket_bytes` (full sizes), so one gather holds one bucket."""
    group: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in entries:
        nbytes = int(torch.Size(_full_shape(tensor)).numel()) * tensor.element_size()
        if group and size + nbytes > bucket_bytes:
            yield group
            group, size = [], 0
        group.append((name, tensor))
        size += nbytes
    if group:
        yield group


def _jsonable(value: Any) -> Any:
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    if isinstance(value, Enum):
        return value.value
    raise TypeError(f"adapter config value {value!r} ({type(value).__name__}) is not JSON-serializable")


def adapter_state(model: nn.Module) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """The active PEFT adapter as `(adapter_config.json content, state dict)` for an adapter sync.

    Keys are PEFT's saved-adapter names (`base_model.model.<module>.lora_A.weight`, adapter name
    removed), exactly what `save_pretrained` writes and vLLM's LoRA loader reads.

    Raises:
        ValueError: the model is not a PEFT model.
    """
    if not is_peft_model(model):
        raise ValueError(
            f"adapter sync needs a PEFT model, got {type(model).__name__}; set model.adapter to lora/dora"
            " or use rollout.sync.mode: full"
        )
    name = model.active_adapter
    config = json.loads(json.dumps(model.peft_config[name].to_dict(), default=_jsonable))
    state = {k: v.detach() for k, v in get_peft_model_state_dict(model, adapter_name=name).items()}
    return config, state
