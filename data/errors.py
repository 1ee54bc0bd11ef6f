"""Bad input: one clear error naming file, row and field, or rows skipped and counted (on_bad_row)."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

ON_BAD_ROW = ("error", "skip")


class BadInputError(ValueError):
    """A malformed input: names the file, the row (0-based index; None for the whole file) and the
    field."""

    def __init__(self, path: str, row: int | None, field_name: str | None, problem: str):
        self.path, self.row, self.field, self.problem = str(path), row, field_name, problem
        where = (
            self.path
            + (f", row {row}" if row is not None else "")
            + (f", field {field_name!r}" if field_name else "")
        )
        super().__init__(f"{where}: {problem}")


@dataclass
class RowPolicy:
    """Applies `on_bad_row`: 'error' raises the BadInputError, 'skip' counts it for the summary."""

    on_bad_row: str = "error"
    skipped: Counter = field(default_factory=Counter)
    examples: list[str] = field(default_factory=list)

    def __post_init__(self):
        if self.on_bad_row not in ON_BAD_ROW:
            raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got {self.on_bad_row!r}")

    def bad(self, err: BadInputError) -> None:
        if self.on_bad_row == "error":
            raise err
        self.skipped[err.problem] += 1
        if len(self.examples) < 5:
            self.examples.append(str(err))

    @property
    def total_skipped(self) -> int:
        return sum(self.skipped.values())

    def summary(self) -> str:
        if not self.skipped:
            return "no bad rows"
        kinds = ", ".join(f"{n} x {problem}" for problem, n in self.skipped.most_common())
        return f"skipped {self.total_skipped} bad rows ({kinds}); e.g. {self.examples[0]}"
