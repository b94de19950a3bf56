"""The strong control's measurement: the object order the seed's base follows (``sft-canonical`` trains on the
annotations listed in it)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

import yaml

from _ab.tables import ORDERING_OF, PY, REPO
from shared_schemas.config import deep_merge

ORDER_DIR = "base_order"
"""Folder of an ``sft-canonical`` run holding the base's order measurement (`python -m learner.evaluate`'s
``metrics.json``, ``predictions.jsonl``)."""


def read_order(run_dir: Path) -> dict[str, Any] | None:
    """The ``object_order`` (`learner.evaluate.order`) measured for the run in ``run_dir`` (None: not yet)."""
    path = run_dir / ORDER_DIR / "metrics.json"
    return json.loads(path.read_text()).get("object_order") if path.exists() else None


def canonical_ordering(order: dict[str, Any] | None, task_ordering: str) -> str:
    """The ``data.object_ordering`` of the ``sft-canonical`` run: the one listing the annotations in the order
    the base follows (:data:`ORDERING_OF`); the task's own when it follows ``listed``, none (below the
    agreement threshold) or was not measured."""
    follows = (order or {}).get("follows")
    return ORDERING_OF.get(follows, task_ordering) if follows else task_ordering


def measure_base_order(
    common: dict[str, Any], *, model: str, train: Path, run_dir: Path, seed: int, n_items: int
) -> dict[str, Any]:
    """The order ``model`` (the seed's base) emits objects in, on its greedy rollouts of the first ``n_items``
    training rows, listed as the learner lists them (the task's ``data.object_ordering`` and ``seed``):
    `python -m learner.evaluate` on a colocated HF engine with the task's evaluation decoding writes
    ``run_dir/base_order``; returns its ``object_order``.

    Raises:
        SystemExit: the evaluation failed (its log's tail).
    """
    cfg = deep_merge(
        common,
        {
            "training": {"seed": seed},
            "rollout": {
                "mode": "colocate",
                "backend": "hf",
                "async": {"enabled": False},
                "decoding": {"rollout_generate_batch_size": 16},
            },
        },
    )
    run_dir.mkdir(parents=True, exist_ok=True)
    path, log = run_dir / "base_order.yaml", run_dir / "base_order.log"
    path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    command = [PY, "-m", "learner.evaluate", "--config", str(path), "--model", model, "--data", str(train)]
    command += ["--limit", str(n_items), "--out", str(run_dir / ORDER_DIR), "--no-coco", "--gallery", "0"]
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    with log.open("w") as fh:
        rc = subprocess.run(command, cwd=REPO, env=env, stdout=fh, stderr=subprocess.STDOUT).returncode
    order = read_order(run_dir)
    if rc != 0 or order is None:
        tail = "".join(log.read_text().splitlines(keepends=True)[-40:])
        raise SystemExit(f"measuring the base's order failed with exit code {rc}; log {log}:\n{tail}")
    return order
