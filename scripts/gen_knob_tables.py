#!/usr/bin/env python
"""Markdown knob tables generated from the config models, so docs/RUNBOOK.md cannot drift from the code.

One table per YAML section: every field of `learner.config.RunConfig` (learner process) and the typed keys of
its `training:` mapping (`learner.training_config.TrainingConfig`),
`shared_schemas.server_config.ServerConfig` (the one `server:` schema: rollout server process and GRPO
resolver) and the GRPO sections (`learner.grpo.config.sections.GrpoConfig`,
`learner.grpo.config.batch_plan.BatchPlan`), with its type and constraints, its default and its docstring.
Nested pydantic sections become their own tables; opaque mappings are rows.

    python scripts/gen_knob_tables.py                         # print the tables
    python scripts/gen_knob_tables.py --write docs/RUNBOOK.md # replace the generated block in place
    python scripts/gen_knob_tables.py --check docs/RUNBOOK.md # exit 1 when the block is stale

The generated block sits between `BEGIN_MARKER` and `END_MARKER` in the target file.
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

import annotated_types
from pydantic import BaseModel, SecretStr
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

BEGIN_MARKER = (
    "<!-- BEGIN GENERATED KNOB TABLES: python scripts/gen_knob_tables.py --write docs/RUNBOOK.md -->"
)
END_MARKER = "<!-- END GENERATED KNOB TABLES -->"
MAX_DEFAULT_CHARS = 48
"""Longer defaults (the prompt texts) are cut with an ellipsis: the table is an index, the code is the
source."""


@dataclass(frozen=True)
class KnobRow:
    """One leaf knob: dotted YAML key, rendered type (with constraints), default and description."""

    key: str
    type: str
    default: str
    description: str


@dataclass(frozen=True)
class Section:
    """One YAML section (a pydantic model) and its leaf knobs, in declaration order."""

    key: str
    doc: str
    rows: tuple[KnobRow, ...]


def _is_model(annotation: Any) -> bool:
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _list_item_model(annotation: Any) -> type[BaseModel] | None:
    """The item model of a `list[Model]` field (e.g. `rollout.servers`), else None."""
    args = get_args(annotation)
    if get_origin(annotation) is list and len(args) == 1 and _is_model(args[0]):
        return args[0]
    return None


def _one_line(text: str | None) -> str:
    return " ".join((text or "").split())


def type_name(annotation: Any) -> str:
    """A short YAML-oriented name of a field annotation (`Literal` values joined by `|`, None as `null`)."""
    origin = get_origin(annotation)
    args = get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is Literal:
        return " | ".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if annotation is type(None):
        return "null"
    if annotation is SecretStr:
        return "str (secret)"
    if _list_item_model(annotation) is not None:
        return "list[mapping]"
    if origin in (list, tuple):
        inner = [a for a in args if a is not Ellipsis]
        return f"list[{type_name(inner[0])}]" if inner else "list"
    if origin is dict:
        return f"mapping[{type_name(args[0])}, {type_name(args[1])}]" if args else "mapping"
    if annotation is Any:
        return "any"
    return getattr(annotation, "__name__", str(annotation))


_BOUNDS = (
    (annotated_types.Ge, "ge", "≥"),
    (annotated_types.Gt, "gt", ">"),
    (annotated_types.Le, "le", "≤"),
    (annotated_types.Lt, "lt", "<"),
)


def constraints(field: FieldInfo) -> str:
    """Numeric bounds of a field (`Field(ge=..., lt=...)`) as `≥ 1, < 1`."""
    parts = []
    for meta in field.metadata:
        for kind, attr, sign in _BOUNDS:
            if isinstance(meta, kind):
                parts.append(f"{sign} {getattr(meta, attr)}")
    return ", ".join(parts)


def render_default(field: FieldInfo) -> str:
    """The default as it would be written in YAML; `required` when there is none."""
    if field.default is PydanticUndefined and field.default_factory is None:
        return "**required**"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if isinstance(value, BaseModel):
        value = value.model_dump(mode="json")
    if value is None:
        text = "null"
    elif isinstance(value, bool):
        text = "true" if value else "false"
    elif isinstance(value, str):
        text = value
    elif isinstance(value, tuple):
        text = json.dumps(list(value), ensure_ascii=False)
    else:
        text = json.dumps(value, ensure_ascii=False)
    if len(text) > MAX_DEFAULT_CHARS:
        text = text[: MAX_DEFAULT_CHARS - 1] + "…"
    return f"`{text}`"


def iter_sections(model: type[BaseModel], key: str, doc: str | None = None) -> Iterator[Section]:
    """Sections of `model` under the dotted `key`, depth first: the section itself, then its sub-sections.

    A field whose annotation is a pydantic model is a sub-section; a `list[Model]` field is a row and its
    item model a sub-section keyed `<key>[]`; every other field is a row.
    """
    rows: list[KnobRow] = []
    subs: list[tuple[str, type[BaseModel], str]] = []
    for name, field in model.model_fields.items():
        name = field.alias or name  # the YAML key (`rollout.async` is the field `async_`)
        dotted = f"{key}.{name}" if key else name
        if _is_model(field.annotation):
            sub_doc = field.description or field.annotation.__doc__  # type: ignore[union-attr]
            subs.append((dotted, field.annotation, sub_doc or ""))  # type: ignore[arg-type]
            continue
        item = _list_item_model(field.annotation)
        if item is not None:
            subs.append((f"{dotted}[]", item, item.__doc__ or ""))
        kind = type_name(field.annotation)
        bounds = constraints(field)
        rows.append(
            KnobRow(
                key=dotted,
                type=f"{kind} ({bounds})" if bounds else kind,
                default=render_default(field),
                description=_one_line(field.description),
            )
        )
    if rows:
        yield Section(key=key, doc=_one_line(doc if doc is not None else model.__doc__), rows=tuple(rows))
    for dotted, sub, sub_doc in subs:
        yield from iter_sections(sub, dotted, sub_doc)


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def section_table(section: Section) -> str:
    """One markdown table (heading, section docstring, rows)."""
    lines = [f"#### `{section.key or '(top level)'}`", ""]
    if section.doc:
        lines += [_cell(section.doc), ""]
    lines += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for row in section.rows:
        lines.append(
            f"| `{row.key}` | {_cell(row.type)} | {_cell(row.default)} | {_cell(row.description) or '—'} |"
        )
    return "\n".join(lines)


def render_all() -> str:
    """Every table of the three processes' configs, as one markdown block (no trailing newline)."""
    from learner.config import RunConfig
    from learner.grpo.config.batch_plan import BatchPlan
    from learner.grpo.config.sections import GrpoConfig
    from learner.training_config import TrainingConfig
    from shared_schemas.server_config import ServerConfig

    groups = [
        (
            "Learner (`python -m learner`): `learner.config.RunConfig`",
            "Everything except `server:` (the learner keeps `server:` and `grpo:` as opaque mappings).",
            (
                *iter_sections(RunConfig, "", "Top-level keys of a run YAML."),
                *iter_sections(TrainingConfig, "training"),
            ),
        ),
        (
            "Rollout server (`python -m rollout_server`): `shared_schemas.server_config.ServerConfig`",
            "Only the `server:` section of a run YAML (or a server-only YAML); a GRPO run's resolver"
            " validates the same section with the same models.",
            iter_sections(ServerConfig, "server"),
        ),
        (
            "GRPO runs: `learner.grpo.config.sections.GrpoConfig`"
            " and `learner.grpo.config.batch_plan.BatchPlan`",
            "Read by `learner.grpo.config.validate_grpo_run` (docs/ALGORITHM.md#grpo-config), which checks"
            " `server:` with the server's `ServerConfig` above, limited to the keys of GRPO §2.2.",
            (*iter_sections(GrpoConfig, "grpo"), *iter_sections(BatchPlan, "batch_plan")),
        ),
    ]
    out: list[str] = []
    for title, note, sections in groups:
        out += [f"### {title}", "", note, ""]
        for section in sections:
            out += [section_table(section), ""]
    return "\n".join(out).rstrip("\n")


def replace_block(text: str, block: str) -> str:
    """`text` with everything between the markers replaced by `block`.

    Raises:
        ValueError: a marker is missing or out of order.
    """
    start, end = text.find(BEGIN_MARKER), text.find(END_MARKER)
    if start < 0 or end < start:
        raise ValueError(f"the markers {BEGIN_MARKER!r} … {END_MARKER!r} are missing or out of order")
    return text[: start + len(BEGIN_MARKER)] + "\n\n" + block + "\n\n" + text[end:]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--write", type=Path, help="replace the generated block of this markdown file")
    group.add_argument("--check", type=Path, help="exit 1 when this file's generated block is stale")
    args = parser.parse_args(argv)
    block = render_all()
    if args.write is None and args.check is None:
        print(block)
        return 0
    target: Path = args.write or args.check
    text = target.read_text(encoding="utf-8")
    try:
        updated = replace_block(text, block)
    except ValueError as exc:
        print(f"{target}: {exc}", file=sys.stderr)
        return 2
    if args.write is not None:
        target.write_text(updated, encoding="utf-8")
        return 0
    if updated != text:
        print(
            f"{target}: knob tables are stale; run python scripts/gen_knob_tables.py --write {target}",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
