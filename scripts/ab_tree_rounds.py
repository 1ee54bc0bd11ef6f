"""A/B, side by side in one process: SpecBlock's tree with budget=auto starting its second block round
from every beam leaf (the rule before session 7: `more_rounds` said only yes or no) or only from the
leaves whose blocks the budget could keep (now). bf16, T = 0, 3 GSM8K prompts, 64 new tokens, prompts
interleaved, 2 repeats; prints a Markdown row per method (tokens per iteration, drafter calls and ms
per token, tokens/s, ratio to autoregressive decoding).

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_rounds.py [DRAFTER_DIR]
"""

import sys
import time

import torch

sys.path.insert(0, "scripts")
import bench_decode as bd
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.decoding import budget


class OldAuto(budget.AutoBudget):
    """The rule before: a further round expands every beam leaf whenever it expands any."""

    def more_rounds(self, scores, frontier):
        return len(frontier) if super().more_rounds(scores, frontier) else 0


def main() -> None:
    torch.set_num_threads(1)
    drafter = sys.argv[1] if len(sys.argv) > 1 else "checkpoints/cpu_full-specblock/drafter"
    args = bd.parse_args(
        [
            "--methods",
            "autoregressive",
            "tree@auto",
            "--drafter",
            drafter,
            "--temperature",
            "0",
            "--dataset",
            "gsm8k",
            "--prompts",
            "3",
            "--max-new-tokens",
            "64",
            "--dtype",
            "bfloat16",
            "--local-root",
            "auto",
        ]
    )
    model, tok = load_target(TargetConfig(name_or_path=args.target, dtype="bfloat16"))
    prompts = bd.load_prompts(args, tok)
    eos = bd.eos_ids(tok, model)
    decs = bd.decoders(args, model, eos)
    old = bd.decoders(args, model, eos)["tree@auto"]
    old.auto.__class__ = OldAuto
    runs = {
        "autoregressive": decs["autoregressive"],
        "tree@auto old": old,
        "tree@auto new": decs["tree@auto"],
    }
    for d in runs.values():
        d.generate(prompts[0][:40], seed=0)  # warm-up, calibration
    stats = {k: {"s": [], "tok": 0, "it": 0, "calls": 0, "dsec": 0.0} for k in runs}
    for rep in range(2):
        for p in prompts:
            for k, d in runs.items():
                t = time.perf_counter()
                g = d.generate(p, seed=0)
                dt = time.perf_counter() - t
                st = stats[k]
                st["s"].append(dt)
                st["tok"] += len(g.tokens)
                st["it"] += max(len(g.iterations), 1)
                st["calls"] += sum(i.drafter_calls for i in g.iterations)
                st["dsec"] += sum(i.drafter_seconds for i in g.iterations)
    ar = sum(stats["autoregressive"]["s"])
    print(
        "| method | tokens / iteration | drafter calls / token | drafter ms / token | tokens / s | x autoregressive |"
    )
    print("|---|---|---|---|---|---|")
    for k, st in stats.items():
        tps = st["tok"] / sum(st["s"])
        print(
            f"| {k} | {st['tok'] / st['it'] if k != 'autoregressive' else 1:.2f} | {st['calls'] / st['tok']:.2f} | {1000 * st['dsec'] / st['tok']:.1f} | {tps:.1f} | {ar / sum(st['s']):.2f}x |"
        )


if __name__ == "__main__":
    main()
