"""YAML loading for the learner (docs/ARCHITECTURE.md#configuration), separate from the config models.

The learner's import path for the loader both processes use, defined once in `shared_schemas.config`:
`extends:` chains, `~`, deep merge, lists replace, cycles are errors; `ConfigError`; and the one-line form
of a pydantic `ValidationError` (`format_validation_error`), so `__main__` can print one line and exit 2.
"""

from __future__ import annotations

from shared_schemas.config import ConfigError, deep_merge, format_validation_error, load_yaml_with_extends

__all__ = ["ConfigError", "deep_merge", "format_validation_error", "load_yaml_with_extends"]
