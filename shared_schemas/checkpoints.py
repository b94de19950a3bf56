"""What kind of model a checkpoint directory holds, read from its `config.json`: one definition for the
learner and the server (both must agree on whether prompts carry images)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["VL_MODEL_TYPES", "is_vision_language", "is_vl_checkpoint"]

VL_MODEL_TYPES = frozenset({"qwen2_vl", "qwen2_5_vl", "qwen3_vl"})
"""`model_type`s of the Qwen-VL family rollmatch trains and serves."""


def is_vision_language(config: Mapping[str, Any] | Any) -> bool:
    """A loaded `config.json` (a mapping) or a transformers config object: a Qwen-VL `model_type`, or any
    model with a `vision_config`."""
    get = config.get if isinstance(config, Mapping) else lambda key: getattr(config, key, None)
    return get("model_type") in VL_MODEL_TYPES or get("vision_config") is not None


def is_vl_checkpoint(path: str | Path) -> bool:
    """Whether the checkpoint directory `path` holds a vision-language model (False without a readable
    `config.json`: the model loader names that problem)."""
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    return is_vision_language(config)
