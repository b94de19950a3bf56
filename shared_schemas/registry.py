"""Name → class registries filled by a class decorator (each end's weight-sync transports use one)."""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import Any, TypeVar

__all__ = ["registrar"]

_C = TypeVar("_C", bound=type)


def registrar(
    table: dict[str, Any], what: str, names: Collection[str] | None = None
) -> Callable[[str], Callable[[_C], _C]]:
    """A `register(name)` class decorator for `table`: sets the class's `name` and adds it; a name is
    registered once (another class under a taken name raises `ValueError` naming `what`), and only one of
    `names` when given (e.g. `shared_schemas.sync.TRANSPORT_NAMES`)."""

    def register(name: str) -> Callable[[_C], _C]:
        if names is not None and name not in names:
            raise ValueError(f"{what} {name!r} is not one of {', '.join(map(repr, names))}")

        def add(cls: _C) -> _C:
            if name in table and table[name] is not cls:
                raise ValueError(f"{what} {name!r} is registered already ({table[name]})")
            cls.name = name  # type: ignore[attr-defined]
            table[name] = cls
            return cls

        return add

    return register
