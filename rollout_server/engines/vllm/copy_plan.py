"""Where each checkpoint tensor of a weight update lands in the served model: recorded once, replayed.

vLLM's `load_weights` maps every checkpoint name to its live parameter (the fused qkv / gate_up slot, the
tensor-parallel shard) one tensor at a time in Python, which made the in-place commit of a 2B model 17-26 x
a device-to-device copy of the same bytes. The map never changes while the engine runs, so the first
in-place commit runs `load_weights` under a dispatch mode that records every write into the model's
parameters and buffers (`CopyPlan.record`); later commits with the same names, shapes and dtypes copy each
tensor into its recorded destination view in one `torch._foreach_copy_` (`CopyPlan.apply`).

A plan is only built when the recorded load is replayable exactly: every write into the model is either a
`copy_` whose source lies inside one staged tensor (any view of it: a shard slice is replayed as the same
view), or a write with no tensor input (a `fill_` of vocabulary padding, replayed as is). Any other write
(a cast into a temporary and back, a transform of the loaded weight) leaves no plan, and every commit keeps
going through `load_weights`. A staged update that differs from the recorded one in names, shapes, dtypes or
devices is committed through `load_weights` and recorded again.

Invariant: the destination views alias the model's parameter storages. vLLM keeps those storages (sleep mode
remaps the same virtual addresses on wake); a path that re-creates parameters (`reload_weights`) must drop
the plan (`WeightLoadExtension` does).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

__all__ = ["CopyPlan", "CopyPlanRejected"]


class CopyPlanRejected(ValueError):
    """The recorded load cannot be replayed exactly (the message names the write that prevented it)."""


@dataclass(frozen=True)
class _Copy:
    """One recorded `copy_`: the view of staged tensor `name` it read, and the model view it wrote."""

    name: str
    offset: int  # elements from the staged tensor's first element
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    destination: Any  # a view of a parameter (or buffer) storage
    index: int = -1  # the staged tensor's position in the update (names are unique: one position)
    whole: bool = False  # the view is the whole staged tensor: replayed without building a view


@dataclass(frozen=True)
class _Constant:
    """One recorded write with no tensor input (e.g. `fill_(0)` of padding rows): replayed as is."""

    op: Any
    destination: Any
    arguments: tuple[Any, ...]


def _signature(staged: Sequence[tuple[str, Any]]) -> tuple[tuple[str, tuple[int, ...], Any, Any], ...]:
    return tuple((name, tuple(t.shape), t.dtype, t.device) for name, t in staged)


class CopyPlan:
    """The recorded writes of one `load_weights` call, replayable for any update of the same signature."""

    def __init__(self, signature: tuple[Any, ...], copies: list[_Copy], constants: list[_Constant]) -> None:
        self.signature = signature
        self.copies = copies
        self.constants = constants

    @classmethod
    def record(cls, model: Any, staged: Sequence[tuple[str, Any]]) -> tuple[CopyPlan | None, str]:
        """Runs `model.load_weights(staged)` (its effect is the commit) and records its writes.

        Returns:
            `(plan, "")`, or `(None, reason)` when the load is not replayable; the weights are loaded either
            way.

        Raises:
            whatever `load_weights` raises (a name or shape the model does not serve).
        """
        recorder = _WriteRecorder(model, staged)
        with torch.no_grad(), recorder:
            model.load_weights(weights=iter(staged))
        if recorder.rejected:
            return None, recorder.rejected
        position = {name: i for i, (name, _) in enumerate(staged)}
        if len(position) != len(staged):
            return None, "the update names a tensor twice"
        copies = []
        for copy in recorder.copies:
            base = staged[position[copy.name]][1]
            whole = (
                copy.offset == 0 and copy.shape == tuple(base.shape) and copy.stride == tuple(base.stride())
            )
            copies.append(replace(copy, index=position[copy.name], whole=whole))
        return cls(_signature(staged), copies, recorder.constants), ""

    def matches(self, staged: Sequence[tuple[str, Any]]) -> bool:
        """Whether `staged` has the recorded names, shapes, dtypes and devices, in order, all contiguous."""
        return _signature(staged) == self.signature and all(t.is_contiguous() for _, t in staged)

    def apply(self, staged: Sequence[tuple[str, Any]]) -> None:
        """Copies `staged` into the recorded destinations (one fused copy), then replays the constant writes.

        Precondition: `self.matches(staged)`; checked before anything is written.
        """
        if not self.matches(staged):
            raise CopyPlanRejected("the staged update does not have the recorded names, shapes and dtypes")
        tensors = [t for _, t in staged]  # in the recorded order (`matches`)
        sources = [
            tensors[c.index]
            if c.whole
            else tensors[c.index].as_strided(c.shape, c.stride, tensors[c.index].storage_offset() + c.offset)
            for c in self.copies
        ]
        with torch.no_grad():
            torch._foreach_copy_([c.destination for c in self.copies], sources)
            for constant in self.constants:
                constant.op(constant.destination, *constant.arguments)


def _written_arguments(op: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> list[Any]:
    """The arguments `op` writes into (its schema's mutable aliases: `self` of an in-place op, `out=`)."""
    written = []
    for index, argument in enumerate(op._schema.arguments):
        if argument.alias_info is None or not argument.alias_info.is_write:
            continue
        value = args[index] if index < len(args) else kwargs.get(argument.name)
        if value is not None:
            written.append(value)
    return written


def _tensors_in(values: Any) -> list[Any]:
    found = []
    for value in values:
        if isinstance(value, torch.Tensor):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(_tensors_in(value))
    return found


class _WriteRecorder(TorchDispatchMode):
    """Records every write into `model`'s storages while active; `rejected` names the first unreplayable
    one."""

    def __init__(self, model: Any, staged: Sequence[tuple[str, Any]]) -> None:
        super().__init__()
        tensors = [*model.parameters(), *model.buffers()]
        self._model_storages = {t.untyped_storage().data_ptr() for t in tensors if t.numel()}
        # address ranges of the staged tensors: a source view is found by where its first element lies
        self._ranges = sorted(
            (t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), name, t)
            for name, t in staged
            if t.numel() and t.is_contiguous()
        )
        self.copies: list[_Copy] = []
        self.constants: list[_Constant] = []
        self.rejected = ""

    def _staged_view(self, source: Any) -> tuple[str, int] | None:
        """`(name, element offset)` of the staged tensor `source` is a view of, or None."""
        start = source.data_ptr()
        span = sum((n - 1) * s for n, s in zip(source.shape, source.stride(), strict=True))
        for low, high, name, base in self._ranges:
            if low <= start < high and source.dtype == base.dtype and source.device == base.device:
                last = start + span * source.element_size()
                if last < high and (start - low) % base.element_size() == 0:
                    return name, (start - low) // base.element_size()
        return None

    def __torch_dispatch__(self, op: Any, types: Any, args: tuple[Any, ...] = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        result = op(*args, **kwargs)
        if self.rejected:
            return result
        if op is torch.ops.aten._local_scalar_dense.default and self._staged_view(args[0]) is not None:
            # `.item()` of a staged tensor: its value may go into a write that looks constant
            self.rejected = "the load reads a staged tensor's value on the host (.item())"
            return result
        for written in _written_arguments(op, args, kwargs):
            if not isinstance(written, torch.Tensor) or not written.numel():
                continue
            if written.untyped_storage().data_ptr() not in self._model_storages:
                continue  # a temporary of the loader
            inputs = [t for t in _tensors_in([*args, *kwargs.values()]) if t is not written]
            if op is torch.ops.aten.copy_.default and len(inputs) == 1:
                found = self._staged_view(inputs[0])
                if found is not None and tuple(inputs[0].shape) == tuple(written.shape):
                    name, offset = found
                    self.copies.append(
                        _Copy(name, offset, tuple(inputs[0].shape), tuple(inputs[0].stride()), written)
                    )
                    continue
            if not inputs and args and args[0] is written:
                self.constants.append(_Constant(op, written, tuple(a for a in args if a is not written)))
                continue
            self.rejected = f"{op} writes a parameter from a tensor that is not a view of a staged tensor"
        return result
