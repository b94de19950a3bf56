"""Errors of the data layer (kept apart so that both record loading and prompt hygiene can raise them)."""

from __future__ import annotations

__all__ = ["DataRecordError"]


class DataRecordError(ValueError):
    """A data record violates docs/ALGORITHM.md#records §1.1 (or its messages violate §3.3).

    Attributes:
        path: the JSONL file, or ``None`` when the record did not come from a file.
        line_no: 1-based line number in ``path``, or ``None``.
        reason: what is wrong and how to fix it.
    """

    def __init__(self, path: str | None, line_no: int | None, reason: str) -> None:
        self.path = path
        self.line_no = line_no
        self.reason = reason
        where = f"{path}:{line_no}" if path is not None and line_no is not None else (path or "record")
        super().__init__(f"{where}: {reason}")
