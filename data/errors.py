"""Bad input: one clear error naming file, row and field, or rows skipped and counted (on_bad_row); and
how the CLI entry points report a user's mistake (one line, no stack trace)."""

from __future__ import annotations

import functools
import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable, ParamSpec, TypeVar

from omegaconf.errors import OmegaConfBaseException

P = ParamSpec("P")
R = TypeVar("R")

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


# What a user's mistake raises: bad input files, missing or existing paths, invalid config values (the
# dataclasses' __post_init__ checks raise ValueError; OmegaConf raises its own errors for types and `???`).
USER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError,
    FileNotFoundError,
    FileExistsError,
    NotADirectoryError,
    OmegaConfBaseException,
)


def exit_on_user_error(fn: Callable[P, R]) -> Callable[P, R]:
    """For CLI entry points: a user's mistake (USER_ERRORS) prints one line `error: ...` on stderr and
    exits with status 1, without a stack trace; HYDRA_FULL_ERROR=1 lets it through with the full trace."""

    @functools.wraps(fn)
    def wrapped(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except USER_ERRORS as err:
            if os.environ.get("HYDRA_FULL_ERROR") == "1":
                raise
            # The process's last words, not a log message: on stderr whatever logging is set up to do.
            print(f"error: {err}\n(set HYDRA_FULL_ERROR=1 for the stack trace)", file=sys.stderr)
            raise SystemExit(1) from None

    wrapped.reports_user_errors = True  # type: ignore[attr-defined]  # tests check every entry point
    return wrapped
