"""A/B, side by side in one process: tree drafting with the leaves of one block (or one round) sharing
one stored copy of the drafter's cache (now: DraftCache.shared, one row of n*K' queries) or with the
cache copied into one batch row per leaf (before session 8). bench_decode.py's interleaved runner and
table: bf16, T = 0, 1 thread, prompts interleaved, median of the repeats.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_shared_cache.py [--drafter DIR] [--prompts 3]
"""

import sys

import torch

sys.path.insert(0, "scripts")
import ab_loop
from specblock.evaluate.decoding import drafters, drafting
from specblock.train.modeling.common import DraftCache

OLD = "tree@auto, cache copied per leaf"
shared_stack = drafting.stack_caches


def copied_stack(caches: list[DraftCache]) -> DraftCache:
    """The rule before: every leaf's cache copied into its own batch row."""
    if len(caches) == 1:
        return caches[0]
    keys = [torch.cat([c.keys[i] for c in caches]) for i in range(len(caches[0].keys))]
    values = [torch.cat([c.values[i] for c in caches]) for i in range(len(caches[0].values))]
    vis = torch.cat([c.visible if c.visible is not None else c.all_visible(1) for c in caches])
    return DraftCache(keys, values, vis)


class Copied:
    """A decoder that drafts with copied caches while it generates."""

    def __init__(self, dec):
        self.dec = dec

    def __getattr__(self, name):
        return getattr(self.dec, name)

    def generate(self, *args, **kwargs):
        drafting.stack_caches = drafters.stack_caches = copied_stack
        try:
            return self.dec.generate(*args, **kwargs)
        finally:
            drafting.stack_caches = drafters.stack_caches = shared_stack


def main(argv: list[str] | None = None) -> None:
    ab_loop.ab_tree_auto(OLD, Copied, argv)


if __name__ == "__main__":
    main()
