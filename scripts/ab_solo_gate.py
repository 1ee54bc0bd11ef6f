"""A/B, side by side in one process, of the drafter on demand without a lookup chain (budget.py,
`AutoBudget.lookup_alone` with n = 0): a tree with budget=auto, and tree+lookup where no chain matched, take a
plain target step instead of a drafter call where the drafter's measured acceptance does not pay for its call
and for the wider forward; against the same decoders drafting in every such iteration (the rule before).
bench_decode.py's interleaved runner and table, T = 0, float32 by default (this Xeon's auto precision), --layout
(row by default), prompts interleaved, median of the repeats; lookup beside them.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_solo_gate.py --drafter checkpoints/quick-specblock/drafter
"""

from __future__ import annotations

import logging
import sys

import torch

from bench_decode import decoders, decoding_table, interleave, load_prompts, parse_args
from specblock.data.hardware import resolve_layout, set_weight_layout
from specblock.data.logs import setup_logging
from specblock.data.target import TargetConfig, load_target
from specblock.evaluate.run import eos_ids

log = logging.getLogger(__name__)
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
    dtype = args.dtype[0]
    model, tok = load_target(TargetConfig(name_or_path=args.target, dtype=dtype))
    layout = resolve_layout(args.layout[0], args.device)  # target and drafter alike
    set_weight_layout(model, layout)
    prompts, eos = load_prompts(args, tok), eos_ids(tok, model)
    decs = decoders(args, model, eos, layout)
    for m in GATED:
        decs[f"{m}, drafter every iteration"] = without_gate(decoders(args, model, eos, layout)[m])
    log.info(
        f"weight layout {layout}; {len(prompts)} {args.dataset} prompts, {args.max_new_tokens} new tokens"
    )
    log.info(decoding_table(interleave({dtype: decs}, args, prompts), args.temperature))


if __name__ == "__main__":
    main()
