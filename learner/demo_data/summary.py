"""Tiny synthetic "summary" set for the CPU GRPO demo (docs/ALGORITHM.md#summary-task).

The tiny demo LM has no vision tower, so the "image" is a short text description of the scene in the user
prompt; the expected answer is the §4.2 completion (header line + one JSON line, or ``无关图片``). Rows carry
the §4.1 reference metadata (``task_mode``, ``domain``, ``summary_ref``) that the rewards read, plus the
reference ``answer`` text that the optional SFT warm start (:mod:`learner.grpo.warm_start`) trains on.

Design choices (why the tiny model can raise the rewards within ~30 GRPO steps after a short warm start):

- The scene text lists the facts in answer order, so the answer is a structured copy of the prompt.
- Two domains (``BBU``/``RRU``) pick the header; ~20 % irrelevant rows answer ``无关图片``. A weakly
  warm-started model confuses the domain and the two answer shapes often enough that the format/header/strict
  rewards vary inside a group — the signal GRPO needs — and improve quickly.
- A small closed vocabulary (3 categories per domain, attributes from the §5 path list) keeps every fact
  frequent.
- The warm start is trained on NOISY answers (:func:`with_task_noise`): half of them carry the header of the
  other task, ``<TASK=DENSE>``. The warm-started policy is then unsure about that one header token — a
  mode choice with maximal spread inside every group — and the header/strict rewards (−4 points for the
  wrong tag) tell GRPO which mode is right, so they rise within a few dozen steps.

Image rows (:func:`generate_image_rows`, the Qwen-VL demo): the same §4 task read off a picture. A scene of
1–3 flat shapes (``learner.demo_data.images``' renderer: each category has one colour and one shape)
summarises as one ``统计`` entry per category with its count (``可见性: {完整: n}``); ~20 % of the images are
pixel noise, whose right answer is ``无关图片``. The user turn only names the domain (which picks the header).

Everything is pure and seeded: the same ``(seed, split, n)`` always gives the same rows; the train and eval
splits use independent RNG streams.
"""

from __future__ import annotations

import io
import json
import random
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from PIL import Image

from learner.demo_data.files import write_if_changed
from learner.demo_data.images import ImageDemoConfig, PixelObject, render_scene, sample_pixel_scene
from learner.rewards.summary_parse import IRRELEVANT, expected_header

__all__ = [
    "ATTRIBUTES",
    "CATEGORIES",
    "DOMAINS",
    "IMAGE_SYSTEM_PROMPT",
    "SYSTEM_PROMPT",
    "answer_text",
    "generate_image_rows",
    "generate_rows",
    "image_demo_config",
    "image_reference",
    "irrelevant_image",
    "make_row",
    "sample_reference",
    "scene_text",
    "with_task_noise",
    "write_rows",
]

DOMAINS: tuple[str, ...] = ("BBU", "RRU")
CATEGORIES: dict[str, tuple[str, ...]] = {"BBU": ("A", "B", "C"), "RRU": ("R", "S", "T")}
"""Category names per domain (single ASCII letters: one token each for the tiny tokenizer)."""
ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "可见性": ("完整", "部分"),
    "捆扎": ("整齐", "松散"),
    "位置": ("左侧", "右侧"),
}
"""Attribute keys (all in the §5 ``attr_path_recall`` parent list) and their values."""
SYSTEM_PROMPT = "Summarize the scene."
"""Kept short: the answer format is learned (warm start + rewards), and prompt tokens cost CPU time."""
IRRELEVANT_FRACTION = 0.2
_SPLIT_SALT = {"train": 0, "eval": 1}


def sample_reference(rng: random.Random, domain: str) -> dict[str, Any]:
    """A reference summary object: 1–2 categories, each with 1–2 attributes of one value and a count 1–3."""
    names = rng.sample(CATEGORIES[domain], rng.randint(1, 2))
    stats = []
    for name in sorted(names):
        entry: dict[str, Any] = {"类别": name}
        for key in sorted(rng.sample(list(ATTRIBUTES), rng.randint(1, 2))):
            entry[key] = {rng.choice(ATTRIBUTES[key]): rng.randint(1, 3)}
        stats.append(entry)
    return {"统计": stats}


def scene_text(domain: str, ref: dict[str, Any] | None) -> str:
    """The user prompt: the domain and the facts in answer order (``None`` → an irrelevant scene)."""
    if ref is None:
        return f"domain {domain}. scene: nothing relevant"
    facts = []
    for entry in ref["统计"]:
        attrs = " ".join(
            f"{key}={value} x{count}"
            for key, values in entry.items()
            if key != "类别"
            for value, count in values.items()
        )
        facts.append(f"{entry['类别']} {attrs}")
    return f"domain {domain}. scene: " + "; ".join(facts)


def answer_text(domain: str, ref: dict[str, Any] | None) -> str:
    """The §4.2 reference completion (without the end-of-turn token)."""
    if ref is None:
        return IRRELEVANT
    return f"{expected_header(domain)}\n{json.dumps(ref, ensure_ascii=False)}"


def make_row(rng: random.Random, row_id: str) -> dict[str, Any]:
    """One dataset row: chat ``messages`` (system + user), §4.1 metadata and the reference ``answer``."""
    domain = rng.choice(DOMAINS)
    ref = None if rng.random() < IRRELEVANT_FRACTION else sample_reference(rng, domain)
    return {
        "id": row_id,
        "messages": [
            {"role": "system", "content": SYSTEM_PROMPT},
            {"role": "user", "content": scene_text(domain, ref)},
        ],
        "task_mode": "summary",
        "domain": domain,
        "summary_ref": IRRELEVANT if ref is None else ref,
        "answer": answer_text(domain, ref),
    }


def _check_request(n: int, split: str, splits: Mapping[str, Any]) -> None:
    """Raises the ``ValueError`` of the row generators: ``split`` not in ``splits``, or ``n`` negative."""
    if split not in splits:
        raise ValueError(f"split {split!r} is not one of {sorted(splits)}")
    if n < 0:
        raise ValueError(f"n={n} must be >= 0")


def generate_rows(n: int, *, seed: int = 0, split: str = "train") -> list[dict[str, Any]]:
    """``n`` rows of ``split`` (``train`` or ``eval``), deterministic in ``(seed, split, n)``.

    Raises:
        ValueError: unknown split or negative ``n``.
    """
    _check_request(n, split, _SPLIT_SALT)
    rng = random.Random(seed * 1_000_003 + _SPLIT_SALT[split])
    return [make_row(rng, f"{split}-{i:05d}") for i in range(n)]


def write_rows(path: Path, rows: list[dict[str, Any]]) -> bool:
    """Writes ``rows`` as JSONL to ``path`` unless it already holds exactly that text; True when written."""
    text = "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
    return write_if_changed(Path(path), text.encode("utf-8"))


def with_task_noise(rows: list[dict[str, Any]], fraction: float, *, seed: int = 0) -> list[dict[str, Any]]:
    """Copies of ``rows`` whose ``answer`` header says ``<TASK=DENSE>`` for a seeded ``fraction`` of the
    relevant rows (the rewards expect ``<TASK=SUMMARY>``); the reference metadata is unchanged.

    Raises:
        ValueError: ``fraction`` outside [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"fraction={fraction} must be in [0, 1]")
    rng = random.Random(f"task-noise:{seed}")
    out = []
    for row in rows:
        row = dict(row)
        if row["summary_ref"] != IRRELEVANT and rng.random() < fraction:
            row["answer"] = row["answer"].replace("<TASK=SUMMARY>", "<TASK=DENSE>", 1)
        out.append(row)
    return out


# -- image rows (the Qwen-VL GRPO demo) ----------------------------------------------------------------------
IMAGE_SYSTEM_PROMPT = "Summarize the image."
IMAGE_COUNT_KEY = "可见性"
"""Attribute key of the image rows' counts (in the §5 ``attr_path_recall`` parent list)."""
IMAGE_COUNT_VALUE = "完整"
_IMAGE_SALT = {"train": "train", "eval": "eval"}


def image_demo_config() -> ImageDemoConfig:
    """128-px scenes (16 image tokens on the tiny Qwen3-VL): 1–3 large objects of the five demo categories."""
    return ImageDemoConfig(size=128, grid=8, min_objects=1, max_objects=3, min_side=32, max_side=56)


def image_reference(objects: Sequence[PixelObject]) -> dict[str, Any]:
    """The summary an image shows: one entry per drawn category (sorted), its object count under
    ``可见性/完整`` — everything in it can be read off the pixels (colour and shape name the category)."""
    counts: dict[str, int] = {}
    for obj in objects:
        counts[obj.desc] = counts.get(obj.desc, 0) + 1
    return {
        "统计": [
            {"类别": name, IMAGE_COUNT_KEY: {IMAGE_COUNT_VALUE: counts[name]}} for name in sorted(counts)
        ]
    }


def irrelevant_image(rng: random.Random, size: int) -> Image.Image:
    """An image that does not belong to the task: coloured pixel noise (never a flat shape on stripes)."""
    return Image.frombytes("RGB", (size, size), rng.randbytes(size * size * 3))


def generate_image_rows(
    n: int, out_dir: Path, *, seed: int = 0, split: str = "train"
) -> list[dict[str, Any]]:
    """``n`` image rows of ``split``, their PNGs written under ``out_dir/images/`` (unchanged files are kept).

    A row: ``messages`` (system + a user turn naming the domain), ``images`` (the PNG path relative to
    ``out_dir``, resolved like stage-2 records), the §4.1 metadata and the reference ``answer``. About
    ``IRRELEVANT_FRACTION`` of the rows show pixel noise and answer ``无关图片``. Deterministic in
    ``(seed, split, n)``; train and eval use independent RNG streams.

    Raises:
        ValueError: unknown split or negative ``n``.
    """
    _check_request(n, split, _IMAGE_SALT)
    cfg = image_demo_config()
    rng = random.Random(f"rollmatch-grpo-vlm/{split}/{seed}")
    rows = []
    for i in range(n):
        domain = rng.choice(DOMAINS)
        if rng.random() < IRRELEVANT_FRACTION:
            ref = None
            image = irrelevant_image(rng, cfg.size)
        else:
            objects = sample_pixel_scene(rng, cfg)
            ref = image_reference(objects)
            image = render_scene(objects, rng, cfg)
        rel = f"images/{split}_{i:05d}.png"
        _write_png(Path(out_dir) / rel, image)
        rows.append(
            {
                "id": f"{split}-img-{i:05d}",
                "messages": [
                    {"role": "system", "content": IMAGE_SYSTEM_PROMPT},
                    {"role": "user", "content": f"domain {domain}"},
                ],
                "images": [rel],
                "task_mode": "summary",
                "domain": domain,
                "summary_ref": IRRELEVANT if ref is None else ref,
                "answer": answer_text(domain, ref),
            }
        )
    return rows


def _write_png(path: Path, image: Image.Image) -> None:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    write_if_changed(path, buf.getvalue())
