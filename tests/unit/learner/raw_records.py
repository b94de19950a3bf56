"""Hand-made raw dataset records (text-only scenes, 1000 x 1000) for the learner's unit tests."""

from __future__ import annotations

from typing import Any

CAT = {"desc": "cat", "bbox_2d": ["<|coord_10|>", "<|coord_20|>", "<|coord_300|>", "<|coord_400|>"]}
"""One ground-truth box in the records' coord-token form."""


def raw_record(i: int, gt_objects: list[dict[str, Any]], *, text: str | None = None) -> dict[str, Any]:
    """Record `i` (its base_idx and sample_id) of dataset `t`: one user turn, `text` or `scene {i}`."""
    return {
        "messages": [
            {"role": "user", "content": [{"type": "text", "text": f"scene {i}" if text is None else text}]}
        ],
        "gt_objects": gt_objects,
        "images": [],
        "width": 1000,
        "height": 1000,
        "base_idx": i,
        "dataset": "t",
        "sample_id": i,
    }
