"""The torchvision-free Qwen-VL import shim, shipped inside the package so a wheel install has it too.

`SHIM_DIR` is a folder of top-level modules: `tinyvlm_compat` (the shim) and a `sitecustomize` that
installs it at interpreter start. Callers put the folder on `sys.path` (this process) and `PYTHONPATH`
(processes it starts) and import `tinyvlm_compat` by that name — never as
`rollout_server.vlm_shim.tinyvlm_compat`, which would be a second copy of the shim's state.
"""

from pathlib import Path

__all__ = ["SHIM_DIR"]

SHIM_DIR = Path(__file__).resolve().parent
"""The folder to put on `sys.path` / `PYTHONPATH`; holds `tinyvlm_compat.py` and `sitecustomize.py`."""
