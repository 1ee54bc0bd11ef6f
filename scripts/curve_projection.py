"""How far a scaling curve is from a target: per run, tokens per target call fitted against log2(training
tokens) (least squares), the gain per doubling of the tokens over the whole run and over its last interval,
and where the fitted line would reach the target, in tokens and in minutes at the run's own tokens per
minute. An extrapolation of a few points, not a measurement: a last-interval gain below the fitted one
says the curve is bending down and the line is optimistic.

    python scripts/curve_projection.py docs/scaling_curve_6k.json
    python scripts/curve_projection.py docs/scaling_curve_6k.json --runs cpu_full_6k-specblock --gsm8k 2.5 --overall 2.2

Reads the JSON that scripts/scaling_curve.py writes ({"settings", "points": [{run, tokens, minutes,
tree_gsm8k, tree_overall, ...}]}); runs with fewer than `--min-points` points are left out.
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

KEYS = {"gsm8k": "tree_gsm8k", "overall": "tree_overall"}


def log_fit(tokens: list[float], values: list[float]) -> tuple[float, float]:
    """Least squares values ~ a + b * log2(tokens): returns (a, b), b the gain per doubling.
    tokens, values: [n] with n >= 2 and at least two distinct tokens."""
    xs = [math.log2(t) for t in tokens]
    mx, my = sum(xs) / len(xs), sum(values) / len(values)
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs points at two or more distinct token counts")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, values)) / sxx
    return my - b * mx, b


def tokens_to_reach(a: float, b: float, target: float) -> float | None:
    """Tokens at which a + b * log2(tokens) = target; None when the line never rises to it (b <= 0)."""
    if b <= 0:
        return None
    return 2 ** ((target - a) / b)


def project(points: list[dict], targets: dict[str, float], min_points: int = 3) -> list[dict]:
    """One row per run with >= min_points points: for each of `targets` (gsm8k / overall -> tokens per
    call), the fitted and last-interval gain per doubling, the last value and the projected tokens and
    minutes (the run's last tokens / minutes ratio) at which the fitted line reaches the target."""
    rows = []
    for run in dict.fromkeys(p["run"] for p in points):
        mine = sorted((p for p in points if p["run"] == run), key=lambda p: p["tokens"])
        if len(mine) < min_points or len({p["tokens"] for p in mine}) < 2:
            continue
        last, before = mine[-1], mine[-2]
        per_minute = last["tokens"] / last["minutes"] if last.get("minutes") else None
        span = math.log2(last["tokens"] / before["tokens"])
        row = {"run": run, "points": len(mine), "tokens": (mine[0]["tokens"], last["tokens"])}
        for name, target in targets.items():
            key = KEYS[name]
            a, b = log_fit([p["tokens"] for p in mine], [p[key] for p in mine])
            need = tokens_to_reach(a, b, target)
            row[name] = {
                "target": target,
                "last": last[key],
                "gain_per_doubling": b,
                "last_gain_per_doubling": (last[key] - before[key]) / span if span > 0 else None,
                "tokens_needed": need,
                "times_last_tokens": need / last["tokens"] if need is not None else None,
                "minutes_needed": need / per_minute if need is not None and per_minute else None,
            }
        rows.append(row)
    return rows


def _num(value: float | None, fmt: str) -> str:
    return "never (not rising)" if value is None else format(value, fmt)


def table(rows: list[dict]) -> str:
    """Markdown: one line per run and target."""
    lines = [
        "| run | points (training tokens) | target | last | gain / doubling: fit, last interval "
        "| fitted line reaches it at | x last tokens | training hours at the run's rate |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        lo, hi = row["tokens"]
        for name in KEYS:
            if name not in row:
                continue
            r = row[name]
            last_gain = "–" if r["last_gain_per_doubling"] is None else f"{r['last_gain_per_doubling']:+.3f}"
            hours = None if r["minutes_needed"] is None else r["minutes_needed"] / 60
            lines.append(
                f"| {row['run']} | {row['points']} ({lo:,}-{hi:,}) | {name} {r['target']:.2f} | {r['last']:.2f} "
                f"| {r['gain_per_doubling']:+.3f}, {last_gain} | {_num(r['tokens_needed'], ',.0f')} tokens "
                f"| {_num(r['times_last_tokens'], '.0f')} | {_num(hours, '.0f')} |"
            )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("curve", type=Path, help="a scaling curve's JSON (scripts/scaling_curve.py --out)")
    ap.add_argument("--runs", nargs="+", help="only these runs (default: every run with enough points)")
    ap.add_argument("--gsm8k", type=float, default=2.5, help="target tokens per call on GSM8K (issue 11)")
    ap.add_argument("--overall", type=float, default=2.2, help="target tokens per call overall (issue 11)")
    ap.add_argument("--min-points", type=int, default=3)
    args = ap.parse_args()
    data = json.loads(args.curve.read_text())
    points = data["points"] if isinstance(data, dict) else data
    if args.runs:
        unknown = sorted(set(args.runs) - {p["run"] for p in points})
        if unknown:
            raise SystemExit(f"{args.curve}: no points of run(s) {', '.join(unknown)}")
        points = [p for p in points if p["run"] in args.runs]
    rows = project(points, {"gsm8k": args.gsm8k, "overall": args.overall}, args.min_points)
    if not rows:
        raise SystemExit(
            f"{args.curve}: no run has {args.min_points} or more points at distinct token counts"
        )
    print(table(rows), end="")


if __name__ == "__main__":
    main()
