"""A/B, side by side in one process: tree+lookup with budget=auto, the lookup chain competing with the
drafter's nodes for the budget (now: `SpeculativeDecoder._tree_with_lookup`, the chain's measured
acceptance per depth as its confidence) or added after the drafter's own auto budget (the first
version). bench_decode.py's interleaved runner and table: bf16, T = 0, 1 thread, prompts interleaved,
median of the repeats; lookup and the drafter's plain tree beside them.

    SPECBLOCK_DATASETS=../shared/datasets python scripts/ab_tree_lookup.py [--drafter DIR] [--prompts 3]
"""

import sys

sys.path.insert(0, "scripts")
import bench_decode as bd
from specblock.evaluate.decoding.loop import graft_chain

BASE = "tree+lookup@auto"
OLD = "tree+lookup@auto, chain after the budget"
METHODS = ["--methods", "autoregressive", "lookup", "tree@auto", BASE, "--draft-length", "8"]


def chain_after_budget(dec):
    """The decoder, drafting as the first version did: the drafter's tree cut to its own auto budget,
    then the lookup chain grafted on."""

    def tree_with_lookup(root, chain):
        tree = dec._drafter_tree(root)
        tree = tree.pruned(dec.auto.choose(tree.score[1:])).tree
        dec._scores = tree.score[1:]
        dec._drafter_nodes = set(range(1, len(tree)))
        dec._lookup_nodes = graft_chain(tree, chain)
        return tree

    dec._tree_with_lookup = tree_with_lookup
    return dec


def main(argv: list[str] | None = None) -> None:
    bd.ab_tree_auto(OLD, chain_after_budget, [*METHODS, *(sys.argv[1:] if argv is None else argv)], base=BASE)


if __name__ == "__main__":
    main()
