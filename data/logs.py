"""Messages: every module logs through `logging.getLogger(__name__)` (the `specblock.*` tree), never
`print`; the entry points decide where messages go.

`setup_logging()` is called by every entry point (the Hydra apps' `main`, the `specblock` CLI, the
benchmark and report commands): on rank 0 INFO messages print as plain lines on stdout, so tables and
summaries look as `print` showed them, and WARNING and above go to stderr; other ranks of an
`accelerate launch` show WARNING and above only, unless `SPECBLOCK_LOG_ALL_RANKS=1` (every rank's
messages, e.g. each rank's share of a resumed regeneration). Under Hydra, which configures the root logger first
(configs/hydra/job_logging/plain.yaml: the same plain console, plus a timed log file), only the rank
level is set.
Library code called without an entry point (tests, notebooks) logs into whatever the caller configured.
"""

from __future__ import annotations

import logging
import os
import sys

ROOT = "specblock"
ALL_RANKS_ENV = "SPECBLOCK_LOG_ALL_RANKS"  # "1": ranks other than 0 log INFO too


class _Console(logging.StreamHandler):
    """A StreamHandler on sys.stdout or sys.stderr as they are when a record is written (so pytest's
    capture and later redirections see it), not as they were when the handler was made."""

    def __init__(self, errors: bool) -> None:
        super().__init__()
        self.errors = errors

    @property
    def stream(self):
        return sys.stderr if self.errors else sys.stdout

    @stream.setter
    def stream(self, value) -> None:  # StreamHandler.__init__ assigns one; the property decides
        pass


class BelowWarning(logging.Filter):
    """Passes DEBUG and INFO records: the stdout handler's filter (WARNING and above go to stderr)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno < logging.WARNING


def setup_logging(rank: int | None = None) -> None:
    """Console logging for an entry point (idempotent). `rank`: this process's global rank (default: the
    RANK variable `accelerate launch` and torchrun set; 0 in a plain process)."""
    rank = int(os.environ.get("RANK", "0")) if rank is None else rank
    quiet = rank != 0 and os.environ.get(ALL_RANKS_ENV) != "1"
    root = logging.getLogger()
    if not root.handlers:  # not under Hydra (or another configured caller): plain stdout / stderr
        out, err = _Console(errors=False), _Console(errors=True)
        out.addFilter(BelowWarning())
        err.setLevel(logging.WARNING)
        for handler in (out, err):
            handler.setFormatter(logging.Formatter("%(message)s"))
            root.addHandler(handler)
        root.setLevel(logging.INFO)
    logging.getLogger(ROOT).setLevel(logging.WARNING if quiet else logging.INFO)
