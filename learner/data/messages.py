"""Prompt texts and rollout prompt hygiene (docs/ALGORITHM.md#prompts).

``build_messages`` renders the §3.1 conversation of a sample; ``rollout_messages`` applies the §3.3 hygiene
(strip trailing assistant turns, inject or flatten the system prompt); ``build_rollout_request`` is the only
thing a rollout backend ever receives: those messages and the image strings, nothing else of the sample.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from typing import Any

from learner.data.errors import DataRecordError

__all__ = [
    "DEFAULT_SYSTEM_PROMPT",
    "DEFAULT_USER_PROMPT",
    "build_messages",
    "build_rollout_request",
    "flatten_text_content",
    "rollout_messages",
]

DEFAULT_SYSTEM_PROMPT = (
    "You are an open-vocabulary object detector. Reply with one single-line JSON object and nothing else, "
    'shaped like {"object_1": {...}, "object_2": {...}}. Each entry has a short plain-English "desc" and '
    'exactly one geometry: "bbox_2d" as [x1, y1, x2, y2] with x1 ≤ x2 and y1 ≤ y2, or "poly" as one closed '
    "ring of [x, y] points that starts at the top-most (then left-most) vertex and goes clockwise. Write "
    "every coordinate as <|coord_N|> with N from 0 to 999. Put one space after every ':' and ','. List "
    "objects top to bottom, then left to right, numbering from 1. If nothing is visible, reply {}. Use desc "
    '"unknown" for objects you cannot name.'
)
DEFAULT_USER_PROMPT = (
    "List every object in the image, top to bottom then left to right, as one JSON object whose entries hold "
    "a desc and one geometry written with coordinate tokens 0–999."
)


def build_messages(
    images: Sequence[str],
    *,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    user_prompt: str = DEFAULT_USER_PROMPT,
    assistant_text: str | None = None,
) -> list[dict[str, Any]]:
    """Render ``[system?] + [user] + [assistant?]`` (§3.1): image parts first, then the user text.

    Args:
        images: image references (path, URL or data URL strings; never decoded images).
        system_prompt: system text, or ``None`` for no system message.
        user_prompt: user text.
        assistant_text: the GT answer in the §4 format, when wanted.
    """
    for img in images:
        if not isinstance(img, str):
            raise TypeError(f"image reference {type(img).__name__} must be a string (path, URL or data URL)")
    msgs: list[dict[str, Any]] = []
    if system_prompt is not None:
        msgs.append({"role": "system", "content": system_prompt})
    content: list[dict[str, str]] = [{"type": "image", "image": img} for img in images]
    content.append({"type": "text", "text": user_prompt})
    msgs.append({"role": "user", "content": content})
    if assistant_text is not None:
        msgs.append({"role": "assistant", "content": assistant_text})
    return msgs


def flatten_text_content(content: Any) -> str:
    """A message content as a plain string: a string stays, a list of typed parts is its text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        return "".join(
            str(part.get("text", ""))
            for part in content
            if isinstance(part, Mapping) and part.get("type") == "text"
        )
    raise TypeError(
        f"message content of type {type(content).__name__} is neither a string nor a list of parts"
    )


def rollout_messages(
    messages: Sequence[Mapping[str, Any]], system_prompt: str = DEFAULT_SYSTEM_PROMPT
) -> list[dict[str, Any]]:
    """Apply the §3.3 hygiene; the input is not modified.

    1. Keep ``messages[: i + 1]`` where ``i`` is the last user message (drops trailing assistant turns).
    2. Insert ``{"role": "system", "content": system_prompt}`` first when there is no system message; flatten
       an existing list-of-parts system content to a plain string.

    Raises:
        DataRecordError: there is no user message.
    """
    last_user = max((j for j, m in enumerate(messages) if m.get("role") == "user"), default=-1)
    if last_user < 0:
        roles = [m.get("role") for m in messages]
        raise DataRecordError(
            None, None, f"messages with roles {roles} have no user message to roll out from"
        )
    out = [dict(m) for m in copy.deepcopy(list(messages[: last_user + 1]))]
    if out[0].get("role") == "system":
        out[0]["content"] = flatten_text_content(out[0].get("content", ""))
    else:
        out.insert(0, {"role": "system", "content": system_prompt})
    return out


def build_rollout_request(
    sample: Mapping[str, Any], system_prompt: str = DEFAULT_SYSTEM_PROMPT
) -> dict[str, Any]:
    """The backend request of one sample (§3.3.4): ``{"messages": rollout_messages, "images": [str, ...]}``.

    GT objects and every other sample field stay in the learner.
    """
    images = list(sample.get("images") or [])
    for img in images:
        if not isinstance(img, str):
            raise TypeError(f"sample image {type(img).__name__} must be a string (path, URL or data URL)")
    return {"messages": rollout_messages(sample["messages"], system_prompt), "images": images}
