"""A/B in one process: the target's forward over a few draft-tree nodes after a KV cache, with transformers'
sdpa (which copies every key/value head per query head it serves for more than one masked query) against
the decoding session's `grouped_sdpa` (query heads stacked as rows of their key head; evaluate/decoding/
target.py). The two alternate forward by forward (which one runs first alternates too); printed per tree
size: sdpa's median ms and the median of the paired differences (saved ms). With `--against per-layer-mask`
the baseline is `grouped_sdpa` itself with its mask repeated in every layer (before session 21 it was; now
once per forward, `grouped_mask`).

    python scripts/ab_grouped_attention.py [--dtype bfloat16] [--context 300] [--pairs 25] [--nodes 2 4 6 8 12]
    python scripts/ab_grouped_attention.py --against per-layer-mask
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from specblock.data.hardware import resolve_layout, set_weight_layout
from specblock.data.target import DEFAULT_TARGET_DIR, FeatureTarget, TargetConfig, load_target
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from specblock.evaluate.decoding.target import GROUPED_SDPA, TargetSession, forget_grouped_mask, grouped_sdpa

PER_LAYER = "specblock_grouped_sdpa_per_layer_mask"


def grouped_per_layer_mask(*args, **kwargs):
    """grouped_sdpa with the mask repeated in every layer (its cache of the last mask emptied first)."""
    forget_grouped_mask()
    return grouped_sdpa(*args, **kwargs)


AttentionInterface.register(PER_LAYER, grouped_per_layer_mask)
AttentionMaskInterface.register(PER_LAYER, sdpa_mask)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", default=DEFAULT_TARGET_DIR)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--layout", default="auto", help="weight_layout (data/hardware.py)")
    ap.add_argument("--context", type=int, default=300, help="cached tokens before the timed forwards")
    ap.add_argument("--pairs", type=int, default=25)
    ap.add_argument("--nodes", type=int, nargs="+", default=[2, 4, 6, 8, 12])
    ap.add_argument("--threads", type=int)
    ap.add_argument(
        "--against",
        choices=["sdpa", "per-layer-mask"],
        default="sdpa",
        help="the baseline grouped_sdpa is timed against",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    model, _ = load_target(TargetConfig(name_or_path=args.target, dtype=args.dtype))
    layout = resolve_layout(args.layout, str(model.device))
    set_weight_layout(model, layout)
    session = TargetSession(FeatureTarget(model))
    if model.config._attn_implementation != GROUPED_SDPA:
        raise SystemExit(
            f"the session left attention at {model.config._attn_implementation!r}: nothing to compare"
        )
    session.reset()
    session.forward([100 + i % 1000 for i in range(args.context)])

    def forward(n: int, impl: str) -> float:
        model.config._attn_implementation = impl
        committed = len(session)
        parents = [-1] + [i // 2 for i in range(n - 1)]  # a binary tree under the root
        start = time.perf_counter()
        session.forward([500 + i for i in range(n)], parents)
        spent = time.perf_counter() - start
        session.keep(committed, [])
        return spent * 1e3

    base = "sdpa" if args.against == "sdpa" else PER_LAYER
    for n in args.nodes:  # warm-up
        forward(n, base), forward(n, GROUPED_SDPA)
    plain = {n: [] for n in args.nodes}
    saved = {n: [] for n in args.nodes}
    for r in range(args.pairs):
        for n in args.nodes:
            order = (base, GROUPED_SDPA) if r % 2 else (GROUPED_SDPA, base)
            ms = {impl: forward(n, impl) for impl in order}
            plain[n].append(ms[base])
            saved[n].append(ms[base] - ms[GROUPED_SDPA])
    print(
        f"{args.dtype}, {layout}, {args.context}-token cache, {args.pairs} pairs, {torch.get_num_threads()} threads"
    )
    print(f"| tree nodes | {args.against} ms (median) | saved by grouped_sdpa, ms (median of pairs) |")
    print("|---|---|---|")
    for n in args.nodes:
        print(f"| {n} | {statistics.median(plain[n]):.2f} | {statistics.median(saved[n]):.2f} |")


if __name__ == "__main__":
    main()
