"""The tiny Qwen3-VL builder and the torchvision-free import shim (scripts/build_tiny_vlm.py,
shared_schemas/vlm_shim/)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.conftest import REPO, SHIM_DIR

pytestmark = pytest.mark.integration

LOAD_PROCESSOR = """
import sys
from PIL import Image
from transformers import AutoProcessor
proc = AutoProcessor.from_pretrained(sys.argv[1])
messages = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (64, 64))},
                                          {"type": "text", "text": "hi"}]}]
ids = proc.apply_chat_template(
    messages, tokenize=True, add_generation_prompt=True, return_dict=True
)["input_ids"]
ids = ids[0] if isinstance(ids[0], list) else ids
print(type(proc.video_processor).__name__, ids.count(proc.tokenizer.convert_tokens_to_ids("<|image_pad|>")))
"""


def _python(code: str, *args: str, pythonpath: list[Path]) -> subprocess.CompletedProcess[str]:
    env = {"PYTHONPATH": ":".join(str(p) for p in pythonpath), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-c", code, *args], capture_output=True, text=True, env=env, cwd=REPO, timeout=300
    )


def test_build_is_deterministic_idempotent_and_tiny(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "scripts"))
    from build_tiny_vlm import build_tiny_vlm

    info = json.loads((tiny_vlm_dir / "build_info.json").read_text())
    assert 500_000 < info["parameters"] < 2_000_000
    before = (tiny_vlm_dir / "model.safetensors").stat().st_mtime_ns
    assert build_tiny_vlm(tiny_vlm_dir) == tiny_vlm_dir  # same recipe: kept as is
    assert (tiny_vlm_dir / "model.safetensors").stat().st_mtime_ns == before
    again = build_tiny_vlm(tmp_path / "copy", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny_vlm_dir / "model.safetensors").read_bytes()
    config = json.loads((tiny_vlm_dir / "config.json").read_text())
    text, vision = config["text_config"], config["vision_config"]
    assert text["head_dim"] == 64 and sum(text["rope_parameters"]["mrope_section"]) == 32
    assert vision["out_hidden_size"] == text["hidden_size"]
    assert max(vision["deepstack_visual_indexes"]) < vision["depth"]


def test_processor_needs_the_shim_and_expands_a_64px_image_to_4_tokens(tiny_vlm_dir: Path) -> None:
    with_shim = _python(LOAD_PROCESSOR, str(tiny_vlm_dir), pythonpath=[SHIM_DIR, REPO])
    assert with_shim.returncode == 0, with_shim.stderr[-2000:]
    assert with_shim.stdout.split() == ["Qwen3VLVideoProcessor", "4"]
    without = _python(LOAD_PROCESSOR, str(tiny_vlm_dir), pythonpath=[REPO])
    assert without.returncode != 0 and "orchvision" in without.stderr


def test_shim_switches_itself_off_when_torchvision_imports(tmp_path: Path) -> None:
    fake = tmp_path / "torchvision"
    fake.mkdir()
    (fake / "__init__.py").write_text("")
    code = "import tinyvlm_compat; print(tinyvlm_compat.installed(), tinyvlm_compat.install())"
    on = _python(code, pythonpath=[SHIM_DIR])
    off = _python(code, pythonpath=[SHIM_DIR, tmp_path])
    assert on.stdout.split() == ["True", "True"], on.stderr[-2000:]
    assert off.stdout.split() == ["False", "False"], off.stderr[-2000:]


COMPACT_LOGITS = """
import sys, torch
from PIL import Image
from transformers import AutoModelForImageTextToText, AutoProcessor
proc = AutoProcessor.from_pretrained(sys.argv[1])
model = AutoModelForImageTextToText.from_pretrained(sys.argv[1], dtype=torch.float32).eval()
image = Image.new("RGB", (64, 64), (200, 30, 30))
messages = [{"role": "user", "content": [{"type": "image", "image": image},
                                          {"type": "text", "text": "find the lamp"}]},
            {"role": "assistant", "content": [{"type": "text", "text": "a lamp at the top"}]}]
inputs = proc.apply_chat_template(messages, tokenize=True, return_dict=True, return_tensors="pt")
columns = torch.arange(inputs["input_ids"].shape[1] - 6, inputs["input_ids"].shape[1] - 1)
with torch.no_grad():
    full = model(**inputs).logits
    compact = model(**inputs, logits_to_keep=columns).logits
assert compact.shape[1] == len(columns), compact.shape
torch.testing.assert_close(compact, full[:, columns], rtol=1e-5, atol=1e-5)
print("ok", tuple(full.shape), tuple(compact.shape))
"""


def test_vlm_forward_takes_compact_logits_columns(tiny_vlm_dir: Path) -> None:
    """`stage2.loss.compact_logits` on Qwen-VL: a tensor `logits_to_keep` (with an image in the prompt) gives
    the full forward's logits at exactly those columns."""
    result = _python(COMPACT_LOGITS, str(tiny_vlm_dir), pythonpath=[SHIM_DIR, REPO])
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("ok")
