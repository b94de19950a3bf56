"""Loads the torchvision-free Qwen-VL import shim in every Python process that has this folder on PYTHONPATH.

vLLM inspects model architectures in a subprocess that does not re-run the caller's script, so importing the
shim in the test script is not enough; `sitecustomize` runs at interpreter start in every process (registry
inspection, EngineCore, workers). Test environments only: it switches itself off when torchvision imports.
What the shim patches and why: `tinyvlm_compat`'s docstring; when it is installed: docs/RUNBOOK.md ("Hosts
without torchvision").
"""

try:
    import tinyvlm_compat

    tinyvlm_compat.install()
except Exception as exc:  # a broken shim must never break interpreter start-up
    import sys

    sys.stderr.write(f"[tinyvlm_compat] shim not installed: {type(exc).__name__}: {exc}\n")
