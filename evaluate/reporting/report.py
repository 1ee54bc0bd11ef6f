"""Evaluation reports: JSON-lines records, Markdown tables and PNG plots, all written atomically.

A record is one (dataset, method) cell of one configuration: the configuration's fields (verifier, K, L,
temperature, tree budget, ...) at top level, plus `dataset`, `method`, the raw `counts` and the derived
`metrics`. Records keep their counts so that any later pooling sums counts before dividing (habit 13).
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterable, Mapping

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from specblock.data.io import atomic_path
from specblock.evaluate.reporting.metrics import (
    AUTOREGRESSIVE,
    OVERALL,
    Accumulator,
    Counts,
    acceptance_at,
    block_efficiency,
    derived,
)

RESERVED = ("dataset", "method", "counts", "metrics")  # record keys a config field may not shadow
MISSING = "–"  # a cell with no data, or a ratio with a zero denominator


def records(acc: Accumulator, config: Mapping[str, Any]) -> list[dict[str, Any]]:
    """One record per (dataset, method) and per method's OVERALL row; metrics include `speedup` (against
    the fastest plain decoding, `Accumulator.reference`, named by `speedup_reference`) and
    `speedup_same_dtype` (against plain decoding in the evaluation's own precision)."""
    clash = [k for k in config if k in RESERVED]
    if clash:
        raise ValueError(f"config fields {clash} clash with record keys {RESERVED}")
    out, reference = [], acc.reference()
    for dataset, method, c in acc.cells():
        metrics = {
            **derived(c),
            "speedup": acc.speedup(dataset, method, reference),
            "speedup_reference": reference,
            "speedup_same_dtype": acc.speedup(dataset, method, AUTOREGRESSIVE),
        }
        out.append(
            {**config, "dataset": dataset, "method": method, "counts": c.to_dict(), "metrics": metrics}
        )
    return out


def write_jsonl(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    """One JSON object per line; undefined ratios are null."""
    with atomic_path(path) as tmp:
        tmp.write_text("".join(json.dumps(r, sort_keys=True, allow_nan=False) + "\n" for r in rows))


def read_jsonl(path: str | os.PathLike) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def select(rows: Iterable[Mapping[str, Any]], **where: Any) -> list[Mapping[str, Any]]:
    """The records whose fields equal every `where` item, e.g. select(rows, L=4, dataset="overall")."""
    return [r for r in rows if all(r.get(k) == v for k, v in where.items())]


def _grid(rows: Iterable[Mapping[str, Any]]) -> tuple[list[str], list[str], dict[tuple[str, str], Mapping]]:
    """Row names (datasets in first-seen order, OVERALL last), column names (methods) and the cells."""
    cells: dict[tuple[str, str], Mapping] = {}
    for r in rows:
        key = (r["dataset"], r["method"])
        if key in cells:
            raise ValueError(f"two records for {key}: a table shows one configuration; filter with select()")
        cells[key] = r
    datasets = [d for d in dict.fromkeys(d for d, _ in cells) if d != OVERALL]
    if any(d == OVERALL for d, _ in cells):
        datasets.append(OVERALL)
    return datasets, list(dict.fromkeys(m for _, m in cells)), cells


def _fmt(x: float | None, digits: int = 2) -> str:
    return MISSING if x is None else f"{x:.{digits}f}"


def _table(rows: Iterable[Mapping[str, Any]], cell: Any) -> str:
    datasets, methods, cells = _grid(rows)
    lines = ["| dataset | " + " | ".join(methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for d in datasets:
        values = [cell(cells[(d, m)]["metrics"]) if (d, m) in cells else MISSING for m in methods]
        lines.append(f"| {d} | " + " | ".join(values) + " |")
    return "\n".join(lines) + "\n"


def block_efficiency_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Datasets x methods; cell = block efficiency (tokens per target call) with tau in brackets."""
    return _table(rows, lambda m: f"{_fmt(m['block_efficiency'])} ({_fmt(m['tau'])})")


def speedup_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """Datasets x methods; cell = wall-clock tokens/s over the fastest autoregressive decoding's tokens/s
    (`Accumulator.reference`) on the same rows."""
    return _table(rows, lambda m: MISSING if m["speedup"] is None else f"{m['speedup']:.2f}x")


def markdown_report(rows: Iterable[Mapping[str, Any]]) -> str:
    """Both tables under headings, for a README or a run's eval/ folder."""
    rows = list(rows)
    return (
        "### Block efficiency (tokens per target call, bonus token counted; acceptance length tau)\n\n"
        + block_efficiency_table(rows)
        + f"\n### Speedup over the fastest autoregressive decoding ({_reference(rows)}; wall-clock tokens/s "
        "ratio)\n\n" + speedup_table(rows)
    )


def _reference(rows: list[Mapping[str, Any]]) -> str:
    """The speedups' denominator, as the records name it."""
    return next((r["metrics"].get("speedup_reference") for r in rows), None) or AUTOREGRESSIVE


def category_report(rows: Iterable[Mapping[str, Any]]) -> str:
    """Per-category tables ("<dataset>/<category>" x methods) of the sets that have categories
    (MT-Bench, Spec-Bench, a custom set's category field); the all-categories rows are left out."""
    rows = [r for r in rows if r["dataset"] != OVERALL]
    return (
        "\n## Per category\n\n### Block efficiency (tau)\n\n"
        + block_efficiency_table(rows)
        + f"\n### Speedup over the fastest autoregressive decoding ({_reference(rows)})\n\n"
        + speedup_table(rows)
    )


def cost_table(rows: Iterable[Mapping[str, Any]]) -> str:
    """The OVERALL row of every method: tau, block efficiency, drafter calls and ms per emitted token,
    target forward, verification and other (overhead) ms per emitted token, tokens/s, speedup (against the
    fastest plain decoding) and speedup against plain decoding in the same precision, and the
    greedy outputs that differ from autoregressive decoding's (where records count them)."""

    def ms(x: float | None) -> str:
        return _fmt(None if x is None else x * 1e3)

    lines = [
        "\n## Overall costs\n",
        "| method | tau | tokens / target call | drafter calls / token | drafter ms / token | target ms / token "
        "| verify ms / token | other ms / token | tokens / s | speedup | speedup, same dtype "
        "| greedy ≠ autoregressive |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]  # fmt: skip
    for r in rows:
        if r["dataset"] != OVERALL:
            continue
        m, diff = r["metrics"], r.get("greedy_mismatches")
        diff = None if r.get("temperature", 0) != 0 else diff  # counted at temperature 0 only
        lines.append(
            f"| {r['method']} | {_fmt(m['tau'])} | {_fmt(m['block_efficiency'])} "
            f"| {_fmt(m['drafter_calls_per_token'])} | {ms(m['drafter_seconds_per_token'])} "
            f"| {ms(m.get('target_seconds_per_token'))} | {ms(m['verify_seconds_per_token'])} "
            f"| {ms(m.get('overhead_seconds_per_token'))} | {_fmt(m['tokens_per_second'], 1)} "
            f"| {_fmt(m['speedup'])} | {_fmt(m.get('speedup_same_dtype'))} | {MISSING if diff is None else diff} |"
        )
    return "\n".join(lines) + "\n"


def write_markdown(path: str | os.PathLike, rows: Iterable[Mapping[str, Any]]) -> None:
    with atomic_path(path) as tmp:
        tmp.write_text(markdown_report(rows))


def _save(fig: Figure, path: str | os.PathLike) -> None:
    FigureCanvasAgg(fig)  # Agg canvas: no display, no pyplot global state
    fig.tight_layout()
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=120)


def _finish(ax: Any) -> None:
    ax.grid(alpha=0.3)
    if ax.get_lines():  # an empty legend warns
        ax.legend()


def _by_method(rows: Iterable[Mapping[str, Any]], dataset: str) -> dict[str, list[Mapping[str, Any]]]:
    out: dict[str, list[Mapping[str, Any]]] = {}
    for r in rows:
        if r["dataset"] == dataset:
            out.setdefault(r["method"], []).append(r)
    return out


def plot_block_efficiency(
    rows: Iterable[Mapping[str, Any]], x: str, path: str | os.PathLike, dataset: str = OVERALL
) -> None:
    """Block efficiency against the config field `x` ("K", "L", "temperature", ...), one line per
    method, from the `dataset` rows. Each (method, x) must be one record: filter other axes with select()."""
    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    integer_x = True
    for method, group in _by_method(rows, dataset).items():
        xs = [r[x] for r in group]
        if len(set(xs)) != len(xs):
            raise ValueError(f"{method}: several records share a value of {x}; filter with select()")
        pts = sorted((r[x], block_efficiency(Counts.from_dict(r["counts"]))) for r in group)
        pts = [(a, b) for a, b in pts if b is not None]
        ax.plot([a for a, _ in pts], [b for _, b in pts], marker="o", label=method)
        integer_x = integer_x and all(isinstance(r[x], int) for r in group)
    if integer_x:  # K and L are counts: no 2.5 ticks
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x)
    ax.set_ylabel("block efficiency (tokens / target call)")
    ax.set_title(f"Block efficiency vs {x} ({dataset})")
    _finish(ax)
    _save(fig, path)


def plot_acceptance_at(
    rows: Iterable[Mapping[str, Any]], path: str | os.PathLike, dataset: str = OVERALL
) -> None:
    """Per-position acceptance (accepted at position i / drafts reaching position i), one line per method
    from the `dataset` rows; methods with no draft (autoregressive) have no line."""
    fig = Figure(figsize=(5, 3.5))
    ax = fig.add_subplot()
    for method, group in _by_method(rows, dataset).items():
        if len(group) != 1:
            raise ValueError(f"{method}: {len(group)} records for {dataset}; filter with select()")
        rates = acceptance_at(Counts.from_dict(group[0]["counts"]))
        if rates:
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=method)
    ax.set_xlabel("draft position")
    ax.set_ylabel("acceptance rate at position")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"Per-position acceptance ({dataset})")
    _finish(ax)
    _save(fig, path)
