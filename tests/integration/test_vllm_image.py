"""The image path on a real server with the tiny random Qwen3-VL (vision tower included): image references as a
path, a file:// URL and a data: URL give the HF processor's exact (expanded) input ids, and greedy tokens equal
HF `generate` in float32 (notes/tiny_vlm_on_cpu.md)."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import SHIM_DIR, ServerProcess
from tests.integration.vllm_helpers import infer, infer_raw

pytestmark = pytest.mark.integration

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from PIL import Image

    folder = tmp_path_factory.mktemp("images")
    small = Image.new("RGB", (64, 64), (200, 30, 40))  # 4 image tokens
    wide = Image.linear_gradient("L").convert("RGB").resize((128, 96))  # 12 image tokens
    small.save(folder / "small.png")
    wide.save(folder / "wide.png")
    buf = io.BytesIO()
    wide.save(buf, format="PNG")
    return {
        "small": small,
        "wide": wide,
        "path": str(folder / "small.png"),
        "file_url": (folder / "wide.png").as_uri(),
        "data_url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode(),
    }


def _messages(image: Any) -> list[dict[str, Any]]:
    return [
        {"role": "system", "content": "You are an open-vocabulary object detector."},
        {
            "role": "user",
            "content": [{"type": "image", "image": image}, {"type": "text", "text": "List every object."}],
        },
    ]


@pytest.fixture(scope="module")
def hf_reference(tiny_vlm_dir: Path, images: dict[str, Any]) -> dict[str, tuple[list[int], list[int]]]:
    """HF processor input ids and HF greedy tokens per image."""
    sys.path.insert(0, str(SHIM_DIR))
    import tinyvlm_compat

    tinyvlm_compat.install()
    from transformers import AutoModelForImageTextToText, AutoProcessor

    processor = AutoProcessor.from_pretrained(tiny_vlm_dir)
    model = AutoModelForImageTextToText.from_pretrained(tiny_vlm_dir, dtype=torch.float32).eval()
    out = {}
    for key in ("small", "wide"):
        inputs = processor.apply_chat_template(
            _messages(images[key]),
            tokenize=True,
            add_generation_prompt=True,
            return_dict=True,
            return_tensors="pt",
        )
        with torch.no_grad():
            generated = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
        prompt = inputs["input_ids"][0].tolist()
        out[key] = (prompt, generated[0, len(prompt) :].tolist())
    return out


def test_image_refs_give_the_hf_processor_ids_and_tokens(
    vlm_server: ServerProcess, images: dict[str, Any], hf_reference: dict[str, tuple[list[int], list[int]]]
) -> None:
    cases = [("path", "small"), ("file_url", "wide"), ("data_url", "wide")]
    body = {
        "infer_requests": [{"messages": _messages(images[ref]), "request_id": ref} for ref, _ in cases],
        "request_config": {"max_tokens": MAX_TOKENS},
    }
    out = infer(vlm_server.base_url, body)
    for (ref, key), result in zip(cases, out.results, strict=True):
        prompt, tokens = hf_reference[key]
        assert result.request_id == ref
        assert result.prompt_token_ids == prompt, ref
        assert result.choices[0].token_ids == tokens, ref
    assert len(hf_reference["small"][0]) < len(hf_reference["wide"][0])  # more pixels, more image tokens


def test_ms_swift_images_list_and_image_tag(
    vlm_server: ServerProcess, images: dict[str, Any], hf_reference: dict[str, tuple[list[int], list[int]]]
) -> None:
    """ms-swift requests: `<image>` in string content plus an `images` list of strings."""
    body = {
        "infer_requests": [
            {
                "messages": [
                    {"role": "system", "content": "You are an open-vocabulary object detector."},
                    {"role": "user", "content": "<image>List every object."},
                ],
                "images": [images["path"]],
            }
        ],
        "request_config": {"max_tokens": 4},
    }
    assert infer(vlm_server.base_url, body).results[0].prompt_token_ids == hf_reference["small"][0]


def test_unreadable_image_is_a_400_naming_the_request(vlm_server: ServerProcess, tmp_path: Path) -> None:
    body = {
        "infer_requests": [
            {"messages": _messages(str(tmp_path / "ok.png"))},
            {"messages": _messages(str(tmp_path / "missing.png"))},
        ],
        "request_config": {"max_tokens": 4},
        "first_index": 10,
    }
    from PIL import Image

    Image.new("RGB", (32, 32)).save(tmp_path / "ok.png")
    resp = infer_raw(vlm_server.base_url, body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "bad_image" and "request 11" in error["message"]
