"""`specblock <command> ...`: one entry point for the project's jobs (benchmarks and other tools are
scripts: `python scripts/<tool>.py`)."""

from __future__ import annotations

import sys

from specblock.data.errors import exit_on_user_error
from specblock.data.logs import setup_logging

COMMANDS = {
    "run": ("specblock.evaluate.pipeline", "the main job: data, training, export, evaluation (tables)"),
    "eval-report": (
        "specblock.evaluate.reporting.sweep",
        "pool an evaluation sweep: table and plots vs K, L, temperature",
    ),
}


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        lines = [f"  {name:14s} {doc}" for name, (_, doc) in COMMANDS.items()]
        print("usage: specblock <command> [args]\n\ncommands:\n" + "\n".join(lines))
        sys.exit(0 if argv and argv[0] in ("-h", "--help") else 2)
    module = __import__(COMMANDS[argv[0]][0], fromlist=["main"])
    exit_on_user_error(module.main)(argv[1:])


if __name__ == "__main__":
    main()
