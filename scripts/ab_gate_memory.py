"""A/B, side by side in one process, of the drafter-on-demand gate's memory (budget.py,
`AutoBudget.lookup_alone` with n = 0, `observe_solo`): a tree with budget=auto as it is (GATE_DECAY), against
the same decoder with other decays (--decays), and drafting in every iteration (no gate). bench_decode.py's
interleaved runner and table, T = 0, bf16 by default.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_gate_memory.py \
        --drafter checkpoints/quick-specblock/drafter --dataset mgsm --prompts 4 --max-new-tokens 48 \
        --skip-forward --decays 0.8 0.9
"""

from __future__ import annotations

import argparse
import sys

import torch

from ab_loop import run_variants
from ab_solo_gate import without_gate
from bench_decode import parse_args
from specblock.data.logs import setup_logging

DEFAULTS = [
    "--methods",
    "autoregressive",
    "tree@auto",
    "--dataset",
    "gsm8k",
    "--repeats",
    "2",
    "--dtype",
    "bfloat16",
]


def with_decay(decay: float):
    def variant(dec):
        dec.auto.gate_decay = decay
        return dec

    return variant


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    ap = argparse.ArgumentParser(add_help=False)
    ap.add_argument(
        "--decays", type=float, nargs="+", default=[0.8], help="GATE_DECAY values beside today's (budget.py)"
    )
    ap.add_argument("--base", default="tree@auto", help="the gated method the variants start from")
    ours, rest = ap.parse_known_args(sys.argv[1:] if argv is None else argv)
    args = parse_args([*DEFAULTS, *rest])
    if args.threads:
        torch.set_num_threads(args.threads)
    variants = {f"{ours.base}, no gate": (ours.base, without_gate)}
    variants.update({f"{ours.base}, decay {d}": (ours.base, with_decay(d)) for d in ours.decays})
    run_variants(args, variants)


if __name__ == "__main__":
    main()
