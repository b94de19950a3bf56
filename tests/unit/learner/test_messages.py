"""Prompt hygiene (docs/ALGORITHM.md#prompts; required tests §20.2)."""

from __future__ import annotations

import pytest

from learner.data.errors import DataRecordError
from learner.data.messages import (
    DEFAULT_SYSTEM_PROMPT,
    DEFAULT_USER_PROMPT,
    build_messages,
    build_rollout_request,
    rollout_messages,
)

SYS = {"role": "system", "content": "be brief"}
USER = {"role": "user", "content": [{"type": "image", "image": "a.jpg"}, {"type": "text", "text": "list"}]}
USER2 = {"role": "user", "content": [{"type": "image", "image": "b.jpg"}, {"type": "text", "text": "again"}]}
ASSIST = {"role": "assistant", "content": "{}"}


def test_trailing_assistant_stripped():
    assert rollout_messages([SYS, USER, ASSIST]) == [SYS, USER]


def test_last_user_kept_and_system_injected():
    out = rollout_messages([USER, ASSIST, USER2, ASSIST])
    assert out == [{"role": "system", "content": DEFAULT_SYSTEM_PROMPT}, USER, ASSIST, USER2]


def test_no_user_raises():
    with pytest.raises(DataRecordError, match="no user message"):
        rollout_messages([SYS, ASSIST])


def test_system_injection_uses_configured_prompt():
    assert rollout_messages([USER], system_prompt="custom")[0] == {"role": "system", "content": "custom"}


def test_list_of_parts_system_is_flattened():
    sys_parts = {
        "role": "system",
        "content": [
            {"type": "text", "text": "be "},
            {"type": "image", "image": "x"},
            {"type": "text", "text": "brief"},
        ],
    }
    out = rollout_messages([sys_parts, USER])
    assert out[0] == {"role": "system", "content": "be brief"}
    assert sys_parts["content"][0] == {"type": "text", "text": "be "}  # input untouched


def test_request_holds_only_messages_and_image_strings():
    sample = {
        "messages": [SYS, USER, ASSIST],
        "images": ["a.jpg"],
        "gt_objects": [{"desc": "cat", "bbox_2d": [1, 2, 3, 4]}],
        "width": 10,
        "height": 10,
        "sample_id": 3,
    }
    req = build_rollout_request(sample)
    assert set(req) == {"messages", "images"}
    assert req == {"messages": [SYS, USER], "images": ["a.jpg"]}
    assert "gt_objects" not in str(req) and "cat" not in str(req)


def test_request_rejects_decoded_images():
    with pytest.raises(TypeError):
        build_rollout_request({"messages": [USER], "images": [object()]})


def test_default_prompts_and_build_messages():
    assert (
        "reply {}" in DEFAULT_SYSTEM_PROMPT
        and "x1 ≤ x2" in DEFAULT_SYSTEM_PROMPT
        and "  " not in DEFAULT_SYSTEM_PROMPT
    )
    assert DEFAULT_USER_PROMPT.endswith("coordinate tokens 0–999.")
    msgs = build_messages(["a.jpg"])
    assert msgs[0] == {"role": "system", "content": DEFAULT_SYSTEM_PROMPT}
    assert msgs[1]["content"][0] == {"type": "image", "image": "a.jpg"}  # image part first
    assert msgs[1]["content"][1] == {"type": "text", "text": DEFAULT_USER_PROMPT}
