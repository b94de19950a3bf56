"""The image path on a real server with the tiny random Qwen3-VL (vision tower included), for both backends
(`image_server`: vLLM and `server.backend: hf`): image references as a path, a file:// URL and a data: URL
give the HF processor's exact (expanded) input ids, and greedy tokens equal HF `generate` in float32
(notes/tiny_vlm_on_cpu.md); ms-swift `images` lists, unreadable images and `prompt_token_ids` with images are
answered the same way by both, except that the HF backend takes images only with messages. A full sync of the
VL model over HTTP (vision tower included) changes the answers and the version once; a sync missing a bucket
changes nothing."""

from __future__ import annotations

import base64
import io
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.conftest import SHIM_DIR, ServerProcess
from tests.integration.vllm_helpers import SyncFailed, checkpoint_tensors, infer, infer_raw, sync_full

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
    image_server: ServerProcess, images: dict[str, Any], hf_reference: dict[str, tuple[list[int], list[int]]]
) -> None:
    cases = [("path", "small"), ("file_url", "wide"), ("data_url", "wide")]
    body = {
        "infer_requests": [{"messages": _messages(images[ref]), "request_id": ref} for ref, _ in cases],
        "request_config": {"max_tokens": MAX_TOKENS},
    }
    out = infer(image_server.base_url, body)
    for (ref, key), result in zip(cases, out.results, strict=True):
        prompt, tokens = hf_reference[key]
        assert result.request_id == ref
        assert result.prompt_token_ids == prompt, ref
        assert result.choices[0].token_ids == tokens, ref
    assert len(hf_reference["small"][0]) < len(hf_reference["wide"][0])  # more pixels, more image tokens


def test_ms_swift_images_list_and_image_tag(
    image_server: ServerProcess, images: dict[str, Any], hf_reference: dict[str, tuple[list[int], list[int]]]
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
    assert infer(image_server.base_url, body).results[0].prompt_token_ids == hf_reference["small"][0]


def test_unreadable_image_is_a_400_naming_the_request(image_server: ServerProcess, tmp_path: Path) -> None:
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
    resp = infer_raw(image_server.base_url, body)
    assert resp.status_code == 400
    error = resp.json()["error"]
    assert error["type"] == "bad_image" and "request 11" in error["message"]


def test_prompt_token_ids_with_images(
    image_server: ServerProcess,
    images: dict[str, Any],
    hf_reference: dict[str, tuple[list[int], list[int]]],
    tiny_vlm_dir: Path,
) -> None:
    """Unexpanded ids (one `<|image_pad|>`) plus `images`: vLLM expands them itself; the HF backend
    expands placeholders through the processor, which reads text, so it asks for messages (400, naming the
    request)."""
    from transformers import AutoTokenizer

    from shared_schemas.torch_common.prompts import encode_chat_prompt

    ids = encode_chat_prompt(AutoTokenizer.from_pretrained(tiny_vlm_dir), _messages(images["path"]))
    body = {
        "infer_requests": [{"prompt_token_ids": ids, "images": [images["path"]]}],
        "request_config": {"max_tokens": 4},
        "first_index": 5,
    }
    resp = infer_raw(image_server.base_url, body)
    if image_server.health()["engine"] == "vllm":
        assert resp.status_code == 200, resp.text
        assert resp.json()["results"][0]["prompt_token_ids"] == hf_reference["small"][0]
    else:
        assert resp.status_code == 400
        error = resp.json()["error"]
        assert error["type"] == "images_need_messages" and "request 5" in error["message"]


def test_full_sync_changes_the_answers_once_and_a_broken_one_nothing(
    image_server: ServerProcess, images: dict[str, Any], tiny_vlm_dir: Path
) -> None:
    """Checkpoint names on the wire (vision tower, aligner, LLM): perturbed weights → other greedy tokens or
    logprobs and one new version; a sync missing a bucket is refused at commit and serves nothing of it; the
    checkpoint's own weights bring the first answers back."""
    import numpy as np

    body = {
        "infer_requests": [{"messages": _messages(images[ref])} for ref in ("path", "data_url")],
        "request_config": {"max_tokens": MAX_TOKENS, "logprobs": True},
    }

    def answers() -> tuple[int, list[Any]]:
        out = infer(image_server.base_url, body)
        assert {r.weight_version for r in out.results} == {out.weight_version}
        return out.weight_version, [(r.choices[0].token_ids, r.choices[0].logprobs) for r in out.results]

    own = checkpoint_tensors(tiny_vlm_dir)
    rng = np.random.default_rng(0)
    perturbed = {k: v + rng.normal(0.0, 0.05, v.shape).astype(v.dtype) for k, v in own.items()}
    version, before = answers()
    with pytest.raises(SyncFailed) as missing:
        sync_full(image_server.base_url, perturbed, version + 1, bucket_bytes=1 << 16, skip=(1,))
    assert missing.value.phase == "commit" and 400 <= missing.value.status < 500
    assert answers() == (version, before)
    try:
        assert sync_full(image_server.base_url, perturbed, version + 1)["weight_version"] == version + 1
        changed_version, changed = answers()
        assert changed_version == version + 1 and image_server.health()["weight_version"] == version + 1
        assert changed != before
    finally:
        sync_full(image_server.base_url, own, version + 2)
    restored_version, restored = answers()
    assert restored_version == version + 2
    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(restored, before, strict=True):
        assert tokens == want_tokens
        assert np.allclose(logprobs, want_logprobs, atol=1e-5)
