"""How well a trained SpecBlock Rank Head predicts where the target token ranks, on held-out data.

    python scripts/rank_head_report.py checkpoints/cpu_full-specblock            # the run's exported drafter
    python scripts/rank_head_report.py RUN --drafter RUN/curve/step_000100/drafter --rows 64

Teacher-forced, block 1, on the run's held-out split (its `validation` config; the last `--rows` training
rows when the run had none): the confusion matrix of predicted against true rank class (counts and
shares per true class), per slot; and, for each tree branching preset (`topk_per_class`: the paper's
default (2, 4, 10, 0), the authors' release preset (2, 4, 6, 4), or `--preset`), the share of slots whose
target token a tree of that shape would keep and the candidates it keeps per slot. Writes
`<out>.md` and a heatmap `<out>.png`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from omegaconf import OmegaConf

from specblock.data.logs import setup_logging
from specblock.train.batching import shifted_tokens, teacher_and_valid
from specblock.train.config import TrainConfig, saved_run_config
from specblock.train.export import load_drafter
from specblock.train.rank_labels import (
    DEFAULT_TOPK_PER_CLASS,
    RELEASE_TOPK_PER_CLASS,
    branch_coverage,
    rank_classes,
    rank_confusion,
    rank_of_target,
)
from specblock.train.run import build


def collect(run: Path, drafter: Path, rows: int, batch: int) -> tuple[dict[str, torch.Tensor], list[int]]:
    """Predicted and true classes, ranks and validity [N, K] over the held-out rows; the rank buckets."""
    cfg: TrainConfig = OmegaConf.to_object(saved_run_config(run))
    built = build(cfg)
    module, _ = load_drafter(drafter)
    data = built.held_out or [built.rows[i] for i in range(len(built.rows) - rows, len(built.rows))]
    strategy, out = built.strategy, {"pred": [], "classes": [], "ranks": [], "valid": []}
    K = module.block_size
    for start in range(0, min(len(data), rows), batch):
        b = built.collate_fn([data[i] for i in range(start, min(start + batch, len(data), rows))])
        with torch.no_grad():
            features, logits = strategy.target_outputs(b)
            res = module(
                features[:, :-1], shifted_tokens(b["input_ids"]), attention_mask=b["attention_mask"][:, 1:]
            )
            law, valid = teacher_and_valid(b, logits, module.d2t, module.t2d, K)
            teacher = law.slot_grid(1, res.logits.shape[1], K)
            ranks = rank_of_target(res.logits, teacher)
        out["pred"].append(res.rank_logits.argmax(-1).flatten(0, 1))
        out["classes"].append(rank_classes(ranks, tuple(module.cfg.rank_buckets)).flatten(0, 1))
        out["ranks"].append(ranks.flatten(0, 1))
        out["valid"].append(valid.flatten(0, 1))
    return {k: torch.cat(v) for k, v in out.items()}, list(module.cfg.rank_buckets)


def class_names(buckets: list[int]) -> list[str]:
    lows = [1] + [b + 1 for b in buckets]
    return [f"{lo}" if lo == hi else f"{lo}-{hi}" for lo, hi in zip(lows, buckets)] + [f">{buckets[-1]}"]


def report(
    d: dict[str, torch.Tensor], buckets: list[int], presets: dict[str, tuple[int, ...]]
) -> tuple[str, torch.Tensor]:
    C, K = len(buckets) + 1, d["pred"].shape[-1]
    names = class_names(buckets)
    total = rank_confusion(d["pred"], d["classes"], d["valid"], C)
    shares = total / total.sum(1, keepdim=True).clamp_min(1)
    lines = [f"Held-out slots: {int(d['valid'].sum())} (block 1, K = {K}, teacher-forced).", ""]
    lines += ["Confusion matrix, rows = true rank class, columns = predicted (share of the row; count):", ""]
    lines += ["| true \\ predicted | " + " | ".join(names) + " | slots |", "|---" * (C + 2) + "|"]
    for t in range(C):
        cells = " | ".join(f"{shares[t, p]:.2f} ({int(total[t, p])})" for p in range(C))
        lines.append(f"| {names[t]} | {cells} | {int(total[t].sum())} |")
    acc = total.diag().sum() / total.sum().clamp_min(1)
    lines += [
        "",
        f"Accuracy {acc:.3f}; true class shares: "
        + ", ".join(f"{n} {v:.2f}" for n, v in zip(names, total.sum(1) / total.sum().clamp_min(1))),
        "",
    ]
    lines += [
        "| branching (topk per predicted class) | slot | target token kept | candidates kept per slot |",
        "|---|---|---|---|",
    ]
    for label, preset in presets.items():
        for k in range(K):
            share, width = branch_coverage(d["ranks"][:, k], d["pred"][:, k], d["valid"][:, k], preset)
            lines.append(f"| {label} {preset} | {k} | {share:.3f} | {width:.2f} |")
        share, width = branch_coverage(d["ranks"], d["pred"], d["valid"], preset)
        lines.append(f"| {label} {preset} | all | {share:.3f} | {width:.2f} |")
    return "\n".join(lines) + "\n", shares


def heatmap(shares: torch.Tensor, names: list[str], path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.5, 4))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    ax.imshow(shares.numpy(), vmin=0, vmax=1, cmap="Blues")
    ax.set_xticks(range(len(names)), names)
    ax.set_yticks(range(len(names)), names)
    ax.set_xlabel("predicted rank class")
    ax.set_ylabel("true rank class")
    for t in range(len(names)):
        for p in range(len(names)):
            ax.text(p, t, f"{shares[t, p]:.2f}", ha="center", va="center", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    setup_logging()
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run", type=Path, help="a SpecBlock training run folder (config.yaml)")
    ap.add_argument("--drafter", type=Path, help="exported drafter (default: RUN/drafter)")
    ap.add_argument("--rows", type=int, default=96)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--preset", type=int, nargs="+", help="one more topk_per_class to score")
    ap.add_argument(
        "--out", type=Path, default=None, help="writes OUT.md and OUT.png (default RUN/rank_head)"
    )
    args = ap.parse_args()
    data, buckets = collect(args.run, args.drafter or args.run / "drafter", args.rows, args.batch)
    presets = {"paper default": DEFAULT_TOPK_PER_CLASS, "release preset": RELEASE_TOPK_PER_CLASS}
    if args.preset:
        presets["--preset"] = tuple(args.preset)
    text, shares = report(data, buckets, presets)
    out = args.out or args.run / "rank_head"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".md").write_text(text)
    heatmap(shares, class_names(buckets), out.with_suffix(".png"))
    print(text)


if __name__ == "__main__":
    main()
