"""A/B, side by side in one process, of the drafter on demand without a lookup chain (budget.py,
`AutoBudget.lookup_alone` with n = 0): a tree with budget=auto, and tree+lookup where no chain matched, take a
plain target step instead of a drafter call where the drafter's measured acceptance does not pay for its call
and for the wider forward; against the same decoders drafting in every such iteration (the rule before).
bench_decode.py's interleaved runner and table, T = 0, float32 by default (this Xeon's auto precision), --layout
(row by default), prompts interleaved, median of the repeats; lookup beside them.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_solo_gate.py --drafter checkpoints/quick-specblock/drafter
"""

from __future__ import annotations

import sys

import torch

from ab_loop import run_variants
from bench_decode import parse_args
from specblock.data.logs import setup_logging

GATED = ["tree@auto", "tree+lookup@auto"]
DEFAULTS = ["--methods", "autoregressive", "lookup", *GATED, "--dataset", "gsm8k", "--repeats", "2"]


def without_gate(dec):
    """The decoder drafting in every iteration without a lookup chain (the gate beside a chain stays)."""
    gate = dec.auto.lookup_alone
    dec.auto.lookup_alone = lambda n, ngram=0: gate(n, ngram) if n else None
    return dec


def main(argv: list[str] | None = None) -> None:
    setup_logging()
    args = parse_args([*DEFAULTS, *(sys.argv[1:] if argv is None else argv)])
    if args.threads:
        torch.set_num_threads(args.threads)
    run_variants(args, {f"{m}, drafter every iteration": (m, without_gate) for m in GATED})


if __name__ == "__main__":
    main()
