"""`shared_schemas` is installable alone: it must not pull torch, vllm or fastapi
(docs/ARCHITECTURE.md#the-two-services)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
