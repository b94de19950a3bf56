"""JSONL data records and the sample dict handed to the learner (docs/ALGORITHM.md#records §1.1, §1.4, §1.5).

Pure: reading and validating records, resolving image paths, building sample dicts. The torch ``Dataset``
wrapper lives with the trainer. Record-level violations raise ``DataRecordError(path, line_no, reason)``;
object-level ones are left to GT extraction (§7), which counts and logs them.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, Literal

from learner.data.errors import DataRecordError
from learner.data.messages import DEFAULT_SYSTEM_PROMPT, DEFAULT_USER_PROMPT, build_messages
from learner.stage2.format import serialize_objects
from learner.stage2.gt import GTObject, MalformedObjectError, order_objects, parse_gt_object
from shared_schemas.images import ImageRefError, local_image_path

__all__ = [
    "DataRecordError",
    "build_sample",
    "iter_jsonl",
    "iter_records",
    "load_records",
    "make_sample_id",
    "record_user_text",
    "resolve_image",
    "scene_user_text",
    "validate_record",
]

_PASSTHROUGH = ("summary", "metadata")


def resolve_image(ref: str, jsonl_dir: str | Path, image_root: str | Path | None = None) -> str:
    """Resolve one image reference (§1.1): URLs, data URLs and absolute paths are kept; a relative path is
    joined to ``image_root`` when set, else to the JSONL file's directory, and made absolute."""
    if ref.startswith("data:") or "://" in ref or os.path.isabs(ref):
        return ref
    base = image_root if image_root is not None else jsonl_dir
    return os.path.normpath(os.path.join(os.path.abspath(base), ref))


def _missing_local_file(ref: str) -> bool:
    """True when `ref` names a local file (path or `file://` URL) that does not exist. Data URLs, and
    references `shared_schemas.images` refuses anyway (unknown scheme, another host), are left to the decode
    error."""
    try:
        path = local_image_path(ref)
    except ImageRefError:
        return False
    return path is not None and not path.is_file()


def _is_pos_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v > 0


def validate_record(
    record: Any,
    *,
    path: str | None = None,
    line_no: int | None = None,
    image_root: str | Path | None = None,
    max_images_per_sample: int = 1,
) -> dict[str, Any]:
    """Check the record-level rules of §1.1 and return a copy with resolved image paths.

    Args:
        record: the decoded JSON line.
        path: the JSONL file (for errors and relative image paths; the current directory when ``None``).
        line_no: 1-based line number (for errors).
        image_root: ``data.image_root``.
        max_images_per_sample: ``data.max_images_per_sample``; a record holds 1 to this many images, or
            none at all when it is 0 (text-only models such as the embedded demo LM).

    Raises:
        DataRecordError: a missing field, a wrong type, a non-positive size, or a bad image count.
    """

    def fail(reason: str) -> DataRecordError:
        return DataRecordError(path, line_no, reason)

    if not isinstance(record, Mapping):
        raise fail(f"record is a JSON {type(record).__name__}, expected an object")
    for key in ("images", "width", "height", "objects"):
        if key not in record:
            raise fail(f"missing required field {key!r}")
    images = record["images"]
    if not isinstance(images, list) or not all(isinstance(i, str) and i for i in images):
        raise fail("field 'images' must be a list of non-empty strings (paths, URLs or data URLs)")
    lowest = 0 if max_images_per_sample == 0 else 1
    if not lowest <= len(images) <= max_images_per_sample:
        raise fail(
            f"field 'images' has {len(images)} entries; expected {lowest} to {max_images_per_sample} "
            "(data.max_images_per_sample; 0 means text-only records)"
        )
    for key in ("width", "height"):
        if not _is_pos_int(record[key]):
            raise fail(f"field {key!r} = {record[key]!r} must be an int > 0 (pixel size of the stored image)")
    if not isinstance(record["objects"], list):
        raise fail(f"field 'objects' must be a list (may be empty), got {type(record['objects']).__name__}")
    jsonl_dir = os.path.dirname(path) if path else "."
    out = dict(record)
    out["images"] = [resolve_image(i, jsonl_dir or ".", image_root) for i in images]
    return out


def iter_jsonl(path: str | Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(line_no, parsed JSON value)`` for every non-blank line of a JSONL file: the one JSONL reader
    of the record loaders (stage-2 records, GRPO prompt rows).

    Raises:
        DataRecordError: a line is not valid JSON (names the file, the line and the column).
    """
    p = str(path)
    with open(p, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DataRecordError(p, line_no, f"invalid JSON: {exc.msg} at column {exc.colno}") from exc
            yield line_no, obj


def iter_records(
    path: str | Path,
    *,
    image_root: str | Path | None = None,
    max_images_per_sample: int = 1,
) -> Iterator[tuple[int, dict[str, Any]]]:
    """Yield ``(line_no, validated record)`` for every non-blank line of a JSONL file.

    Raises:
        DataRecordError: a line is not valid JSON or violates §1.1.
    """
    p = str(path)
    for line_no, obj in iter_jsonl(p):
        yield (
            line_no,
            validate_record(
                obj,
                path=p,
                line_no=line_no,
                image_root=image_root,
                max_images_per_sample=max_images_per_sample,
            ),
        )


def load_records(
    path: str | Path, *, image_root: str | Path | None = None, max_images_per_sample: int = 1
) -> list[dict[str, Any]]:
    """All validated records of a JSONL file (row ``j`` of the result has ``base_idx = j``).

    Every local image file must exist (one ``stat`` each, at load time): a missing file would otherwise
    surface at the rollout that first draws its record, possibly hours into a run. URLs and data URLs are
    not fetched.

    Raises:
        DataRecordError: a record violates §1.1, or image files are missing (the first few are listed with
            their lines, and the count).
    """
    rows = list(iter_records(path, image_root=image_root, max_images_per_sample=max_images_per_sample))
    missing = [
        (line_no, ref) for line_no, record in rows for ref in record["images"] if _missing_local_file(ref)
    ]
    if missing:
        shown = "; ".join(f"line {line_no}: {ref}" for line_no, ref in missing[:5])
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        root = (
            "data.image_root"
            if image_root is not None
            else "the JSONL file's folder (or set data.image_root)"
        )
        raise DataRecordError(
            str(path),
            missing[0][0],
            f"{len(missing)} image file(s) do not exist: {shown}{more}; relative paths are resolved against"
            f" {root}",
        )
    return [record for _, record in rows]


def scene_user_text(user_prompt: str, scene: str) -> str:
    """The user text of a record with a scene: the configured user prompt, a newline, the scene."""
    return f"{user_prompt}\n{scene}"


def record_user_text(record: Mapping[str, Any], user_prompt: str) -> str:
    """The user text of any record: ``user_prompt``, with the record's ``metadata.scene`` appended on a new
    line when it has one (a text-only record describes its scene in the prompt, as the text demo's do)."""
    scene = (record.get("metadata") or {}).get("scene")
    return scene_user_text(user_prompt, scene) if scene else user_prompt


def make_sample_id(dataset_namespace: int, base_idx: int) -> int:
    """``(dataset_namespace << 32) | base_idx`` (§1.5)."""
    if dataset_namespace < 0:
        raise ValueError(f"dataset namespace {dataset_namespace} must be >= 0")
    if not 0 <= base_idx < 1 << 32:
        raise ValueError(f"base_idx {base_idx} must be in [0, 2**32)")
    return (dataset_namespace << 32) | base_idx


def build_sample(
    record: Mapping[str, Any],
    *,
    base_idx: int,
    dataset: str,
    dataset_namespace: int,
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    user_prompt: str = DEFAULT_USER_PROMPT,
    ordering: Literal["sorted", "random"] = "sorted",
    seed: int = 0,
    include_assistant: bool = False,
) -> dict[str, Any]:
    """Build the §1.5 sample dict from a validated record.

    Args:
        record: output of ``validate_record`` (image paths already resolved).
        base_idx: row index within its dataset.
        dataset: dataset name.
        dataset_namespace: the dataset's stable position in the configured dataset list.
        system_prompt / user_prompt: resolved ``prompts.system`` / ``prompts.user``.
        ordering: ``data.object_ordering``; ``seed``: ``training.seed`` (used by ``random``).
        include_assistant: append the GT answer (§4 format, well-formed objects only) as an assistant turn.

    Returns:
        ``{"messages", "gt_objects", "images", "width", "height", "base_idx", "dataset", "sample_id"}`` plus
        ``summary`` / ``metadata`` when the record has them.
    """
    objects = order_objects(record["objects"], ordering, seed=seed, base_idx=base_idx)
    assistant = None
    if include_assistant:
        good = []
        for pos, obj in enumerate(objects, start=1):
            try:
                desc, geom, bins = parse_gt_object(obj)
            except MalformedObjectError:
                continue  # counted and logged by GT extraction, where the learner sees it
            good.append(GTObject(index=pos, desc=desc, geom_type=geom, bins=bins))
        assistant = serialize_objects(good)
    sample: dict[str, Any] = {
        "messages": build_messages(
            record["images"], system_prompt=system_prompt, user_prompt=user_prompt, assistant_text=assistant
        ),
        "gt_objects": objects,
        "images": list(record["images"]),
        "width": record["width"],
        "height": record["height"],
        "base_idx": base_idx,
        "dataset": dataset,
        "sample_id": make_sample_id(dataset_namespace, base_idx),
    }
    for key in _PASSTHROUGH:
        if key in record:
            sample[key] = record[key]
    return sample
