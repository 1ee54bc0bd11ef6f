"""`specblock eval-report FOLDER [--out DIR]`: pool the results.jsonl of an evaluation sweep
(python -m specblock.evaluate --multirun ...) into one file, a Markdown table per configuration and plots
of block efficiency against every swept field (K, L, temperature, top_p)."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

from specblock.data.logs import setup_logging
from .report import markdown_report, plot_block_efficiency, read_jsonl, select, write_jsonl

log = logging.getLogger(__name__)

AXES = ("K", "L", "temperature", "top_p")


def pool(folder: str | Path) -> list[dict]:
    rows = []
    for path in sorted(Path(folder).rglob("results.jsonl")):
        rows += read_jsonl(path)
    if not rows:
        raise FileNotFoundError(f"no results.jsonl under {folder}")
    return rows


def sweep_report(folder: str | Path, out: str | Path) -> list[Path]:
    """Writes pooled.jsonl, report.md and one block_efficiency_vs_<axis>.png per swept axis; returns the
    plots. A plot holds the other axes at their most common value."""
    rows, out = pool(folder), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_jsonl(out / "pooled.jsonl", rows)
    configs = sorted({tuple(r[a] for a in AXES) for r in rows})
    parts = []
    for c in configs:
        where = dict(zip(AXES, c))
        parts.append(
            f"## {', '.join(f'{k}={v}' for k, v in where.items())}\n\n"
            + markdown_report(select(rows, **where))
        )
    (out / "report.md").write_text("\n".join(parts))
    plots = []
    for axis in AXES:
        if len({r[axis] for r in rows}) < 2:
            continue
        others = {}
        for a in AXES:
            if a != axis:
                values = [r[a] for r in rows]
                others[a] = max(set(values), key=values.count)
        path = out / f"block_efficiency_vs_{axis}.png"
        plot_block_efficiency(select(rows, **others), axis, path)
        plots.append(path)
    return plots


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    p = argparse.ArgumentParser(prog="specblock eval-report", description=__doc__)
    p.add_argument("folder", help="a sweep folder, e.g. checkpoints/eval/multirun/eval")
    p.add_argument("--out", default=None, help="default: FOLDER/report")
    args = p.parse_args(argv)
    plots = sweep_report(args.folder, args.out or Path(args.folder) / "report")
    log.info(
        f"wrote {args.out or Path(args.folder) / 'report'}: pooled.jsonl, report.md, {len(plots)} plot(s)"
    )


if __name__ == "__main__":
    main()
