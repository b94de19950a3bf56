"""`shared_schemas` is installable alone: it must not pull torch, vllm or fastapi
(docs/ARCHITECTURE.md#the-two-services) — except its one named torch package, `shared_schemas.torch_common`,
which `shared_schemas/__init__` never imports and which loads nothing of either process."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys
from pathlib import Path

from tests.unit.fresh_imports import loaded_modules

REPO = Path(__file__).resolve().parents[3]


def test_fresh_interpreter_loads_no_heavy_packages() -> None:
    code = (
        "import json, sys\n"
        "import shared_schemas\n"
        "from shared_schemas import buckets, chunking, errors, health, infer, repeat_guard, sync\n"
        "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in"
        " {'torch', 'vllm', 'fastapi', 'starlette', 'transformers'})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == []


def test_all_exports_resolve() -> None:
    import shared_schemas

    assert shared_schemas.__all__
    for name in shared_schemas.__all__:
        assert hasattr(shared_schemas, name), name


TORCH_COMMON = "shared_schemas.torch_common"
"""The one named exception to the light-import rule: what both processes run on torch (prompt encoding, the
weight-sync process group, the SDPA kernel list). `shared_schemas/__init__` never imports it
(docs/ARCHITECTURE.md#the-two-services)."""

SHIM_MODULES = ("shared_schemas.vlm_shim.sitecustomize", "shared_schemas.vlm_shim.tinyvlm_compat")
"""Files of the VLM shim folder: top-level modules loaded by name from `PYTHONPATH`, never as package modules
(importing `sitecustomize` installs the shim)."""

_HEAVY = ("torch", "vllm", "fastapi", "starlette", "transformers")


def test_every_module_but_the_torch_package_is_light() -> None:
    """Each module of `shared_schemas`, the exception aside, in one fresh interpreter: none of the heavy or
    process packages loads, and `import shared_schemas` does not load the exception."""
    import shared_schemas

    names = [m.name for m in pkgutil.walk_packages(shared_schemas.__path__, "shared_schemas.")]
    names = [n for n in names if not n.startswith((TORCH_COMMON, *SHIM_MODULES))]
    assert {"shared_schemas.config", "shared_schemas.server_config", "shared_schemas.vlm_shim"} <= set(names)
    assert loaded_modules(names, {*_HEAVY, "rollout_server", "learner"}) == []
    assert TORCH_COMMON not in loaded_modules(["shared_schemas"], {"shared_schemas"})


def test_torch_package_loads_no_process_or_server_package() -> None:
    """The exception imports torch and nothing of either process, vLLM or FastAPI."""
    modules = [f"{TORCH_COMMON}.{name}" for name in ("process_group", "prompts", "sdpa")]
    assert loaded_modules(modules, {"vllm", "fastapi", "starlette", "rollout_server", "learner"}) == []
