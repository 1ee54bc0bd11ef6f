"""Distribution-shift experiment for serving-time adaptation (issue 6).

Drafters trained on ShareGPT (the quick recipe's exports) serve a stream of HumanEval, then GSM8K, then
MGSM (German) prompts with their dynamic trees at temperature 0, with and without adaptation; the
adapting runs pay their update time inside the measured wall clock. Writes, under --out:
results.jsonl (one row per request and run), results.md (per dataset and overall: tokens per target call,
tokens/s including updates, updates made and their seconds, SpecBlock's speedup lead over EAGLE-3
with and without adaptation) and adapt_shift.png (tokens per target call and cumulative tokens/s over
the stream).

    python scripts/adapt_shift.py [--limit 8] [--max-new-tokens 48] [--window 2]
"""

from __future__ import annotations

import argparse
import copy
import json
import time
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from tqdm.auto import tqdm

from specblock.data.evalsets import prompt_ids
from specblock.data.logs import setup_logging
from specblock.data.target import FeatureTarget, TargetConfig, load_target
from specblock.data.embedded import ensure_embedded_target
from specblock.evaluate.adapt import Adapter, AdaptConfig
from specblock.evaluate.config import EvalConfig
from specblock.evaluate.decoding.loop import DecodeConfig, SpeculativeDecoder
from specblock.evaluate.run import eos_ids, load_drafters, load_set

STREAM = [("humaneval", ["en"]), ("gsm8k", ["en"]), ("mgsm", ["de"])]


def main() -> None:
    setup_logging()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, default=8, help="prompts per dataset")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.add_argument("--window", type=int, default=2, help="requests per bandit decision")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--out", default="checkpoints/adapt_shift")
    p.add_argument("--local-root", default="auto")
    args = p.parse_args()
    torch.manual_seed(0)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cfg = EvalConfig(target=TargetConfig(dtype="float32"), limit=args.limit, local_root=args.local_root)
    ensure_embedded_target(cfg.target.name_or_path)
    model, tokenizer = load_target(cfg.target)
    drafters = load_drafters(cfg, model.config.vocab_size)
    eos = eos_ids(tokenizer, model)
    prompts = []
    for name, langs in STREAM:
        cfg.mgsm_languages = langs
        prompts += [
            (s.name, prompt_ids(pr, tokenizer)[-cfg.max_prompt_tokens :])
            for s in [load_set(cfg, name)]
            for pr in s
        ]
    runs = []
    for name, (module, meta) in drafters.items():
        target = FeatureTarget(model, meta["feature_layers"])
        dc = DecodeConfig("tree", max_new_tokens=args.max_new_tokens, tree=cfg.trees[name])
        for adapt in (False, True):
            m = copy.deepcopy(module)
            ad = (
                Adapter(m, AdaptConfig(enabled=True, window=args.window, steps=args.steps, lr=args.lr))
                if adapt
                else None
            )
            runs.append(
                (f"{name}{'+adapt' if adapt else ''}", SpeculativeDecoder(target, m, dc, eos, adapter=ad), ad)
            )
    rows = []
    bar = tqdm(total=len(prompts) * len(runs), desc="adapt_shift", unit="gen")
    for label, dec, ad in runs:
        for i, (dataset, ids) in enumerate(prompts):
            start = time.perf_counter()
            seen = len(ad.events) if ad is not None else 0
            g = dec.generate(ids)
            wall = time.perf_counter() - start  # includes an update made at the end of this request
            event = ad.events[-1] if ad is not None and len(ad.events) > seen else None  # a window closed
            rows.append(
                {
                    "run": label, "request": i, "dataset": dataset, "tokens": len(g.tokens),
                    "target_calls": g.target_calls, "decode_seconds": g.seconds, "wall_seconds": wall,
                    "arm": event.arm if event else None, "update_seconds": event.update_seconds if event else 0.0,
                    "reverted": event.reverted if event else False, "rejected": event.rejected if event else False,
                    "replay_lift": event.replay_lift if event else None,
                }
            )  # fmt: skip
            bar.update()
    bar.close()
    (out / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = table(rows)
    (out / "results.md").write_text(report)
    plot(rows, out / "adapt_shift.png")
    print(report)
    print(f"wrote {out}/results.jsonl, results.md, adapt_shift.png")


def _sums(rows):
    t = sum(r["tokens"] for r in rows)
    c = sum(r["target_calls"] for r in rows)
    w = sum(r["wall_seconds"] for r in rows)
    u = sum(r["update_seconds"] for r in rows)
    n = sum(1 for r in rows if r["arm"] not in (None, "none") and not r["rejected"])
    rv = sum(1 for r in rows if r["reverted"] or r["rejected"])
    return t, c, w, u, n, rv


def table(rows) -> str:
    runs = list(dict.fromkeys(r["run"] for r in rows))
    datasets = list(dict.fromkeys(r["dataset"] for r in rows)) + ["overall"]
    lines = [
        "| dataset | run | tokens / target call | tokens / s (updates included) | updates kept | update s | undone |",
        "|---|---|---|---|---|---|---|",
    ]
    tps = {}
    for d in datasets:
        for run in runs:
            sel = [r for r in rows if r["run"] == run and (d == "overall" or r["dataset"] == d)]
            t, c, w, u, n, rv = _sums(sel)
            tps[(d, run)] = t / w
            lines.append(f"| {d} | {run} | {t / c:.3f} | {t / w:.2f} | {n} | {u:.1f} | {rv} |")
    lines += [
        "",
        "| dataset | SpecBlock lead over EAGLE-3 (tokens/s) | with adaptation (both adapting) |",
        "|---|---|---|",
    ]
    for d in datasets:
        if all((d, r) in tps for r in ("specblock", "eagle3", "specblock+adapt", "eagle3+adapt")):
            plain = tps[(d, "specblock")] / tps[(d, "eagle3")] - 1
            adapted = tps[(d, "specblock+adapt")] / tps[(d, "eagle3+adapt")] - 1
            lines.append(f"| {d} | {plain * 100:+.1f} % | {adapted * 100:+.1f} % |")
    return "\n".join(lines) + "\n"


def plot(rows, path: Path) -> None:
    fig = Figure(figsize=(10, 3.8))
    ax1, ax2 = fig.add_subplot(1, 2, 1), fig.add_subplot(1, 2, 2)
    for run in dict.fromkeys(r["run"] for r in rows):
        sel = [r for r in rows if r["run"] == run]
        window = 3
        beta = [
            sum(r["tokens"] for r in sel[max(0, i - window + 1) : i + 1])
            / sum(r["target_calls"] for r in sel[max(0, i - window + 1) : i + 1])
            for i in range(len(sel))
        ]
        ax1.plot(range(len(sel)), beta, label=run, linestyle="--" if "adapt" not in run else "-")
        tokens = torch.tensor([r["tokens"] for r in sel], dtype=torch.float64).cumsum(0)
        wall = torch.tensor([r["wall_seconds"] for r in sel], dtype=torch.float64).cumsum(0)
        ax2.plot(
            range(len(sel)),
            (tokens / wall).tolist(),
            label=run,
            linestyle="--" if "adapt" not in run else "-",
        )
    bounds, last = [], None
    for i, r in enumerate(r for r in rows if r["run"] == rows[0]["run"]):
        if r["dataset"] != last:
            bounds.append((i, r["dataset"]))
            last = r["dataset"]
    for ax in (ax1, ax2):
        for i, name in bounds:
            ax.axvline(i, color="grey", lw=0.5)
            ax.text(i + 0.2, ax.get_ylim()[1], name, va="top", fontsize=7, color="grey")
        ax.set_xlabel("request (stream order)")
        ax.grid(alpha=0.3)
    ax1.set_ylabel("tokens / target call (rolling 3)")
    ax2.set_ylabel("cumulative tokens / s (updates included)")
    ax1.legend(fontsize=7)
    fig.tight_layout()
    FigureCanvasAgg(fig).print_png(str(path))


if __name__ == "__main__":
    main()
