"""What a fresh interpreter loads: the import-purity and boundary tests' one subprocess check."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Collection, Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def loaded_modules(imports: Sequence[str], roots: Collection[str]) -> list[str]:
    """Imports `imports` (module names) in a fresh interpreter at the repository root and returns, sorted, the
    loaded modules whose top-level package is one of `roots`."""
    code = (
        f"import json, sys\nimport {', '.join(imports)}\n"
        f"print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in {set(roots)!r})))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])
