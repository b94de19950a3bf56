"""Idempotent writes of the demo sets and models: a file is rewritten only when its bytes change, a finished
set (its manifest written last and equal) is reused as it is, concurrent builders of one folder take turns."""

from __future__ import annotations

import fcntl
import functools
import hashlib
import io
import json
import os
import shutil
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar

from PIL import Image

T = TypeVar("T")

BUILD_LOCK_TIMEOUT_S = 3600.0
"""How long a builder waits for another process building the same folder (a demo stage-1 on 2 CPU cores
takes minutes)."""


def one_builder_at_a_time(build: Callable[..., T]) -> Callable[..., T]:
    """Decorates ``build(out_dir, ...)`` so that processes building the same ``out_dir`` run it one after the
    other (an exclusive lock on ``<out_dir>.lock``): the second then finds the first's finished folder and
    reuses it, instead of both writing the same temporary folder (seen: two bench processes started side by
    side left a tokenizer without its coordinate tokens).

    Raises:
        TimeoutError: another process held the lock for ``BUILD_LOCK_TIMEOUT_S``.
    """

    @functools.wraps(build)
    def locked(out_dir: Path, *args: Any, **kwargs: Any) -> T:
        out_dir = Path(out_dir).resolve()
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        lock = out_dir.with_name(out_dir.name + ".lock")
        deadline = time.monotonic() + BUILD_LOCK_TIMEOUT_S
        with lock.open("w") as fh:
            while True:
                try:
                    fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        raise TimeoutError(
                            f"{lock} held by another process for {BUILD_LOCK_TIMEOUT_S:.0f} s while building"
                            f" {out_dir}; stop that process (or delete the lock file if none runs) and retry"
                        ) from None
                    time.sleep(0.5)
            try:
                return build(out_dir, *args, **kwargs)
            finally:
                fcntl.flock(fh, fcntl.LOCK_UN)

    return locked


def recipe_key(recipe: dict[str, Any]) -> str:
    """A short stable hash of a model build's recipe, as its ``build_info.json`` records it."""
    return hashlib.sha1(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]


def built_from(out_dir: Path, recipe: dict[str, Any]) -> bool:
    """Whether ``out_dir`` holds a finished build of ``recipe`` (its ``build_info.json`` names the recipe's
    key), to be kept as it is."""
    info = out_dir / "build_info.json"
    return info.exists() and json.loads(info.read_text()).get("recipe_key") == recipe_key(recipe)


def staging_dir(out_dir: Path) -> Path:
    """``<out_dir>.tmp``, where a build is written before it replaces ``out_dir``; removed first if an
    interrupted build left it."""
    tmp = out_dir.with_name(out_dir.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    return tmp


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


def write_pngs_if_changed(images: Sequence[tuple[Path, Image.Image]]) -> None:
    """`write_if_changed` of each ``(path, image)`` as PNG (zlib level 9). The compression, about half of a
    demo set's writing time, runs on up to 16 threads (Pillow's encoder releases the GIL); the bytes are
    one thread's."""

    def png(image: Image.Image) -> bytes:
        buf = io.BytesIO()
        image.save(buf, format="PNG", optimize=False, compress_level=9)
        return buf.getvalue()

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        encoded = list(pool.map(png, [image for _, image in images]))
    for (path, _), data in zip(images, encoded, strict=True):
        write_if_changed(path, data)


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
