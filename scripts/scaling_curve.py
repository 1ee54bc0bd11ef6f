"""Acceptance against training compute: every kept checkpoint of one or more training runs, exported
and decoded with the real loop at temperature 0 (tokens per target call, GSM8K and overall), as a
Markdown table and a plot against training tokens and training wall-clock.

    python scripts/scaling_curve.py checkpoints/cpu_full-specblock checkpoints/cpu_full-eagle3
    python scripts/scaling_curve.py RUN [RUN ...] --limit 4 --max-new-tokens 64 --out docs/scaling_curve
    python scripts/scaling_curve.py RUN [RUN ...] --steps 180 400 480   # these first, the rest later
    python scripts/scaling_curve.py NEW_RUN --earlier docs/scaling_curve.json --out docs/scaling_curve

`--earlier` keeps the points of an earlier curve (its JSON) for the runs not named now: checkpoint folders
are outputs that a machine may not keep (ours loses them between sessions), the committed JSON stays, so a
new run is drawn beside the old ones without retraining them. Its points must carry the same settings.

Checkpoints are the step folders a run kept (`trainer.keep_every` milestones, the best and the last
ones); each is exported once to `<run>/curve/<step>/drafter` and evaluated once (`<run>/curve/<step>/eval`,
reread when it exists), so a killed curve continues where it stopped. Each point keeps a copy of its
checkpoint's meta.json there too, so a point stays on the curve after `keep_last` prunes its checkpoint.
The method is each drafter's tree (SpecBlock: Rank-Head-sized dynamic tree; EAGLE-3: EAGLE-2's dynamic
tree) and its chain, in float32 (exact greedy equality), on the same prompts for every checkpoint.

A run that continues another (`init_from=<run>/drafter`, a warm restart) is drawn at its cumulative
compute: the tokens and minutes of the checkpoint that drafter was exported from (the run's best, else its
last) are added to each of its points, through any chain of such runs.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace
from pathlib import Path

from specblock.data.io import write_json_atomic
from specblock.data.logs import setup_logging
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.decoding.drafters import default_trees
from specblock.evaluate.reporting.report import read_jsonl
from specblock.evaluate.run import evaluate
from specblock.train.checkpoint import list_checkpoints, read_meta
from specblock.train.export import export_from_checkpoint
from specblock.train.validation import read_best

DATASETS = ["gsm8k", "humaneval", "mgsm", "lm1b", "alpaca"]


def run_config(run: Path):
    """The run's drafter name and its target (as the eval app's TargetConfig, in float32)."""
    from omegaconf import OmegaConf

    from specblock.data.target import TargetConfig

    cfg = OmegaConf.load(run / "config.yaml")
    target = TargetConfig(**{**OmegaConf.to_container(cfg.data.target), "dtype": "float32"})
    return str(cfg.drafter.name), target


def exported_meta(run: Path) -> dict:
    """The meta.json of the checkpoint `<run>/drafter` was exported from: the best validation step when
    the run kept one, else its last (as `specblock.train` exports); read from the curve's copy when
    `keep_last` pruned the checkpoint."""
    best = read_best(run)
    if best is not None:
        folder = best["folder"]
    else:
        steps = list_checkpoints(run)
        if not steps:
            raise SystemExit(f"{run}: no checkpoint to tell the training compute of its exported drafter")
        folder = steps[-1].name
    for where in (run / folder, run / "curve" / folder):
        if (where / "meta.json").is_file():
            return read_meta(where)
    raise SystemExit(f"{run / folder / 'meta.json'}: missing (the checkpoint {run.name}/drafter came from)")


def prior_compute(run: Path, seen: tuple[Path, ...] = ()) -> tuple[int, float]:
    """(tokens, minutes) the run's starting weights were trained for: zero for a run from scratch; for
    `init_from=<other run>/drafter`, the other run's exported checkpoint plus its own prior, recursively."""
    from omegaconf import OmegaConf

    init = OmegaConf.load(run / "config.yaml").get("init_from")
    if not init:
        return 0, 0.0
    source = Path(init).parent
    if not (source / "config.yaml").is_file():
        raise SystemExit(
            f"{run / 'config.yaml'}: init_from={init} is not a training run's exported drafter "
            f"(no {source / 'config.yaml'}): its training compute is unknown"
        )
    if source.resolve() in seen:
        raise SystemExit(f"{run / 'config.yaml'}: init_from loops back to {source}")
    meta = exported_meta(source)
    tokens, minutes = prior_compute(source, (*seen, source.resolve()))
    return tokens + meta["tokens"], minutes + meta.get("train_ms", 0) / 60_000


def wanted(args) -> dict:
    return {"datasets": list(args.datasets), "limit": args.limit, "max_new_tokens": args.max_new_tokens}


def results_of(run: Path, step: Path) -> Path:
    """Where a checkpoint's curve evaluation is written (and reread)."""
    return run / "curve" / step.name / "eval" / "results.jsonl"


def settings(results: Path) -> Path:
    return results.parent / "curve_settings.json"


def cached(results: Path, args) -> bool:
    """Whether a checkpoint's evaluation can be reread: made with these settings and holding every
    dataset asked for (a set skipped for want of its files is evaluated again next time)."""
    if not (results.is_file() and settings(results).is_file()):
        return False
    if json.loads(settings(results).read_text()) != wanted(args):
        return False
    return not missing_sets(results, args)


def missing_sets(results: Path, args) -> list[str]:
    """The datasets asked for that a curve evaluation holds no result for."""
    have = {r["dataset"] for r in read_jsonl(results)}  # MGSM is recorded per language: mgsm_en, ...
    return [d for d in args.datasets if not (d in have or any(h.startswith(f"{d}_") for h in have))]


def point(run: Path, step: Path, args) -> dict:
    """Export + evaluate one checkpoint (cached); returns its curve point."""
    out = run / "curve" / step.name
    drafter = out / "drafter"
    if not (drafter / "config.json").is_file():
        export_from_checkpoint(run, step.name, str(drafter))
    results = results_of(run, step)
    name, target = run_config(run)
    if not cached(results, args):
        # every point drafts the same tree, also the rounds past a one-block run's training (as the curve's
        # earlier points, exported before drafters recorded `trained_blocks`, did)
        trees = {n: replace(t, untrained_rounds=True) for n, t in default_trees().items()}
        cfg = EvalConfig(
            trees=trees,
            run_name=f"curve-{run.name}-{step.name}",
            output_dir=str(results.parent),
            drafters={name: str(drafter)},
            methods=["tree", "chain-token"],
            datasets=args.datasets,
            local_root=args.local_root,
            limit=args.limit,
            max_new_tokens=args.max_new_tokens,
            target=target,
            on_unavailable="error",  # a set that cannot be loaded stops the curve before any decoding
        )
        evaluate(cfg)
        settings(results).write_text(json.dumps(wanted(args)))
        missing = missing_sets(results, args)
        if missing:  # every later point would skip them too: a curve of a different "overall"
            raise SystemExit(
                f"{results}: no results for {', '.join(missing)} (their files were not found; the log says "
                "why): point --local-root or SPECBLOCK_DATASETS at local copies, or pass --datasets"
            )
    rows = read_jsonl(results)
    meta = read_meta(step)
    if step != out:  # the copy that keeps the point once the checkpoint is pruned
        (out / "meta.json").write_text(json.dumps(meta))
    cells = {(r["dataset"], r["method"]): r["metrics"]["block_efficiency"] for r in rows}
    calls = {(r["dataset"], r["method"]): r["metrics"]["drafter_calls_per_token"] for r in rows}
    tokens, minutes = prior_compute(run)
    return {
        "run": run.name,
        "drafter": name,
        "step": meta["step"],
        "tokens": tokens + meta["tokens"],
        "minutes": minutes + meta.get("train_ms", 0) / 60_000,
        "tree_gsm8k": cells.get(("gsm8k", f"{name}:tree")),
        "tree_overall": cells.get(("overall", f"{name}:tree")),
        "chain_overall": cells.get(("overall", f"{name}:chain-token")),
        "tree_calls_per_token": calls.get(("overall", f"{name}:tree")),
    }


def pruned_points(run: Path, args) -> list[Path]:
    """Curve folders evaluated (cached, with their meta.json copy) whose checkpoint is gone."""
    live = {s.name for s in list_checkpoints(run)}
    return [
        d for d in sorted((run / "curve").glob("step_*"))
        if d.name not in live and (d / "meta.json").is_file() and cached(results_of(run, d), args)
    ]  # fmt: skip


def chosen(run: Path, args) -> list[Path]:
    """The run's points on the curve: every kept checkpoint, or with --steps those steps and the ones
    whose evaluation is cached already (a long curve done in parts, the points that matter first); and
    the cached points whose checkpoint was pruned since."""
    steps = list_checkpoints(run)
    if args.steps:
        steps = [s for s in steps if read_meta(s)["step"] in args.steps or cached(results_of(run, s), args)]
    return sorted([*steps, *pruned_points(run, args)], key=lambda p: p.name)


def earlier_points(path: Path, runs: list[Path], args) -> list[dict]:
    """The points of an earlier curve's JSON whose run is not among `runs` (those are evaluated now).
    A file made with other settings (prompts, tokens, datasets) is refused, naming what differs: its
    points would not be comparable."""
    data = json.loads(path.read_text())
    points, made = (data["points"], data.get("settings")) if isinstance(data, dict) else (data, None)
    now = wanted(args)
    if made is not None and made != now:
        differ = [
            f"{k}: {made.get(k)} there, {now.get(k)} now"
            for k in sorted(set(made) | set(now))
            if made.get(k) != now.get(k)
        ]
        raise SystemExit(f"{path}: an earlier curve made with other settings ({'; '.join(differ)})")
    names = {run.name for run in runs}
    return [p for p in points if p["run"] not in names]


def table(points: list[dict]) -> str:
    head = (
        "| run | step | training tokens | training minutes | tree GSM8K | tree overall | chain overall "
        "| tree drafter calls / token |"
    )
    lines = [head, "|---|---|---|---|---|---|---|---|"]
    for p in points:
        cells = [
            f"{p[k]:.2f}" if p.get(k) is not None else "–"
            for k in ("tree_gsm8k", "tree_overall", "chain_overall", "tree_calls_per_token")
        ]
        lines.append(
            f"| {p['run']} | {p['step']} | {p['tokens']:,} | {p['minutes']:.0f} | " + " | ".join(cells) + " |"
        )
    return "\n".join(lines) + "\n"


def plot(points: list[dict], path: Path) -> None:
    from matplotlib import colormaps
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    runs = list(dict.fromkeys(p["run"] for p in points))
    palette = colormaps["tab10" if len(runs) <= 10 else "tab20"]
    colours = [palette(i % palette.N) for i in range(len(runs))]  # one per run: overall solid, GSM8K dashed
    fig = Figure(figsize=(12, 4.2))
    FigureCanvasAgg(fig)
    for ax, x, label in zip(
        fig.subplots(1, 2), ("tokens", "minutes"), ("training tokens", "training minutes")
    ):
        for run, colour in zip(runs, colours):
            mine = sorted((p for p in points if p["run"] == run), key=lambda p: p[x])
            for key, style in (("tree_overall", "-o"), ("tree_gsm8k", "--s")):
                xs, ys = [p[x] for p in mine], [p[key] for p in mine]
                ax.plot(xs, ys, style, color=colour, label=f"{run} {key[5:]}")
        ax.set_xlabel(label)
        ax.set_ylabel("tokens per target call (T = 0, tree)")
        ax.grid(alpha=0.3)
    fig.axes[1].legend(fontsize=7, loc="center left", bbox_to_anchor=(1.02, 0.5))
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", type=Path)
    ap.add_argument("--limit", type=int, default=3, help="prompts per dataset")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--datasets", nargs="+", default=DATASETS)
    ap.add_argument("--local-root", default="auto")
    ap.add_argument(
        "--steps", nargs="+", type=int,
        help="evaluate only these steps now (checkpoints already evaluated stay in the table); default all",
    )  # fmt: skip
    ap.add_argument("--out", type=Path, default=Path("docs/scaling_curve"), help="writes OUT.md and OUT.png")
    ap.add_argument(
        "--earlier", type=Path,
        help="an earlier curve's JSON: its points of runs not named here stay in the table and the plot",
    )  # fmt: skip
    args = ap.parse_args()
    old = earlier_points(args.earlier, args.runs, args) if args.earlier else []
    points = old + [point(run, step, args) for run in args.runs for step in chosen(run, args)]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    text = table(points)
    args.out.with_suffix(".md").write_text(text)
    write_json_atomic(args.out.with_suffix(".json"), {"settings": wanted(args), "points": points})
    plot(points, args.out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
