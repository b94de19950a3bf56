"""``summary.schema_tree`` (docs/ALGORITHM.md#schema-tree) and its per-domain schema data file.

Schema file format (JSON; see ``learner/rewards/schemas/README.md``)::

    {
      "BBU": {
        "top_level_allowed": ["统计", "备注"],
        "top_level_required": ["统计"],
        "categories": {
          "A": {
            "required": ["可见性"],
            "any_of": [["捆扎", "保护措施"]],
            "allowed": ["可见性", "捆扎", "保护措施"]
          }
        }
      },
      "RRU": {...}
    }

Every ``required`` and ``any_of`` key of a category must also be ``allowed`` (checked on load). A domain
absent from the file scores 0.0 (logged once per domain) rather than raising on one rank.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, RootModel, ValidationError, model_validator

from learner.rewards.summary_parse import SummarySample, categories, is_digits, pred_and_ref

logger = logging.getLogger(__name__)

EXTRA_KEY_WEIGHT = 0.35
HALLUCINATION_WEIGHT = 0.25
EXTRA_TOP_WEIGHT = 0.30
STATION_DISTANCE_PENALTY = 0.60
STATION_DISTANCE_KEY = "站点距离"

_warned_domains: set[str] = set()


class CategorySchema(BaseModel):
    """Key rules of one category."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    required: tuple[str, ...] = ()
    """Keys the merged predicted entry must contain when the reference has this category."""
    any_of: tuple[Annotated[tuple[str, ...], Field(min_length=1)], ...] = ()
    """Key groups; each group is met by any one of its keys."""
    allowed: tuple[str, ...] = ()
    """Every attribute key the category may carry; other predicted keys count as extra."""

    @model_validator(mode="after")
    def _required_keys_allowed(self) -> CategorySchema:
        needed = set(self.required).union(*self.any_of)
        missing = sorted(needed - set(self.allowed))
        if missing:
            raise ValueError(f"required/any_of keys {missing} are not in 'allowed'; add them to 'allowed'")
        return self


class DomainSchema(BaseModel):
    """Schema of one domain (``BBU`` or ``RRU``)."""

    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    top_level_allowed: tuple[str, ...]
    """Top-level keys a prediction may carry."""
    top_level_required: tuple[str, ...] = ()
    """Top-level keys a prediction must carry."""
    categories: dict[str, CategorySchema] = {}
    """Known categories by name; predicted keys of unknown categories all count as extra."""


class SummarySchemas(RootModel[dict[str, DomainSchema]]):
    """All domain schemas of one schema file, keyed by domain."""

    model_config = ConfigDict(frozen=True)

    def for_domain(self, domain: str) -> DomainSchema | None:
        return self.root.get(domain)


def load_schemas(path: Path) -> SummarySchemas:
    """Reads and validates a schema file.

    Raises:
        ValueError: the file is missing, not JSON or breaks the format (message names the file and key).
    """
    try:
        return SummarySchemas.model_validate_json(Path(path).read_bytes())
    except OSError as exc:
        raise ValueError(f"cannot read summary schema file {path}: {exc.strerror}") from exc
    except ValidationError as exc:
        first = exc.errors()[0]
        loc = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"summary schema file {path}: {loc or '<root>'}: {first['msg']}") from exc


def _station_distance_invalid(value: Any) -> bool:
    """True when a ``站点距离`` value breaks the RRU rule (object keys or scalars not digits-only)."""
    if isinstance(value, dict):
        return any(not is_digits(key) for key in value)
    if isinstance(value, list):
        return any(_station_distance_invalid(item) for item in value)
    if isinstance(value, bool):
        return True
    if isinstance(value, int):
        return False
    return not (isinstance(value, str) and is_digits(value))


def has_bad_station_distance(value: Any) -> bool:
    """Searches every depth of ``value`` for a ``站点距离`` key whose value breaks the RRU rule."""
    if isinstance(value, dict):
        for key, child in value.items():
            if key == STATION_DISTANCE_KEY and _station_distance_invalid(child):
                return True
            if has_bad_station_distance(child):
                return True
    elif isinstance(value, list):
        return any(has_bad_station_distance(item) for item in value)
    return False


def _completeness(pred: dict[str, Any], ref: dict[str, Any], schema: DomainSchema) -> float:
    pred_cats = categories(pred)
    met = total = 0
    for key in schema.top_level_required:
        total += 1
        met += key in pred
    for name in categories(ref):
        rules = schema.categories.get(name)
        if rules is None:
            continue
        keys = pred_cats.get(name, {})
        for key in rules.required:
            total += 1
            met += key in keys
        for group in rules.any_of:
            total += 1
            met += any(key in keys for key in group)
    return met / total if total else 1.0


def schema_tree_score(pred: dict[str, Any], ref: dict[str, Any], schema: DomainSchema, domain: str) -> float:
    """The §5.1 formula for one parsed prediction against its reference."""
    pred_cats = categories(pred)
    n_keys = extra_keys = 0
    for name, attrs in pred_cats.items():
        rules = schema.categories.get(name)
        allowed = set(rules.allowed) if rules is not None else set()
        n_keys += len(attrs)
        extra_keys += sum(key not in allowed for key in attrs)
    ref_names = set(categories(ref))
    halluc = sum(name not in ref_names for name in pred_cats)
    extra_top = sum(key not in schema.top_level_allowed for key in pred)
    penalty = STATION_DISTANCE_PENALTY if domain == "RRU" and has_bad_station_distance(pred) else 0.0
    reward = (
        _completeness(pred, ref, schema)
        - EXTRA_KEY_WEIGHT * extra_keys / max(1, n_keys)
        - HALLUCINATION_WEIGHT * halluc / max(1, len(pred_cats))
        - EXTRA_TOP_WEIGHT * extra_top / max(1, len(pred))
        - penalty
    )
    return max(-1.0, min(1.0, reward))


def schema_tree_reward(sample: SummarySample, schemas: SummarySchemas) -> float:
    """``summary.schema_tree``: schema-conformance of the prediction (§5.1); 0.0 without a domain schema."""
    pair = pred_and_ref(sample)
    if pair is None:
        return 0.0
    domain = sample.row.domain
    schema = schemas.for_domain(domain)
    if schema is None:
        if domain not in _warned_domains:
            _warned_domains.add(domain)
            logger.warning(
                "summary.schema_tree: no schema for domain %r; it scores 0.0 for that domain", domain
            )
        return 0.0
    return schema_tree_score(pair[0], pair[1], schema, domain)
