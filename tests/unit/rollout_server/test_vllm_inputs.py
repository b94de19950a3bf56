"""Prompt assembly for the vLLM engine: image references, ms-swift `images`, unexpanded placeholders."""

from __future__ import annotations

import base64
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
from PIL import Image

from rollout_server.engines.vllm.inputs import (
    IMAGE_PLACEHOLDER,
    attach_images,
    image_bytes,
    load_image,
    prepare_prompt,
    resolve_prompt,
)
from rollout_server.errors import BadRequestError
from shared_schemas.infer import InferRequest, iter_image_refs
from shared_schemas.torch_common.prompts import encode_chat_prompt


@pytest.fixture
def png(tmp_path: Path) -> Path:
    path = tmp_path / "img one.png"
    Image.new("RGBA", (20, 10), (255, 0, 0, 128)).save(path)
    return path


def _data_url(path: Path) -> str:
    return "data:image/png;base64," + base64.b64encode(path.read_bytes()).decode()


def test_image_refs_read_the_same_bytes(png: Path) -> None:
    raw = png.read_bytes()
    assert image_bytes(str(png)) == raw
    assert image_bytes(png.as_uri()) == raw  # file:// with an escaped space
    assert image_bytes(_data_url(png)) == raw
    assert image_bytes("data:image/png," + quote(raw)) == raw  # percent-encoded data URL


@pytest.mark.parametrize(
    ("ref", "why"),
    [
        ("https://example.com/a.png", "scheme"),
        ("s3://bucket/a.png", "scheme"),
        ("file://otherhost/a.png", "host"),
        ("/no/such/file.png", "does not exist"),
        ("data:image/png;base64", "','"),
    ],
)
def test_bad_refs_are_caller_errors_naming_request_and_image(ref: str, why: str) -> None:
    with pytest.raises(BadRequestError) as err:
        image_bytes(ref, index=7, position=1)
    assert err.value.status == 400 and err.value.type == "bad_image"
    assert "request 7: image 1" in err.value.message and why in err.value.message


def test_load_image_is_rgb_and_rejects_non_images(png: Path, tmp_path: Path) -> None:
    image = load_image(str(png))
    assert image.mode == "RGB" and image.size == (20, 10)
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"not an image")
    with pytest.raises(BadRequestError, match="not a decodable image"):
        load_image(str(junk), index=3)


def test_attach_images_fills_image_tags_then_prepends_to_the_first_user_message() -> None:
    messages = [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "look <image> here"},
    ]
    assert attach_images(messages, []) is messages
    out = attach_images(messages, ["a.png", "b.png"])
    assert out[0] == messages[0] and messages[1]["content"] == "look <image> here"  # input untouched
    assert out[1]["content"] == [
        {"type": "image", "image": "b.png"},
        {"type": "text", "text": "look "},
        {"type": "image", "image": "a.png"},
        {"type": "text", "text": " here"},
    ]


def _placeholder_id(tokenizer: Any) -> int:
    return tokenizer.convert_tokens_to_ids(IMAGE_PLACEHOLDER)


def test_text_request_ids_are_the_hf_engine_ids(tiny_tokenizer: Any) -> None:
    messages = [{"role": "user", "content": 'say {"object_1": <|coord_7|>'}]
    prepared = prepare_prompt(tiny_tokenizer, InferRequest(messages=messages), 0, placeholder_id=None)
    assert prepared.prompt_token_ids == encode_chat_prompt(tiny_tokenizer, messages)
    assert prepared.engine_input() == {"prompt_token_ids": prepared.prompt_token_ids}


def test_image_request_keeps_one_unexpanded_placeholder_per_image(tiny_tokenizer: Any, png: Path) -> None:
    pad = _placeholder_id(tiny_tokenizer)
    request = InferRequest(
        messages=[
            {
                "role": "user",
                "content": [{"type": "image", "image": str(png)}, {"type": "text", "text": "hi"}],
            }
        ],
        images=[_data_url(png)],
    )
    prepared = prepare_prompt(tiny_tokenizer, request, 4, placeholder_id=pad)
    assert prepared.prompt_token_ids.count(pad) == 2
    assert [im.size for im in prepared.images] == [(20, 10), (20, 10)]
    assert len(prepared.engine_input()["multi_modal_data"]["image"]) == 2
    # What the HF engine takes before its processor: the same ids, the refs in placeholder order, and the
    # messages with the `images` entry placed (what its processor renders).
    resolved = resolve_prompt(tiny_tokenizer, request, 4, placeholder_id=pad)
    assert resolved.prompt_token_ids == prepared.prompt_token_ids
    assert resolved.refs == [_data_url(png), str(png)]
    assert resolved.messages is not None and iter_image_refs(resolved.messages) == resolved.refs


def test_token_id_request_with_images_needs_matching_placeholders(tiny_tokenizer: Any, png: Path) -> None:
    pad = _placeholder_id(tiny_tokenizer)
    ok = prepare_prompt(
        tiny_tokenizer, InferRequest(prompt_token_ids=[5, pad, 6], images=[str(png)]), 0, placeholder_id=pad
    )
    assert ok.prompt_token_ids == [5, pad, 6] and len(ok.images) == 1
    with pytest.raises(BadRequestError) as err:
        prepare_prompt(
            tiny_tokenizer,
            InferRequest(prompt_token_ids=[5, pad, pad, 6], images=[str(png)]),
            9,
            placeholder_id=pad,
        )
    assert err.value.type == "image_placeholder_mismatch" and "request 9" in err.value.message


def test_images_for_a_text_only_model_are_refused(tiny_tokenizer: Any, png: Path) -> None:
    request = InferRequest(messages=[{"role": "user", "content": [{"type": "image", "image": str(png)}]}])
    with pytest.raises(BadRequestError) as err:
        prepare_prompt(tiny_tokenizer, request, 2, placeholder_id=None)
    assert err.value.type == "images_unsupported" and "request 2" in err.value.message


def test_unreadable_image_fails_before_generation(tiny_tokenizer: Any) -> None:
    pad = _placeholder_id(tiny_tokenizer)
    request = InferRequest(
        messages=[{"role": "user", "content": [{"type": "image", "image": "/missing.png"}]}]
    )
    with pytest.raises(BadRequestError, match="request 5: image 0"):
        prepare_prompt(tiny_tokenizer, request, 5, placeholder_id=pad)
