"""Idempotent writes of the demo sets: a file is rewritten only when its bytes change, and a finished set
(its manifest written last and equal) is reused as it is."""

from __future__ import annotations

import json
from pathlib import Path


def write_if_changed(path: Path, data: bytes) -> bool:
    """Writes ``data`` to ``path`` atomically unless it already holds exactly these bytes (mtime kept);
    True when written."""
    if path.exists() and path.read_bytes() == data:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    tmp.replace(path)
    return True


def finished_set(out: Path, manifest_bytes: bytes, jsonl: list[Path]) -> bool:
    """Whether ``out`` holds a finished set of this manifest: ``manifest.json`` (written last) is byte-equal,
    and every JSONL file and every image its records name exist."""
    manifest = out / "manifest.json"
    if not manifest.exists() or manifest.read_bytes() != manifest_bytes or not all(p.exists() for p in jsonl):
        return False
    for path in jsonl:
        for line in path.read_text().splitlines():
            if not all((out / image).exists() for image in json.loads(line).get("images", [])):
                return False
    return True
