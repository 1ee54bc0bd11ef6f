"""A/B, side by side in one process, of tree+lookup with budget=auto: now (the chain competes with the
drafter's nodes for the budget by its measured acceptance per depth, and the drafter runs on demand: an
iteration whose chain alone is expected to emit faster makes no drafter call), without the on-demand
gate, and the first version (the chain added after the drafter's own auto budget, the drafter every
iteration). bench_decode.py's interleaved runner and table: bf16, T = 0, 1 thread, prompts interleaved,
median of the repeats; lookup and the drafter's plain tree beside them.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_lookup.py [--drafter DIR] [--prompts 3]
"""

import sys

sys.path.insert(0, "scripts")
import ab_loop
from specblock.evaluate.decoding.trees import graft_chain

BASE = "tree+lookup@auto"
OLD = "tree+lookup@auto, chain after the budget"
NO_GATE = "tree+lookup@auto, drafter every iteration"
METHODS = ["--methods", "autoregressive", "lookup", "tree@auto", BASE, "--draft-length", "8"]


def no_gate(dec):
    """The decoder with the drafter in every iteration (the chain still competes for the budget)."""
    dec.auto.lookup_alone = lambda n, ngram=0: None
    return dec


def chain_after_budget(dec):
    """The decoder, drafting as the first version did: the drafter's tree cut to its own auto budget,
    then the lookup chain grafted on."""

    def tree_with_lookup(root, chain):
        tree = dec.drafts.drafter_tree(root)
        tree = tree.pruned(dec.auto.choose(tree.score[1:])).tree
        dec.drafts.scores = tree.score[1:]
        dec.graft.drafter_nodes = set(range(1, len(tree)))
        dec.graft.lookup_nodes = graft_chain(tree, chain)
        return tree

    dec.drafts.tree_with_lookup = tree_with_lookup
    return no_gate(dec)


def main(argv: list[str] | None = None) -> None:
    args = [*METHODS, *(sys.argv[1:] if argv is None else argv)]
    ab_loop.ab_tree_auto(OLD, chain_after_budget, args, base=BASE, more={NO_GATE: no_gate})


if __name__ == "__main__":
    main()
