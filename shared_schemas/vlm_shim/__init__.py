"""The torchvision-free Qwen-VL import shim, shipped inside the package so a wheel install has it too.

`SHIM_DIR` is a folder of top-level modules: `tinyvlm_compat` (the shim) and a `sitecustomize` that
installs it at interpreter start. Callers put the folder on `sys.path` (this process) and `PYTHONPATH`
(processes it starts) and import `tinyvlm_compat` by that name — never as
`shared_schemas.vlm_shim.tinyvlm_compat`, which would be a second copy of the shim's state.
`ensure_vl_imports` does both for the learner's policy loader and `python -m rollout_server`; scripts that
must run before the package imports (`scripts/build_tiny_vlm.py`, `scripts/vlm_pretrain.py`) and the test
fixtures name the folder by its path. Nothing here imports torch or transformers.
"""

import sys
from pathlib import Path

__all__ = ["SHIM_DIR", "ensure_vl_imports"]

SHIM_DIR = Path(__file__).resolve().parent
"""The folder to put on `sys.path` / `PYTHONPATH`; holds `tinyvlm_compat.py` and `sitecustomize.py`."""


def ensure_vl_imports() -> None:
    """Makes Qwen-VL processors and vLLM's Qwen-VL files importable without torchvision: the shim in this
    process and on `PYTHONPATH` for the processes it starts (a vLLM engine's).

    Idempotent; a no-op where torchvision imports.
    """
    if str(SHIM_DIR) not in sys.path:
        sys.path.insert(0, str(SHIM_DIR))
    import tinyvlm_compat

    tinyvlm_compat.install_everywhere()
