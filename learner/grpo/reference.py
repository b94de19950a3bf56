"""The KL reference policy of GRPO (spec/GRPO_SUMMARY.md §3: "reference = the initial policy").

- LoRA/DoRA training: the reference is the base model itself with the adapters disabled
  (``PeftModel.disable_adapter()``), so no second copy of the weights is held.
- Full fine-tuning: a frozen deep copy of the initial model, taken before the first optimizer step.
- ``beta == 0``: no reference at all (nothing reads it).
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from learner.grpo.batch import completion_logps
from learner.weights.export import is_peft_model

__all__ = ["ReferencePolicy", "build_reference"]


class ReferencePolicy:
    """Computes reference log-probs of a micro-batch (no grad).

    Args:
        module: the network to run (the policy itself for adapter training, else the frozen copy).
        context: entered around every forward (``disable_adapter`` for adapter training).
        kind: ``adapter_disabled`` or ``frozen_copy`` (for logs).
    """

    def __init__(
        self, module: nn.Module, context: Callable[[], contextlib.AbstractContextManager], kind: str
    ) -> None:
        self.module = module
        self._context = context
        self.kind = kind

    @torch.no_grad()
    def logps(self, batch: dict[str, torch.Tensor | int]) -> torch.Tensor:
        """``[B, K]`` reference log-probs of ``batch["targets"]`` (see ``learner.grpo.batch``)."""
        with self._context():
            return completion_logps(self.module, batch)


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


def build_reference(model: nn.Module, beta: float) -> ReferencePolicy | None:
    """The reference for ``model`` (call BEFORE training starts), or None when ``beta == 0``."""
    if beta == 0:
        return None
    if is_peft_model(model):
        return ReferencePolicy(model, model.disable_adapter, "adapter_disabled")
    frozen = copy.deepcopy(model)
    frozen.eval()
    for param in frozen.parameters():
        param.requires_grad_(False)
    return ReferencePolicy(frozen, _nothing, "frozen_copy")
