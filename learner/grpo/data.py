"""GRPO prompt data (docs/ALGORITHM.md#grpo-knobs §3.3–§3.5, #summary-task §4.1): prompt rows from JSONL and
the slot dataset.

A JSONL row is either a DETECTION record — the stage-2 record of docs/DATA.md (``images``, ``width``,
``height``, ``objects``; ``task_mode`` absent or ``detection``), the JSONL rollout-matching SFT trains on,
text-only demo records with their ``metadata.scene`` included — or a prompt row. A detection record goes
through the stage-2 sample builder (:func:`learner.data.records.validate_record` and ``build_sample``: images
resolved, the ``prompts.system`` / ``prompts.user`` texts, the scene appended to the user text, objects in
§1.4 order), and its reward row is ``{"task_mode": "detection", "objects": [...], "sample_id": ...}`` for the
``detection.*`` rewards (``learner.rewards.detection``). A prompt row is a JSON object with:

- ``messages``: chat messages (system/user; trailing assistant turns, e.g. an SFT answer, are dropped), or
  ``prompt``: the user text (with ``system`` as an optional system text);
- ``task_mode`` (required), ``domain``, ``summary_ref``: the §4.1 reference metadata the rewards read;
- ``id`` (optional) and any other keys (kept in :attr:`PromptRow.meta`, ignored by the rewards);
- ``images`` (optional): image reference strings (absolute path, ``file://`` or ``data:`` URL, or a path
  relative to ``data.image_root`` / the JSONL file's directory — the stage-2 rules,
  :func:`learner.data.records.resolve_image`). Image parts may also sit in ``messages``
  (``{"type": "image", "image": ref}``; relative refs resolved the same way); a part without a ref takes the
  next ``images`` entry; when ``messages`` has no image part, ``shared_schemas.images.attach_images`` places
  them as the server places a request's ``images``: each ``<image>`` tag in string content takes the next one,
  the rest go first in the first user turn (the stage-2 layout of ``learner.data.messages.build_messages``).

Prompts are encoded ONCE per row on the learner with the run's prompt encoder
(:class:`learner.data.prompt_encoding.PromptEncoder`: chat template, and for image rows the processor's
placeholder expansion and the M-RoPE positions). A text row is sent to the server as those ids
(``prompt_token_ids``); an image row is sent as its ``messages`` (the server templates and expands the images
itself — already-expanded ids would be expanded twice) and the ids the server returns must equal the learner's
(:func:`learner.grpo.rollouts.group_results`). :class:`PromptRow` keeps the ids and positions; the vision
tensors are re-encoded at step time (the encoder caches them for the step), so a large image set is never held
in memory and the broadcast groups stay small.
``truncation_strategy: delete`` (§3.5) is applied at load time: a prompt longer than
``global_max_length − max_completion_length`` is removed, which is the same as replacing it by the next
sample; the count is reported as ``data/deleted_overlong``.

The trainer's dataset (:class:`GenerationSlots`) lists *completion slots*: optimizer step ``k`` owns the
contiguous slots ``[k·E, (k+1)·E)`` (``E`` = generation batch size in completions), laid out group-major
(prompt ``p`` of the step, generation ``j``). HF ``Trainer`` samples it sequentially and accelerate deals
micro-batch ``b`` to rank ``b % world``, so every rank receives its share of the step's slots and the
trainer re-assembles the full window from the slot tags (never from positions).
"""

from __future__ import annotations

import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from torch.utils.data import Dataset

from learner.data.errors import DataRecordError
from learner.data.messages import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_PROMPT
from learner.data.records import build_sample, iter_jsonl, record_user_text, resolve_image, validate_record
from learner.rewards.detection import DETECTION_TASK
from shared_schemas.images import attach_images as place_images
from shared_schemas.infer import iter_image_refs

__all__ = [
    "GenerationSlots",
    "PromptRow",
    "PromptSet",
    "resolve_row_images",
    "chat_messages",
    "is_detection_record",
    "load_prompt_rows",
    "prompt_order",
]

REWARD_KEYS = ("task_mode", "domain", "summary_ref")
_IMAGE_PART_KEYS = ("image", "image_url")


class EncodedLike(Protocol):
    """What the prompt encoder returns (:class:`learner.data.prompt_encoding.EncodedPrompt`)."""

    ids: Sequence[int]
    rope_positions: tuple[tuple[int, ...], ...] | None

    @property
    def n_images(self) -> int: ...


Encode = Callable[[list[dict[str, Any]]], "EncodedLike | list[int]"]
"""messages → the encoded prompt (or plain ids, for text-only encoders)."""


@dataclass(frozen=True)
class PromptRow:
    """One prompt of the GRPO data.

    Attributes:
        index: position in the loaded (filtered) prompt set.
        row_id: the row's ``id`` (or ``<file stem>:<line>``).
        messages: the chat messages sent for generation (no assistant turn).
        prompt_ids: templated prompt token ids (generation prompt included, image placeholders expanded): the
            ids sent to the server for a text row, the ids the server must return for an image row.
        reward_row: ``task_mode``/``domain``/``summary_ref`` for the summary rewards (§4.1), or
            ``task_mode: detection``, ``objects``, ``sample_id`` for the detection rewards.
        meta: every other key of the JSONL row.
        rope_positions: the prompt's 3-row M-RoPE positions (Qwen-VL policies), else None.
        n_images: images in the prompt (0 = text row).
    """

    index: int
    row_id: str
    messages: list[dict[str, Any]] = field(repr=False)
    prompt_ids: list[int] = field(repr=False)
    reward_row: dict[str, Any] = field(repr=False)
    meta: dict[str, Any] = field(default_factory=dict, repr=False)
    rope_positions: tuple[tuple[int, ...], ...] | None = field(default=None, repr=False)
    n_images: int = 0

    @property
    def has_images(self) -> bool:
        """Whether the prompt holds images (sent to the server as messages, forwarded with vision tensors)."""
        return self.n_images > 0


@dataclass(frozen=True)
class PromptSet:
    """Loaded prompts and what the §3.5 deletion removed.

    Attributes:
        rows: kept rows, ``rows[i].index == i``.
        deleted_overlong: rows removed because the prompt exceeded the budget.
        budget: prompt-token budget ``global_max_length − max_completion_length``.
    """

    rows: list[PromptRow]
    deleted_overlong: int
    budget: int


def chat_messages(record: Mapping[str, Any], *, where: str) -> list[dict[str, Any]]:
    """A row's generation messages: ``messages`` minus trailing assistant turns, or built from ``prompt``.

    Raises:
        DataRecordError: neither ``messages`` nor ``prompt``, or an unusable message list.
    """
    if "messages" in record:
        messages = record["messages"]
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError(f"{where}: 'messages' must be a list of {{role, content}} objects")
        messages = [dict(m) for m in messages]
        while messages and messages[-1].get("role") == "assistant":
            messages.pop()
        if not messages:
            raise ValueError(
                f"{where}: 'messages' has no system/user turn left after dropping assistant turns"
            )
        return messages
    if isinstance(record.get("prompt"), str):
        messages = (
            [{"role": "system", "content": record["system"]}] if isinstance(record.get("system"), str) else []
        )
        return [*messages, {"role": "user", "content": record["prompt"]}]
    raise ValueError(f"{where}: a GRPO row needs 'messages' (chat list) or 'prompt' (user text)")


def _image_part(part: Any) -> bool:
    return isinstance(part, dict) and (
        part.get("type") in _IMAGE_PART_KEYS or any(k in part for k in _IMAGE_PART_KEYS)
    )


def resolve_row_images(
    messages: list[dict[str, Any]], images: Sequence[str], resolve: Callable[[str], str]
) -> list[dict[str, Any]]:
    """``messages`` with every image ref resolved and the row's ``images`` placed (module docstring rules):
    a part without a ref takes the next entry; with no image part, ``shared_schemas.images.attach_images``
    places them (the rule of a request's ``images`` on the server).

    Raises:
        ValueError: ``images`` entries that are not non-empty strings, or a count that does not fit the
            image parts of ``messages``.
    """
    if not all(isinstance(ref, str) and ref for ref in images):
        raise ValueError("'images' must be a list of non-empty strings (paths, file:// or data: URLs)")
    pending = [resolve(ref) for ref in images]
    out: list[dict[str, Any]] = []
    parts = 0
    for message in messages:
        content = message.get("content")
        if not isinstance(content, list):
            out.append(message)
            continue
        new_content = []
        for part in content:
            if _image_part(part):
                parts += 1
                part = dict(part)
                ref = iter_image_refs([{"content": [part]}])
                if ref:
                    part = {"type": "image", "image": resolve(ref[0])}
                elif pending:
                    part = {"type": "image", "image": pending.pop(0)}
                else:
                    raise ValueError(
                        f"image part {parts} has no reference and 'images' has no entry left for it"
                    )
            new_content.append(part)
        out.append({**message, "content": new_content})
    if pending and parts == 0:
        if not any(m.get("role") == "user" for m in out):
            raise ValueError("'images' given but 'messages' has no user turn to carry them")
        # the request's placement rule, as the server applies it (`<image>` tags, then the first user turn)
        return place_images(out, pending)
    if pending:
        raise ValueError(
            f"{len(pending)} 'images' entries left over: 'messages' has {parts} image part(s) without a "
            "reference for them; give each image once (in 'images' or in the message parts)"
        )
    return out


def is_detection_record(record: Mapping[str, Any]) -> bool:
    """A stage-2 detection record: ``task_mode: detection``, or ``objects`` without a ``task_mode``."""
    return record.get("task_mode") == DETECTION_TASK or ("task_mode" not in record and "objects" in record)


@dataclass(frozen=True)
class _Where:
    """Where a record sits: its file, 1-based line, index among the file's records and the file's index."""

    path: Path
    line_no: int
    base_idx: int
    namespace: int


@dataclass(frozen=True)
class _Prompts:
    system: str | None
    user: str


def _detection_row(
    record: dict[str, Any],
    where: _Where,
    *,
    image_root: str | Path | None,
    max_images: int | None,
    prompts: _Prompts,
) -> tuple[str, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    """A detection record through the stage-2 sample builder (the rules of docs/DATA.md)."""
    n_images = len(record["images"]) if isinstance(record.get("images"), list) else 0
    validated = validate_record(
        record,
        path=str(where.path),
        line_no=where.line_no,
        image_root=image_root,
        max_images_per_sample=max_images if max_images is not None else n_images,
    )
    sample = build_sample(
        validated,
        base_idx=where.base_idx,
        dataset=where.path.stem,
        dataset_namespace=where.namespace,
        system_prompt=prompts.system,
        user_prompt=record_user_text(validated, prompts.user),
    )
    reward_row = {
        "task_mode": DETECTION_TASK,
        "objects": sample["gt_objects"],
        "sample_id": sample["sample_id"],
    }
    skip = {"task_mode", "objects", "images", "id"}
    meta = {key: value for key, value in record.items() if key not in skip}
    row_id = str(record.get("id", f"{where.path.stem}:{where.line_no}"))
    return row_id, sample["messages"], reward_row, meta


def _row_from_record(
    record: Any,
    where: _Where,
    *,
    image_root: str | Path | None,
    max_images: int | None,
    prompts: _Prompts,
) -> tuple[str, list[dict[str, Any]], dict[str, Any], dict[str, Any]]:
    path, line_no = where.path, where.line_no
    if not isinstance(record, dict):
        raise DataRecordError(str(path), line_no, f"a row must be a JSON object, got {type(record).__name__}")
    if is_detection_record(record):
        return _detection_row(record, where, image_root=image_root, max_images=max_images, prompts=prompts)
    at = f"{path}:{line_no}"
    if "task_mode" not in record:
        raise DataRecordError(
            str(path),
            line_no,
            "missing 'task_mode' (summary or dense; §4.1), and no 'objects' of a detection record "
            "(docs/DATA.md)",
        )
    images = record.get("images") or []
    try:
        if not isinstance(images, list):
            raise ValueError("'images' must be a list of non-empty strings (paths, file:// or data: URLs)")
        messages = resolve_row_images(
            chat_messages(record, where=at),
            images,
            lambda ref: resolve_image(ref, path.parent, image_root),
        )
    except ValueError as exc:
        raise DataRecordError(str(path), line_no, str(exc).removeprefix(f"{at}: ")) from None
    reward_row = {key: record[key] for key in REWARD_KEYS if key in record}
    skip = {*REWARD_KEYS, "messages", "prompt", "system", "images", "id"}
    meta = {key: value for key, value in record.items() if key not in skip}
    row_id = str(record.get("id", f"{path.stem}:{line_no}"))
    return row_id, messages, reward_row, meta


def _encode_row(
    encode: Encode, messages: list[dict[str, Any]], path: Path, line_no: int
) -> EncodedLike | list[int]:
    try:
        return encode(messages)
    except (ValueError, OSError) as exc:  # images for a text-only model, an unreadable image
        raise DataRecordError(str(path), line_no, str(exc)) from None


def load_prompt_rows(
    files: Sequence[str | Path],
    encode: Encode,
    *,
    budget: int,
    image_root: str | Path | None = None,
    max_images: int | None = None,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    user_prompt: str = DEFAULT_USER_PROMPT,
) -> PromptSet:
    """Reads GRPO prompt rows from JSONL files, in file then line order, deleting overlong prompts (§3.5).

    Args:
        files: JSONL paths.
        encode: messages → the encoded prompt (``PromptEncoder.encode``) or plain templated ids.
        budget: largest allowed prompt length in tokens (``global_max_length − max_completion_length``).
        image_root: ``data.image_root`` (relative image refs; default: the JSONL file's directory).
        max_images: ``data.max_images_per_sample`` (None: no limit); a row with more images is an error (a
            detection record follows the stage-2 rule: 1 to this many images, none when it is 0).
        system_prompt, user_prompt: ``prompts.system`` / ``prompts.user``, the texts of detection records.

    Returns:
        :class:`PromptSet`.

    Raises:
        DataRecordError: a malformed line (names file and line; unreadable images and images for a text-only
            model included), or no prompt left.
    """
    rows: list[PromptRow] = []
    deleted = 0
    prompts = _Prompts(system_prompt, user_prompt)
    for namespace, file in enumerate(files):
        path = Path(file)
        base_idx = 0
        for line_no, record in iter_jsonl(path):
            row_id, messages, reward_row, meta = _row_from_record(
                record,
                _Where(path, line_no, base_idx, namespace),
                image_root=image_root,
                max_images=max_images,
                prompts=prompts,
            )
            base_idx += 1
            n_images = len(iter_image_refs(messages))
            if max_images is not None and n_images > max_images:
                raise DataRecordError(
                    str(path),
                    line_no,
                    f"{n_images} image(s) > data.max_images_per_sample {max_images} (0 = text-only "
                    "rows); raise it for a Qwen-VL model",
                )
            encoded = _encode_row(encode, messages, path, line_no)
            ids = [int(t) for t in getattr(encoded, "ids", encoded)]
            if len(ids) > budget:
                deleted += 1
                continue
            rope = getattr(encoded, "rope_positions", None)
            rows.append(PromptRow(len(rows), row_id, messages, ids, reward_row, meta, rope, n_images))
    if not rows:
        raise DataRecordError(
            ", ".join(str(f) for f in files),
            None,
            f"no prompt left ({deleted} longer than the {budget}-token budget were deleted); "
            "check data.train or raise grpo.global_max_length",
        )
    return PromptSet(rows=rows, deleted_overlong=deleted, budget=budget)


def prompt_order(num_rows: int, count: int, seed: int) -> list[int]:
    """The first ``count`` row indices of the endless prompt stream: seeded permutations, one per pass.

    Pass ``e`` is ``range(num_rows)`` shuffled with ``random.Random(seed + e)``; a step's prompts are
    consecutive entries, so the order does not depend on the world size.
    """
    if num_rows < 1:
        raise ValueError("prompt_order needs at least one row")
    order: list[int] = []
    epoch = 0
    while len(order) < count:
        perm = list(range(num_rows))
        random.Random(seed + epoch).shuffle(perm)
        order.extend(perm)
        epoch += 1
    return order[:count]


class GenerationSlots(Dataset):
    """Completion slots in step order (see the module docstring); item ``i`` is a small tag dict.

    Item keys: ``step`` (window), ``slot`` (position in the window), ``prompt_slot`` (``p``, position of the
    prompt in the step's generation batch), ``generation`` (``j``), ``row`` (prompt row index).

    Args:
        num_rows: prompts available.
        prompts_per_step: ``P = generation_batch_size / num_generations``.
        num_generations: ``G``.
        num_steps: windows listed (``max_steps``, or one pass over the prompts).
        seed: prompt-order seed (``training.seed``).
    """

    def __init__(
        self, *, num_rows: int, prompts_per_step: int, num_generations: int, num_steps: int, seed: int
    ) -> None:
        if prompts_per_step < 1 or num_generations < 1 or num_steps < 1:
            raise ValueError(
                f"GenerationSlots needs prompts_per_step, num_generations and num_steps >= 1, got "
                f"{prompts_per_step}, {num_generations}, {num_steps}"
            )
        self.prompts_per_step = prompts_per_step
        self.num_generations = num_generations
        self.num_steps = num_steps
        self._rows = prompt_order(num_rows, prompts_per_step * num_steps, seed)

    @property
    def slots_per_step(self) -> int:
        return self.prompts_per_step * self.num_generations

    def __len__(self) -> int:
        return self.num_steps * self.slots_per_step

    def __getitem__(self, index: int) -> dict[str, int]:
        if not 0 <= index < len(self):
            raise IndexError(f"slot {index} outside [0, {len(self)})")
        step, slot = divmod(index, self.slots_per_step)
        p, j = divmod(slot, self.num_generations)
        return {
            "step": step,
            "slot": slot,
            "prompt_slot": p,
            "generation": j,
            "row": self._rows[step * self.prompts_per_step + p],
        }
