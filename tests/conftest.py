"""Session-wide fixtures: the embedded tiny models, built offline once per test run."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "scripts"))

# Tests share one model cache with the demo so a second run builds nothing;
# override with ROLLMATCH_MODEL_CACHE.
MODEL_CACHE = Path(os.environ.get("ROLLMATCH_MODEL_CACHE", REPO / ".cache" / "models"))


@pytest.fixture(scope="session")
def tiny_model_dir() -> Path:
    """Directory of the seed-0 tiny Qwen2 LM (built on first use, idempotent)."""
    from build_tiny_models import build_tiny_lm

    return build_tiny_lm(MODEL_CACHE / "tiny-qwen2", seed=0)


@pytest.fixture(scope="session")
def tiny_model_dir_seed1() -> Path:
    """Directory of the seed-1 tiny Qwen2 LM: same tokenizer and shapes, different weights."""
    from build_tiny_models import build_tiny_lm

    return build_tiny_lm(MODEL_CACHE / "tiny-qwen2-seed1", seed=1)


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's transformers tokenizer (coord tokens single-id, Qwen chat template)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)
